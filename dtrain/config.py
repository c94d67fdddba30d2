"""The root config schema, the registration of every schema in Hydra's ConfigStore, and ``validate``.

Each component's schema and value rules live beside it (``dtrain/<package>/settings.py``), each schema
registered there under its Hydra group (:func:`register_schema`); each YAML option in ``conf/<group>/``
extends one of the schemas (``/schema/<group>/<name>``), so a misspelt key or a value of the wrong type
fails when the config is composed, naming the key. ``validate`` then checks
everything else before anything is built or written and reports every problem at once: keys added
with ``+`` that a schema does not have, the rules each component registers under its ``_target_``
(:data:`RULES`, :func:`register_rule`; a user's module is imported first, so its rules count too),
the session and comm sections, NaN or infinity in any number, and whether ``run_dir`` can be written.
"""
from __future__ import annotations

import dataclasses
import difflib
import importlib
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Dict

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from dtrain import checks
# the settings modules register their schemas (register_schema) when imported: every one dtrain ships is
# imported here, so register_schemas stores them all
from dtrain.comm.settings import CommConfig, comm_problems
from dtrain.data.settings import SourceConfig
from dtrain.exchange import settings as _exchange_settings  # noqa: F401 -- registers its schemas
from dtrain.learners.elastic_settings import FaultToleranceConfig, fault_tolerance_problems
from dtrain.learners.settings import RETIRED, retired_setting
from dtrain.models import settings as _model_settings  # noqa: F401 -- registers its schemas
from dtrain.optim import settings as _optim_settings  # noqa: F401 -- registers its schemas
from dtrain.optim import torch_settings as _torch_optim_settings  # noqa: F401 -- registers its schemas
from dtrain.rules import (RULES, SCHEMAS, Rule, StrictBool, key_problems as _check, register_rule,
                          register_schema)
from dtrain.session import objective_settings as _objective_settings  # noqa: F401 -- registers its schemas
from dtrain.session.batchnorm import batchnorm_setting_problems
from dtrain.session.configs import restore_from_problems
from dtrain.session.settings import SessionConfig, session_problems

__all__ = ["DTrainConfig", "RULES", "Rule", "SCHEMAS", "StrictBool", "register_rule", "register_schema",
           "register_schemas", "validate"]


@dataclass
class DataConfig:
    root: str = "data"                  # where data sets are read from (and downloaded to)


@dataclass
class DTrainConfig:
    """The whole job. A recipe (``+recipe=NAME``) chooses model, source and values."""

    recipe_name: str = MISSING
    run_dir: str = MISSING
    seed: int = 0
    learner: Any = MISSING
    optimizer: Any = MISSING
    # a recipe's learning rate per optimizer preset (sgd, adam, adamw); each preset's lr reads its
    # entry, so a learner preset that chooses another optimizer (learner=diloco: adamw) gets a
    # learning rate tuned for it; optimizer.lr=... on the command line still wins
    optimizer_lr: Dict[str, float] = field(default_factory=dict)
    # the same for other settings that only suit one optimizer (optimizer_settings.adamw.weight_decay:
    # AdamW's decoupled decay would be a heavy L2 penalty under SGD); each preset reads its own entries
    optimizer_settings: Dict[str, Dict[str, float]] = field(default_factory=dict)
    model: Any = MISSING
    source: SourceConfig = MISSING
    session: SessionConfig = field(default_factory=SessionConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    # an elastic run: this process is one replica group on torchft (docs/fault-tolerance.md)
    fault_tolerance: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)
    data: DataConfig = field(default_factory=DataConfig)
    recipe: Any = None
    loss: Any = MISSING                 # conf/loss: loss(output, labels) -> mean over the minibatch
    metric: Any = MISSING               # conf/metric: metric(output, labels) -> sum over the minibatch
    # conf/callbacks and conf/logger: named _target_ blocks (callbacks=[early_stopping,best_checkpoint],
    # logger=[wandb,mlflow]), each a dtrain.Callback; called in this order, callbacks then loggers
    callbacks: Dict[str, Any] = field(default_factory=dict)
    logger: Dict[str, Any] = field(default_factory=dict)
    # your own objective(model, minibatch) -> loss or (loss, figures), a _target_ block; it replaces the
    # recipe's loss and metric (docs/objectives.md)
    objective: Any = None


register_schema("schema", "config", DTrainConfig)


