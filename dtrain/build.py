"""Builds a training session from a composed config (model, optimizer, learner, sources, loss, metric)
and runs it: the Hydra-free half of ``python -m dtrain``, between the entry (``dtrain.cli``) and the loop."""
from __future__ import annotations

import dataclasses
import hashlib
import inspect
import os
from pathlib import Path

import torch
from hydra.errors import InstantiationException
from hydra.utils import get_object, instantiate
from omegaconf import DictConfig, ListConfig, OmegaConf

from dtrain.comm.base import first_line
from dtrain.failures import USER_ERRORS, UserError, exit_preempted
from dtrain.host_memory import keep_freed_host_memory
from dtrain.optim import optimizer_parameters
from dtrain.safe_files import create_new, first_free_name
from dtrain.threads import choose_threads
from dtrain.session import TrainingSession
from dtrain.session.binding import StreamBinding
from dtrain.session.callbacks import not_a_callback
from dtrain.session.checkpoint_state import DEFAULTS_KEY
from dtrain.session.from_settings import session_inputs
from dtrain.sweep import SweepJob


def fingerprint(cfg: DictConfig) -> str:
    """A short hash of the resolved config without its run directory (equal on every rank of a job)."""
    content = OmegaConf.to_container(cfg, resolve=True)
    content.pop("run_dir", None)
    return hashlib.sha256(OmegaConf.to_yaml(OmegaConf.create(content), sort_keys=True).encode()).hexdigest()[:16]


def checkpoint_identity(cfg: DictConfig) -> dict:
    """What only the config knows that a checkpoint must match: the model's settings and the seed.

    The session adds what the objects themselves say (the model's type, the learner and its
    optimizer's type, the training data). Sizes, rates, frequencies and the world size may change.
    """
    return {"model": OmegaConf.to_container(cfg.model, resolve=True), "seed": cfg.seed,
            DEFAULTS_KEY: {"model": schema_defaults(cfg.model)}}


def schema_defaults(node: DictConfig) -> dict:
    """The defaults of ``node``'s schema (empty without one, e.g. a user's model): a setting added to the
    schema after a checkpoint was written restores from it while it keeps its default."""
    schema = OmegaConf.get_type(node)
    if not dataclasses.is_dataclass(schema):
        return {}
    return {key: value for key, value in OmegaConf.to_container(OmegaConf.structured(schema)).items()
            if value != "???"}


def run_config(cfg: DictConfig) -> dict:
    """The resolved config as plain containers, without where the run lives or started from (the run
    directory, which may move, and ``session.checkpoint.restore_from``)."""
    content = OmegaConf.to_container(cfg, resolve=True)
    content.pop("run_dir", None)
    content.get("session", {}).get("checkpoint", {}).pop("restore_from", None)
    return content


def _instantiate(node, what: str, **kwargs):
    """``hydra.utils.instantiate`` that reports the cause of a failure, not Hydra's wrapper.

    A user error from the component (or a ``_target_`` that cannot be found) becomes a
    :class:`UserError` naming ``what``; any other cause is re-raised as itself, so the caller
    classifies it (out of memory, a bug) by its type.
    """
    try:
        return instantiate(node, **kwargs)
    except InstantiationException as error:
        cause = error.__cause__
        if cause is None or isinstance(cause, ImportError):  # a _target_ that does not exist
            message = first_line(error).split(", set env var HYDRA_FULL_ERROR")[0]
            raise UserError(f"{what}: {message}; expected an importable class or function (modules of your own are "
                            f"imported from the working directory, {os.getcwd()}, and PYTHONPATH)") from None
        if isinstance(cause, USER_ERRORS):
            raise UserError(f"{what}: {first_line(cause)}") from None
        raise cause from None


