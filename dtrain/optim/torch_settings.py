"""The config schemas of ``optimizer=sgd|adam|adamw`` and their value rules."""
from __future__ import annotations

from dataclasses import dataclass

from omegaconf import DictConfig

from dtrain import checks
from dtrain.optim.settings import OPTIMIZER
from dtrain.rules import (KeyChecks, StrictBool, fraction as _fraction, key_problems as _check, register_rule,
                          register_schema, settings_rule)


# -- optimizers (partial: the parameters are passed when the model exists) -------------------------


@register_schema("schema/optimizer", "sgd")
@dataclass
class SGDConfig:
    """``torch.optim.SGD``; ``lr`` is per minibatch of the mean loss (PyTorch's convention)."""

    _target_: str = "torch.optim.SGD"
    _partial_: bool = True
    lr: float = 0.1
    momentum: float = 0.0
    dampening: float = 0.0
    weight_decay: float = 0.0
    nesterov: StrictBool = False


@register_schema("schema/optimizer", "adam")
@dataclass
class AdamConfig:
    """``dtrain.optimizers.Adam`` (``torch.optim.Adam`` with CNTK's names for its two averages).

    ``momentum`` is Adam's beta1 and ``variance_momentum`` its beta2, so a recipe's
    ``optimizer.momentum`` and ``session.momentum_time_constant_schedule`` mean the same for
    SGD and Adam, and every optimizer combines with every recipe.
    """

    _target_: str = "dtrain.optimizers.Adam"
    _partial_: bool = True
    lr: float = 1e-3
    momentum: float = 0.9
    variance_momentum: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0


@register_schema("schema/optimizer", "adamw")
@dataclass
class AdamWConfig(AdamConfig):
    """``dtrain.optimizers.AdamW`` (``torch.optim.AdamW``, decoupled weight decay, with CNTK's names
    for its two averages as :class:`AdamConfig`); DiLoCo's inner optimizer."""

    _target_: str = "dtrain.optimizers.AdamW"
    weight_decay: float = 0.01


# -- optimizers
@register_rule("torch.optim.SGD")
def _sgd_rules(node: DictConfig, name: str) -> list[str]:
    problems = _check(
        node, name,
        ("lr", checks.positive_number, {}),
        ("momentum", _fraction(), {}),
        ("dampening", _fraction(high_inclusive=True), {}),
        ("weight_decay", checks.positive_number, {"allow_zero": True}),
        ("nesterov", checks.boolean, {}),
    )
    if not problems and node.get("nesterov") and (node.get("momentum", 0) == 0 or node.get("dampening", 0) != 0):
        problems.append(f"{name}.nesterov=true: expected {name}.momentum above 0 and {name}.dampening=0 "
                        f"(Nesterov momentum needs both)")
    return problems


#: the value rules of ``dtrain.optimizers.Adam`` and ``AdamW``, used by their constructors and by ``validate``
ADAM: KeyChecks = {key: OPTIMIZER[key] for key in ("lr", "momentum", "variance_momentum", "eps", "weight_decay")}
register_rule("dtrain.optimizers.AdamW", settings_rule(ADAM))
register_rule("dtrain.optimizers.Adam", settings_rule(ADAM))
