"""The registries of config schemas per Hydra group and of value rules per ``_target_``, and the helpers the
rules are written with."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from dtrain import checks


#: the type of every switch in the schemas: a boolean kept as written. OmegaConf's ``bool`` would turn
#: ``2`` or ``"yes"`` into true without a word; ``validate`` asks for ``true`` or ``false`` instead
#: (``checks.boolean``), and refuses ``0`` and ``1`` too, as the Python API does.
StrictBool = Any


# -- validation: every rule of every component, all problems at once --------------------------------
#
# A rule takes the config node and the dotted name the user knows it by (``"optimizer"``,
# ``"source.train"``) and returns one line per problem. Rules for a component live in
# ``RULES`` under its ``_target_``, so a config is checked wherever the component appears and
# a new component (a user's learner, model or source) brings its own rules with
# ``register_rule``. Value rules come from ``dtrain.checks``.

Rule = Callable[[DictConfig, str], list[str]]

RULES: dict[str, Rule] = {}
"""``_target_`` -> rule; see :func:`register_rule`."""


def register_rule(target: str, rule: Rule | None = None):
    """Registers ``rule(node, name) -> [problem lines]`` for config nodes with ``_target_ == target``.

    Usable as a decorator (``@register_rule("my.Model")``). ``name`` is the node's dotted key
    (e.g. ``"model"``), to be used in the lines: ``model.hidden=-5: expected ...``.
    """
    def add(function: Rule) -> Rule:
        RULES[target] = function
        return function
    return add(rule) if rule is not None else add


# -- schemas: each registers where it is defined ----------------------------------------------------
#
# ``dtrain.config.register_schemas`` stores every entry of ``SCHEMAS`` in Hydra's ConfigStore, so a YAML
# option extends ``/schema/<group>/<name>``. dtrain's settings modules register theirs when imported; a
# user's module registers its own the same way, before ``register_schemas`` runs.

SCHEMAS: dict[tuple[str, str], type] = {}
"""``(group, name)`` -> schema dataclass (``("schema/learner", "diloco")``); see :func:`register_schema`."""


def register_schema(group: str, name: str, schema: type | None = None):
    """Registers the dataclass ``schema`` as ``group/name`` in Hydra's ConfigStore (``schema/learner``,
    ``diloco``: ``/schema/learner/diloco``), stored there by ``dtrain.config.register_schemas``.

    Usable as a decorator above ``@dataclass`` (``@register_schema("schema/model", "my_mlp")``).
    """
    def add(node: type) -> type:
        SCHEMAS[(group, name)] = node
        return node
    return add(schema) if schema is not None else add


def key_problems(node: DictConfig, name: str, *key_checks: tuple[str, Callable[..., Any], dict]) -> list[str]:
    """Runs ``check(f"{name}.{key}", node[key], **options)`` for each ``(key, check, options)``."""
    def bind(key, check, options):
        return lambda: check(f"{name}.{key}", node[key], **options)
    return checks.collect(bind(key, check, options) for key, check, options in key_checks
                          if key in node and not OmegaConf.is_missing(node, key))


def fraction(high_inclusive: bool = False):
    """A check for a number in [0, 1) (or [0, 1] with ``high_inclusive``)."""
    def check(name, value):
        return checks.number_in_range(name, value, 0.0, 1.0, include_high=high_inclusive)
    return check


def plain(value: Any) -> Any:
    """A config node as plain Python (lists and dicts), for the problem lines."""
    if isinstance(value, (DictConfig, ListConfig)):
        return OmegaConf.to_container(value, resolve=True)
    return value


#: ``key -> check(name, value)``: a component's value rules, stated once for its constructor and ``validate``
KeyChecks = dict[str, Callable[[str, Any], Any]]


def settings_problems(key_checks: KeyChecks, values: Any, name: str = "") -> list[str]:
    """One line per value of ``values`` (a config node or a mapping) that its check refuses; the keys are
    prefixed with ``name`` (``model.hidden``), or bare when it is empty (a constructor's ``hidden``)."""
    def bind(key: str) -> Callable[[], Any]:
        return lambda: key_checks[key](f"{name}.{key}" if name else key, values[key])
    return checks.collect(bind(key) for key in key_checks if key in values
                          and not (isinstance(values, DictConfig) and OmegaConf.is_missing(values, key)))


def check_settings(key_checks: KeyChecks, **values: Any) -> None:
    """A constructor's form of :func:`settings_problems`: raises ``ValueError`` with the first problem."""
    check_fields(key_checks, values)


def check_fields(key_checks: KeyChecks, values: Any, name: str = "") -> None:
    """A config class's form (``values`` its fields, ``vars(self)``, named ``name.key``): raises ``ValueError``
    with the first problem."""
    problems = settings_problems(key_checks, values, name)
    if problems:
        raise ValueError(problems[0])


def settings_rule(key_checks: KeyChecks) -> Rule:
    """The ``validate`` rule of a component whose value rules are ``key_checks`` alone."""
    return lambda node, name: settings_problems(key_checks, node, name)
