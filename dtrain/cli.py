"""``python -m dtrain +recipe=NAME [key=value ...]``: a thin Hydra layer over the Python API.

Every rank composes the same config; the communicator comes up first, so that a bad config or a
missing data set ends every rank with one clear line instead of a hang.
"""
from __future__ import annotations

import hashlib
import os
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import NoReturn

import hydra
import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from dtrain.comm import create_communicator, install_fail_fast
from dtrain.config import register_schemas, validate
from dtrain.help import config_directories, help_text, version
from dtrain.schedules import Schedule
from dtrain.session import CheckpointConfig, CrossValidationConfig, TestConfig, TrainingDiverged, training_session
from dtrain.session.checkpoint import CheckpointError

#: exit code for a bad config, data set or checkpoint (the user's input, not a crash)
EXIT_BAD_INPUT = 2

#: exit code after a preemption signal: a checkpoint was saved, run the same command again
EXIT_PREEMPTED = 75

#: the errors that name a bad input; anything else is a bug and keeps its traceback
USER_ERRORS = (ValueError, TypeError, FileNotFoundError, PermissionError, CheckpointError, TrainingDiverged)


class UserError(Exception):
    """A problem with what the user asked for; printed as one line."""


def config_dir() -> str:
    """The shipped config tree: ``dtrain/conf`` in an installed wheel, ``conf/`` in a source checkout."""
    package = Path(__file__).resolve().parent
    for candidate in (package / "conf", package.parent / "conf"):
        if (candidate / "config.yaml").is_file():
            return str(candidate)
    raise RuntimeError(f"dtrain's config tree is missing (looked in {package / 'conf'} and {package.parent / 'conf'})")


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
    return {"model": OmegaConf.to_container(cfg.model, resolve=True), "seed": cfg.seed}


def run_config(cfg: DictConfig) -> dict:
    """The resolved config as plain containers, without the run directory (which may move)."""
    content = OmegaConf.to_container(cfg, resolve=True)
    content.pop("run_dir", None)
    return content


def _schedule(node) -> Schedule | None:
    if node is None:
        return None
    return Schedule(OmegaConf.to_container(node["values"], resolve=True), node.epoch_size, node.warmup_samples)


def _instantiate(node, what: str, **kwargs):
    """``hydra.utils.instantiate`` that reports the cause of a failure, not Hydra's wrapper."""
    try:
        return instantiate(node, **kwargs)
    except InstantiationException as error:
        cause = error.__cause__ or error
        if isinstance(cause, USER_ERRORS):
            raise UserError(f"{what}: {cause}") from None
        raise