def register_schemas() -> None:
    """Stores every schema registered so far (:func:`register_schema`: dtrain's, and those of a user's modules
    imported before) in Hydra's ConfigStore, and registers the ``epochs`` resolver (idempotent)."""
    store = ConfigStore.instance()
    for (group, name), node in SCHEMAS.items():
        store.store(group=group, name=name, node=node)
    if not OmegaConf.has_resolver("epochs"):
        OmegaConf.register_new_resolver("epochs", epochs_in_samples)


def epochs_in_samples(count: Any, *, _root_: DictConfig) -> int:
    """``${epochs:N}``: N epochs of ``session.epoch_size`` samples, for a recipe's ``max_samples``,
    frequencies and schedules (CNTK's ``-n`` and ``-e``: ``docs/porting-from-cntk.md``)."""
    epoch_size = _root_.session.epoch_size
    if epoch_size is None:
        raise ValueError(f"${{epochs:{count}}} needs session.epoch_size; expected session.epoch_size=SAMPLES")
    checks.sample_count("session.epoch_size", epoch_size)
    samples = checks.positive_number(f"${{epochs:{count}}}", count, unit="epochs") * epoch_size
    if samples != int(samples):
        raise ValueError(f"${{epochs:{count}}} is {samples:g} samples of session.epoch_size={epoch_size}; expected "
                         f"a whole number of samples")
    return int(samples)


def _epoch_size_problems(cfg: DictConfig) -> list[str]:
    """``session.epoch_size`` set while no value refers to it would change nothing: refused, not ignored."""
    epoch_size = cfg.session.epoch_size
    if epoch_size is None:
        return []
    written = OmegaConf.to_container(cfg, resolve=False)

    def refers(value: Any) -> bool:
        if isinstance(value, dict):
            return any(refers(item) for item in value.values())
        if isinstance(value, list):
            return any(refers(item) for item in value)
        return isinstance(value, str) and ("session.epoch_size" in value or "${epochs:" in value)
    if refers(written):
        return []
    return [f"session.epoch_size={epoch_size!r}: no setting of this config refers to it, so it would change nothing; "
            f"expected max_samples, frequencies or schedules written as ${{epochs:N}} or ${{session.epoch_size}} "
            f"(docs/porting-from-cntk.md)"]


def run_dir_problems(run_dir: Any) -> list[str]:
    """Whether ``run_dir`` can be the run directory: a writable directory, or creatable in one.

    Reads the file system only (nothing is created), so it runs before anything is written.
    """
    key = "run_dir"
    if not isinstance(run_dir, str) or not run_dir.strip():
        return [f"{key}={run_dir!r}: expected the path of a directory (e.g. run_dir=outputs/my_run)"]
    path = os.path.abspath(run_dir)
    if os.path.lexists(path) and not os.path.isdir(path):
        kind = "an empty file" if os.path.isfile(path) and os.path.getsize(path) == 0 else "a file"
        return [f"{key}={run_dir}: is {kind}, not a directory; expected a directory (or a path that does not exist yet)"]
    existing = path
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        return [f"{key}={run_dir}: {existing} is a file, so no directory can be made below it; "
                f"expected a path below a directory"]
    if not os.access(existing, os.W_OK | os.X_OK):
        what = "the run directory" if existing == path else f"{existing}, where it would be created,"
        return [f"{key}={run_dir}: {what} is not writable (read-only or no permission); "
                f"expected a writable directory"]
    return []


# -- generic walks: unknown keys and non-finite numbers anywhere ----------------------------------


def _walk(node: DictConfig | ListConfig, name: str) -> Iterator[tuple[str, DictConfig | ListConfig, Any, Any]]:
    """Yields ``(dotted key, parent node, key, value)`` for every set value below ``node`` (resolved)."""
    keys = range(len(node)) if isinstance(node, ListConfig) else list(node.keys())
    for key in keys:
        path = f"{name}[{key}]" if isinstance(node, ListConfig) else (f"{name}.{key}" if name else str(key))
        if isinstance(node, DictConfig) and OmegaConf.is_missing(node, key):
            continue
        value = node[key]
        yield path, node, key, value
        if isinstance(value, (DictConfig, ListConfig)):
            yield from _walk(value, path)