def _components(group: DictConfig | None, name: str) -> list:
    """The ``_target_`` blocks of a ``callbacks``/``logger`` mapping, built in the order given (a null entry,
    ``callbacks.early_stopping=null``, is left out)."""
    built = []
    for key, node in (group or {}).items():
        if node is None:
            continue
        if not isinstance(node, DictConfig) or "_target_" not in node:
            raise UserError(f"{name}.{key}: expected a _target_ block naming a dtrain.Callback (see "
                            f"docs/callbacks-and-loggers.md), got {OmegaConf.to_yaml(node).strip() if isinstance(node, (DictConfig, ListConfig)) else node!r}")
        component = _instantiate(node, f"{name}.{key}")
        problem = not_a_callback(component)
        if problem is not None:
            raise UserError(f"{name}.{key}: {problem}")
        built.append(component)
    return built


def _refuse_loss_beside_objective() -> None:
    """An objective computes the loss itself: a ``loss``/``metric`` override on the command line would be accepted and
    ignored, so it is refused (the recipe's own loss and metric are simply not built)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return
    given = [override for override in HydraConfig.get().overrides.task
             if override.lstrip("+~").split("=", 1)[0].split(".", 1)[0] in ("loss", "metric")]
    if given:
        raise UserError(f"{given[0]}: this run has an objective, which computes the loss and the figures it logs "
                        f"itself, so the recipe's loss and metric are not used; expected no loss or metric override "
                        f"with objective (docs/objectives.md)")


def _objective(node):
    """``objective``: the objective its ``_target_`` names, built; a plain function (not a class) is taken as it is,
    with any other keys bound as keyword arguments (as Hydra's ``_partial_: true`` does, which works too)."""
    target = node.get("_target_") if isinstance(node, DictConfig) else None
    if isinstance(target, str) and not node.get("_partial_", False):
        try:
            located = get_object(target)
        except (ImportError, ValueError):
            located = None  # _instantiate says what is wrong with it
        if inspect.isfunction(located):
            return _instantiate(node, "objective", _partial_=True)
    return _instantiate(node, "objective")


def config_path(run_dir: Path) -> Path:
    """Where this run's resolved config goes: ``config.yaml``, or for a resumed run the first free
    ``config.<n>.yaml`` (an earlier run's is never replaced)."""
    return first_free_name(run_dir / "config.yaml")


def latest_config_path(run_dir: Path) -> Path:
    """The config of the run directory's latest job: the last ``config.<n>.yaml`` a resume wrote, else
    ``config.yaml`` (which need not exist)."""
    path, index = run_dir / "config.yaml", 1
    while os.path.lexists(run_dir / f"config.{index}.yaml"):
        path = run_dir / f"config.{index}.yaml"
        index += 1
    return path


#: what every config a run writes holds, and what the tools that read a run take from it
RUN_CONFIG_KEYS = ("model._target_", "source.train", "session")


def load_run_config(run_dir: Path) -> tuple[Path, DictConfig]:
    """``(path, config)`` of the run directory's latest job (:func:`latest_config_path`), for the tools that
    read a run (``dtrain.generate``, ``dtrain.noise_scale``).

    Raises:
        FileNotFoundError: the run directory has no config.
        ValueError: one line naming the file: not YAML (or not text), or not a run's config (a key of
            :data:`RUN_CONFIG_KEYS` missing).
    """
    import yaml

    path = latest_config_path(Path(run_dir))
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; expected the run's config in a run directory")
    expected = "expected the config a dtrain run writes"
    try:
        config = OmegaConf.load(path)
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ValueError(f"{path}: not valid YAML ({error.problem or first_line(error)}{where}); {expected}") from None
    except (yaml.YAMLError, UnicodeDecodeError) as error:
        raise ValueError(f"{path}: not a YAML text file ({first_line(error)}); {expected}") from None
    missing = list(RUN_CONFIG_KEYS) if not isinstance(config, DictConfig) else \
        [key for key in RUN_CONFIG_KEYS if OmegaConf.select(config, key, default=None) is None]
    if missing:
        raise ValueError(f"{path}: has no {', '.join(missing)}; {expected} (its model, source and session)")
    return path, config


def save_config(cfg: DictConfig, run_dir: Path) -> Path:
    """Writes the resolved config into the run directory as a new file (never over an earlier one,
    and never through a link planted at its name); returns where."""
    text = OmegaConf.to_yaml(cfg, resolve=True).encode()
    while True:
        path = config_path(run_dir)
        try:
            with create_new(path) as stream:
                stream.write(text)
            return path
        except FileExistsError:  # appeared since config_path looked: take the next name
            continue


def train_from_config(comm, cfg: DictConfig, job: SweepJob | None = None) -> float | None:
    """Builds the model, learner, sources and session that ``cfg`` names on ``comm``'s ranks, trains, and returns
    the run's objective (exits with code 75 after a preemption checkpoint)."""
    # one run directory and one config for all ranks
    cfg.run_dir = comm.broadcast_object(os.path.abspath(cfg.run_dir) if comm.is_main else None, root=0)
    if cfg.get("objective") is not None:  # the objective replaces the recipe's loss and metric: none is built
        cfg.loss = None
        cfg.metric = None
    config_hash = fingerprint(cfg)
    hashes = comm.allgather_object(config_hash)
    if len(set(hashes)) > 1:
        differing = [rank for rank, value in enumerate(hashes) if value != hashes[0]]
        raise UserError(f"ranks {differing} resolved a different config than rank 0; start every rank with the same "
                        f"command line, environment and files")
    threads = choose_threads(cfg.session.num_threads, comm.local_size if comm.size > 1 else 1, torch.get_num_threads())
    torch.set_num_threads(threads.threads)
    host_memory = keep_freed_host_memory(cfg.session.keep_host_memory)

    torch.manual_seed(cfg.seed)  # identical initial model on every rank
    model = _instantiate(cfg.model, "model")
    optimizer_factory = _instantiate(cfg.optimizer, "optimizer")
    optimizer = optimizer_factory(optimizer_parameters(optimizer_factory, model))  # LARS, LAMB: norm/bias groups
    learner = _instantiate(cfg.learner, "learner", optimizer=optimizer, comm=comm)
    if cfg.get("fault_tolerance") is not None and cfg.fault_tolerance.enabled:
        _make_elastic(learner, cfg.fault_tolerance)
    train_source = _instantiate(cfg.source.train, f"source.train (data.root={cfg.data.root})")
    cv_source = _instantiate(cfg.source.cv, "source.cv") if cfg.source.cv is not None else None
    test_source = cv_source if _same_data(cfg.source.test, cfg.source.cv) else \
        _instantiate(cfg.source.test, "source.test") if cfg.source.test is not None else None
    inputs = session_inputs(cfg.session)
    check_model_outputs(model, train_source, cfg.model.get("num_classes"), StreamBinding(inputs, cfg.session.target))
    torch.manual_seed(cfg.seed + 1 + comm.rank)  # dropout and other noise differ between ranks

    run_dir = Path(cfg.run_dir)
    objective = _objective(cfg.objective) if cfg.get("objective") is not None else None
    if objective is not None:
        _refuse_loss_beside_objective()
    loss = _instantiate(cfg.loss, "loss") if objective is None else None
    metric = _instantiate(cfg.metric, "metric") if objective is None else None
    callbacks = [*_components(cfg.callbacks, "callbacks"), *_components(cfg.logger, "logger")]
    trainer = TrainingSession.from_settings(
        model, loss, learner, train_source, cfg.session, cv_source=cv_source, test_source=test_source,
        metric=metric,
        objective=objective,
        run_dir=run_dir,
        config_fingerprint=config_hash,
        checkpoint_identity=checkpoint_identity(cfg),
        run_config=run_config(cfg),
        callbacks=callbacks,
    )
    trainer.restore()  # a bad checkpoint is reported before anything is written
    trainer.when_checks_pass(lambda: save_config(cfg, run_dir))  # after the first minibatch's checks too
    if comm.is_main:
        print(f"dtrain: recipe {cfg.recipe_name}, run directory {run_dir} (config in {config_path(run_dir).name})",
              flush=True)
        print(f"dtrain: {threads.describe(per_process=comm.size > 1)}", flush=True)
        print(f"dtrain: {host_memory.describe()}", flush=True)
    result = trainer.train()
    if result.preempted:
        exit_preempted(comm, cfg, result, sweep_dir=job.sweep_dir if job is not None else None)
    return result.objective


def _make_elastic(learner, section) -> None:
    """Makes ``learner`` one replica group of an elastic job (``fault_tolerance.enabled``); a learner that cannot be
    is refused in one line before the Lighthouse is contacted."""
    from dtrain.learners.block import BlockLearner
    from dtrain.learners.elastic import elastic_problems
    from dtrain.learners.elastic import ElasticGroups
    from dtrain.learners.elastic_settings import lighthouse_address

    problems = elastic_problems(learner) if isinstance(learner, BlockLearner) else \
        [f"fault_tolerance.enabled=true: learner {type(learner).__name__} is not elastic yet"]
    if problems:
        raise UserError(problems[0])
    learner.make_elastic(ElasticGroups(lighthouse_address(section), section.replica_id, section.min_groups,
                                       section.timeout_s, section.quorum_timeout_s))


def _same_data(test, cv) -> bool:
    """Whether ``source.test`` is configured as ``source.cv`` (the same data, read the same way): then one source
    serves both, and the session does not evaluate the final model twice on it."""
    if test is None or cv is None:
        return False
    return OmegaConf.to_container(test, resolve=True) == OmegaConf.to_container(cv, resolve=True)


def check_model_outputs(model: torch.nn.Module, source, num_classes=None, binding: StreamBinding | None = None) -> None:
    """Raises :class:`UserError` when the model's output size differs from the target's class count.

    Two-stream data: one forward pass of a zero input of the data's feature shape. Named streams:
    one forward pass of the first sequence, read through the source's deserializer (its position
    does not move), when the target is an integer stream that declares ``num_classes``. Both in
    eval mode and without gradients (no parameter, buffer or random state changes), before any
    training; a model that fails on that input is left to fail in training with its own message.
    """
    deserializer = getattr(source, "deserializer", None)
    classes, shape = getattr(deserializer, "num_classes", None), getattr(deserializer, "feature_shape", None)
    streams = getattr(source, "streams", None)
    binding = binding or StreamBinding()
    if classes is not None and shape is not None:
        inputs, target_name = (torch.zeros(1, *shape),), "labels"

        def forward():
            return model(*inputs)
    elif streams is not None and binding.target is not None and binding.target.name in streams \
            and streams[binding.target.name].num_classes is not None \
            and not streams[binding.target.name].dtype.is_floating_point:
        classes, target_name = streams[binding.target.name].num_classes, binding.target.name
        try:
            first = source.first_minibatch()
        except Exception:  # noqa: BLE001 - a read problem is reported by training itself, with its own line
            return

        def forward():
            return binding.forward(model, first)
    else:
        return
    was_training = model.training
    try:
        model.eval()
        with torch.no_grad():
            output = forward()
    except Exception:  # noqa: BLE001 - see the docstring
        if classes is not None and shape is not None:
            raise
        return
    finally:
        model.train(was_training)
    outputs = output.shape[-1] if isinstance(output, torch.Tensor) and output.dim() else None
    if outputs is not None and outputs != classes:
        setting = f"model.num_classes={num_classes}" if num_classes is not None else "the model"
        what = f"the training data ({type(deserializer).__name__})" if target_name == "labels" and shape is not None \
            else f"the target stream {target_name!r}"
        expected = f"model.num_classes={classes}" if num_classes is not None else f"a model with {classes} outputs"
        raise UserError(f"{setting}: the model has {outputs} outputs but {what} has {classes} classes; expected "
                        f"{expected}")