def _save_config(cfg: DictConfig, run_dir: Path) -> Path:
    """Writes the resolved config into the run directory without replacing an earlier one."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "config.yaml"
    index = 1
    while path.exists():
        path = run_dir / f"config.{index}.yaml"
        index += 1
    path.write_text(OmegaConf.to_yaml(cfg, resolve=True))
    return path


def run(cfg: DictConfig) -> float | None:
    """Builds everything from ``cfg`` and trains; a bad input ends every rank with one line and exit code 2.

    Returns the run's objective (``TrainingResult.objective``: test error, else the last
    cross-validation error, else the last training error), which Hydra's sweepers minimise.
    """
    problems = validate(cfg)
    if problems:
        _exit_bad_input("; ".join(problems))
    comm = create_communicator(cfg.comm.backend, timeout_s=cfg.comm.timeout_s)
    install_fail_fast(comm)
    try:
        objective = _run_with(comm, cfg)
    except (UserError, *USER_ERRORS) as error:
        message = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        if os.environ.get("DTRAIN_DEBUG") == "1":
            traceback.print_exc()
        if comm.size == 1:
            _exit_bad_input(message)
        if not comm.is_main:
            time.sleep(2.0)  # the same error on rank 0 is reported once, and its abort ends this rank first
        comm.abort(f"dtrain: error: {message}", EXIT_BAD_INPUT)
    comm.finalize()
    return objective


def _exit_bad_input(message: str) -> NoReturn:
    print(f"dtrain: error: {message}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(EXIT_BAD_INPUT)


def _run_with(comm, cfg: DictConfig) -> float | None:
    # one run directory and one config for all ranks
    cfg.run_dir = comm.broadcast_object(os.path.abspath(cfg.run_dir) if comm.is_main else None, root=0)
    config_hash = fingerprint(cfg)
    hashes = comm.allgather_object(config_hash)
    if len(set(hashes)) > 1:
        differing = [rank for rank, value in enumerate(hashes) if value != hashes[0]]
        raise UserError(f"ranks {differing} resolved a different config than rank 0; start every rank with the same "
                        f"command line, environment and files")
    threads = cfg.session.num_threads or (max(1, (os.cpu_count() or 1) // comm.local_size) if comm.size > 1 else None)
    if threads:
        torch.set_num_threads(threads)

    torch.manual_seed(cfg.seed)  # identical initial model on every rank
    model = _instantiate(cfg.model, "model")
    optimizer = _instantiate(cfg.optimizer, "optimizer")(model.parameters())
    learner = _instantiate(cfg.learner, "learner", optimizer=optimizer, comm=comm)
    train_source = _instantiate(cfg.source.train, f"source.train (data.root={cfg.data.root})")
    test_source = _instantiate(cfg.source.test, "source.test") if cfg.source.test is not None else None
    cv_source = _instantiate(cfg.source.cv, "source.cv") if cfg.source.cv is not None else None
    torch.manual_seed(cfg.seed + 1 + comm.rank)  # dropout and other noise differ between ranks

    session = cfg.session
    run_dir = Path(cfg.run_dir)
    mb_schedule = _schedule(session.minibatch_size_schedule)
    loss = _instantiate(cfg.loss, "loss")
    metric = _instantiate(cfg.metric, "metric")
    trainer = training_session(
        model=model,
        loss=loss,
        metric=metric,
        learner=learner,
        minibatch_source=train_source,
        minibatch_size=mb_schedule or session.minibatch_size,
        max_samples=session.max_samples,
        progress_frequency=session.progress_frequency,
        checkpoint_config=CheckpointConfig(**OmegaConf.to_container(session.checkpoint, resolve=True)),
        cv_config=CrossValidationConfig(cv_source, session.cv.frequency, session.cv.minibatch_size,
                                        max_samples=session.cv.max_samples) if cv_source is not None else None,
        test_config=TestConfig(test_source, session.test.minibatch_size) if test_source is not None else None,
        lr_schedule=_schedule(session.lr_schedule),
        momentum_time_constant_schedule=_schedule(session.momentum_time_constant_schedule),
        unit_gain_momentum=session.unit_gain_momentum,
        run_dir=run_dir,
        tensorboard=session.tensorboard,
        progress_bar=session.progress_bar,
        config_fingerprint=config_hash,
        checkpoint_identity=checkpoint_identity(cfg),
        run_config=run_config(cfg),
    )
    trainer.restore()  # a bad checkpoint is reported before anything is written
    if comm.is_main:
        saved = _save_config(cfg, run_dir)
        print(f"dtrain: recipe {cfg.recipe_name}, run directory {run_dir} (config in {saved.name})", flush=True)
    result = trainer.train()
    if result.preempted:
        comm.finalize()
        sys.stdout.flush()
        os._exit(EXIT_PREEMPTED)
    return result.objective


def sweep_run_dir(cfg: DictConfig) -> str | None:
    """In a sweep (``-m``), the job's own run directory, ``hydra.sweep.dir/<job number>``; ``None`` otherwise.

    Raises:
        UserError: ``run_dir`` was set on the command line of a sweep (every job would share it), or
            a launcher would start several independent copies of each job.
    """
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return None
    hydra_cfg = HydraConfig.get()
    if any(override.lstrip("+~").split("=", 1)[0] == "run_dir" for override in hydra_cfg.overrides.task):
        raise UserError(_RUN_DIR_IN_SWEEP)
    tasks = os.environ.get("SUBMITIT_LOCAL_NTASKS", "1")
    if tasks != "1":
        raise UserError(_submitit_local_copies(tasks))
    return hydra_cfg.runtime.output_dir


_RUN_DIR_IN_SWEEP = ("run_dir cannot be set in a sweep (-m): every job gets its own directory, hydra.sweep.dir/<job "
                     "number>; choose where with hydra.sweep.dir=DIR (the same DIR again resumes each job)")


def _submitit_local_copies(tasks: str) -> str:
    return (f"hydra/launcher=submitit_local with tasks_per_node={tasks} starts {tasks} independent copies of each job; "
            f"set hydra.launcher.tasks_per_node=1 (under Slurm, submitit_slurm's tasks of one job form one "
            f"distributed job)")


@hydra.main(version_base="1.3", config_path=config_dir(), config_name="config")
def _hydra_main(cfg: DictConfig) -> float | None:
    try:
        job_dir = sweep_run_dir(cfg)
    except UserError as error:
        _exit_bad_input(str(error))
    if job_dir is not None:
        cfg.run_dir = job_dir
    return run(cfg)


def available_recipes(argv: list[str]) -> list[str]:
    """Recipe names in the shipped tree and in any ``--config-dir``/``-cd`` given on the command line."""
    return sorted({p.stem for d in config_directories(config_dir(), argv) for p in (d / "recipe").glob("*.yaml")})


def check_recipe_argument(argv: list[str]) -> str | None:
    """One-line problem with ``+recipe=NAME`` on the command line (unknown name), else ``None``."""
    for argument in argv:
        if argument.startswith(("+recipe=", "recipe=")):
            name = argument.split("=", 1)[1]
            known = available_recipes(argv)
            if name not in known:
                return (f"unknown recipe {name!r}; expected one of {', '.join(known)} "
                        f"(or put your own recipe/{name}.yaml in a directory passed with --config-dir)")
    return None


def check_overrides(argv: list[str]) -> str | None:
    """Composes the config once to turn Hydra's multi-line override errors into one line.

    Skipped when Hydra flags (``--cfg``, ``-m``, ...) are present: Hydra then reports by itself.
    """
    if any(argument.startswith("-") for argument in argv):
        return None
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
            compose("config", overrides=argv)
    except (HydraException, OmegaConfBaseException) as error:
        lines = str(error).strip().splitlines()
        parts = [lines[0]]
        options = [line.strip() for line in lines if line.startswith("\t") and "provider=" not in line]
        if "Available options" in str(error) and options:
            parts.append(f"(available: {', '.join(options)})")
        if error.__cause__ is not None and str(error.__cause__).strip():
            parts.append(str(error.__cause__).strip().splitlines()[0])
        if len(parts) == 1 or "Available options" not in str(error):
            parts.append("(python -m dtrain +recipe=NAME --cfg job lists every key)")
        return " ".join(parts)
    return None


def check_sweep_arguments(argv: list[str]) -> str | None:
    """One-line problem with a sweep's command line (``-m``) before any job starts, else ``None``:
    ``run_dir`` given (every job would share it), or ``submitit_local`` with several tasks per job."""
    if not any(argument in ("-m", "--multirun") for argument in argv):
        return None
    values = {argument.lstrip("+~").split("=", 1)[0]: argument.split("=", 1)[1]
              for argument in argv if "=" in argument and not argument.startswith("-")}
    if "run_dir" in values:
        return _RUN_DIR_IN_SWEEP
    tasks = values.get("hydra.launcher.tasks_per_node", "1")
    if values.get("hydra/launcher") == "submitit_local" and tasks != "1":
        return _submitit_local_copies(tasks)
    return None


def _one_line_warning(message, category, filename, lineno, line=None) -> str:
    return f"dtrain: warning: {message}\n"


def main() -> None:
    """Entry point of ``python -m dtrain`` and the ``dtrain`` command."""
    warnings.formatwarning = _one_line_warning
    argv = sys.argv[1:]
    if "--help" in argv or "-h" in argv:  # dtrain's own help; Hydra's stays at --hydra-help
        print(help_text(config_dir(), argv), end="")
        sys.exit(0)
    if "--version" in argv:
        print(f"dtrain {version()}")
        sys.exit(0)
    register_schemas()
    problem = check_recipe_argument(argv) or check_overrides(argv) or check_sweep_arguments(argv)
    if problem:
        _exit_bad_input(problem)
    _hydra_main()


if __name__ == "__main__":
    main()