def _unknown_key_problems(node: DictConfig, name: str) -> list[str]:
    """Keys added to a typed section that its schema does not have (``+session.max_sample=640``)."""
    schema = node._metadata.object_type
    if not (isinstance(schema, type) and dataclasses.is_dataclass(schema)):
        return []
    known = [item.name for item in dataclasses.fields(schema)]
    problems = []
    for key in node.keys():
        if key not in known:
            full = f"{name}.{key}" if name else str(key)
            if name == "learner" and key in RETIRED:  # a learner setting of an earlier release: what to write now
                problems.append(retired_setting(str(key), node[key], prefix=f"{name}."))
                continue
            close = difflib.get_close_matches(str(key), [k for k in known if not k.startswith("_")], n=1)
            hint = f"did you mean {(name + '.') if name else ''}{close[0]}?" if close else \
                f"expected one of {', '.join(k for k in known if not k.startswith('_'))}"
            problems.append(f"{full}: unknown key ({schema.__name__} has no such setting); {hint}")
    return problems


def validate(cfg: DictConfig, *, check_run_dir: bool = True) -> list[str]:
    """Every problem in a composed config, one line each (empty when the config is sound).

    Checks, all at once: unknown keys in typed sections (with or without ``+``), the rules
    registered for each ``_target_`` (learner, optimizer, model, sources, transforms, ...), the
    session and comm sections, NaN or infinity in any number, and (with ``check_run_dir``)
    whether ``run_dir`` can be written. Nothing is built or written.
    """
    if any(OmegaConf.is_missing(cfg, key) for key in ("recipe_name", "model", "source")):
        return ["no recipe chosen: add +recipe=NAME to the command line (for example +recipe=digits)"]
    problems: list[str] = []

    def run(rule: Callable[[], list[str] | None], where: str) -> None:
        try:
            problems.extend(rule() or [])
        except OmegaConfBaseException as error:  # e.g. an interpolation that does not resolve
            problems.append(f"{where}: {str(error).strip().splitlines()[0]}")

    run(lambda: _unknown_key_problems(cfg, ""), "config")
    nodes: list[tuple[str, DictConfig]] = []
    run(lambda: nodes.extend((path, value) for path, _, _, value in _walk(cfg, "")
                             if isinstance(value, DictConfig)), "config")
    for path, node in nodes:
        run(lambda: _unknown_key_problems(node, path), path)
        target = node.get("_target_") if "_target_" in node else None
        if isinstance(target, str) and target not in RULES:
            import_target_module(target)  # a user's component registers its rules when its module is imported
        if target in RULES:
            run(lambda: RULES[target](node, path), path)
    run(lambda: session_problems(cfg.session), "session")
    run(lambda: batchnorm_setting_problems(cfg.session), "session")
    run(lambda: _epoch_size_problems(cfg), "session.epoch_size")
    run(lambda: comm_problems(cfg.comm), "comm")
    run(lambda: fault_tolerance_problems(cfg), "fault_tolerance")
    run(lambda: _check(cfg, "", ("seed", checks.whole_number, {"low": 0})), "seed")
    if check_run_dir:
        run(lambda: run_dir_problems(cfg.run_dir), "run_dir")
    run(lambda: restore_from_problems(cfg.session.checkpoint, look=check_run_dir), "session.checkpoint.restore_from")
    # NaN or infinity in any number no rule above has already refused
    mentioned = {problem.split("=", 1)[0].split(":", 1)[0].lstrip(".") for problem in problems}

    def non_finite() -> list[str]:
        return [f"{path}={value!r}: expected a finite number" for path, _, _, value in _walk(cfg, "")
                if isinstance(value, float) and not math.isfinite(value) and path not in mentioned]
    run(non_finite, "config")
    return list(dict.fromkeys(_one_line(problem.lstrip(".")) for problem in problems))


def import_target_module(target: str) -> None:
    """Imports the module that defines ``target`` (``mymodels.MLP``: ``mymodels``), as ``instantiate`` would,
    so that its module-level :func:`register_rule` calls run before the config is validated.

    A module that cannot be imported is left to ``instantiate``, which reports it in one line as before.
    """
    parts = target.split(".")
    for length in range(len(parts), 0, -1):
        name = ".".join(parts[:length])
        try:
            importlib.import_module(name)
            return
        except ModuleNotFoundError as error:
            if error.name != name:  # the module exists but an import inside it failed: instantiate reports it
                return
        except Exception:  # noqa: BLE001 -- a module that fails to import is reported by instantiate, in one line
            return


def _one_line(problem: str) -> str:
    """A problem as one line: OmegaConf's multi-line errors (an interpolation that does not resolve) keep
    their first line, prefixed with the key they name (``full_key: ...``)."""
    first, _, rest = problem.partition("\n")
    key = next((line.split("full_key:", 1)[1].strip() for line in rest.splitlines() if "full_key:" in line), "")
    return f"{key}: {first}" if key and key not in first else first

