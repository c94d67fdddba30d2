"""``python -m dtrain +recipe=NAME [key=value ...]``: a thin Hydra layer over the Python API.

Every rank composes the same config; the communicator comes up first, so that a bad config or a
missing data set ends every rank with one clear line instead of a hang.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shlex
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
from omegaconf import DictConfig, ListConfig, OmegaConf

from dtrain.comm import create_communicator, detect_launcher, install_fail_fast, start_heartbeat
from dtrain.comm.base import first_line, format_rank_message
from dtrain.comm.failfast import exception_message
from dtrain.config import register_schemas, validate
from dtrain.optim import optimizer_parameters
from dtrain.session.lr_scaling import LearningRateScaling
from dtrain.help import config_dir, config_directories, nested_group_hint, quick_answer
from dtrain.host_memory import keep_freed_host_memory
from dtrain.schedules import Schedule
from dtrain.threads import choose_threads
from dtrain.session import CheckpointConfig, CrossValidationConfig, TestConfig, TrainingDiverged, training_session
from dtrain.session.binding import StreamBinding
from dtrain.session.checkpoint import CheckpointError
from dtrain.session.configs import device_and_profile_options
from dtrain.session.safe_files import create_new
from dtrain.sweep import (JobFailed, SweepJob, agree_on_failure, current_job, finish_sweep, record_outcome, start_sweep,
                          sweep_outcomes)

#: exit code for a bad config, data set or checkpoint (the user's input, not a crash)
EXIT_BAD_INPUT = 2

#: exit code after a preemption signal: a checkpoint was saved, run the same command again
EXIT_PREEMPTED = 75

#: the errors that name a bad input (exit code 2); anything else is reported as a failure (exit code 1)
USER_ERRORS = (ValueError, TypeError, FileNotFoundError, PermissionError, CheckpointError, TrainingDiverged)


class UserError(Exception):
    """A problem with what the user asked for; printed as one line."""


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
    """The resolved config as plain containers, without where the run lives or started from (the run
    directory, which may move, and ``session.checkpoint.restore_from``)."""
    content = OmegaConf.to_container(cfg, resolve=True)
    content.pop("run_dir", None)
    content.get("session", {}).get("checkpoint", {}).pop("restore_from", None)
    return content


def _schedule(node, warmup: bool = True) -> Schedule | None:
    """The schedule a ``ScheduleConfig`` node describes; ``warmup=False``: without its warm-up (``lr_scaling``'s)."""
    if node is None:
        return None
    return Schedule(OmegaConf.to_container(node["values"], resolve=True), node.epoch_size,
                    node.warmup_samples if warmup else 0)


def _lr_scaling(session) -> LearningRateScaling | None:
    """``session.lr_scaling``: warmed up over ``session.lr_schedule.warmup_samples`` from the unscaled lr."""
    if session.lr_scaling == "none":
        return None
    warmup = session.lr_schedule.warmup_samples if session.lr_schedule is not None else 0
    return LearningRateScaling(session.lr_scaling, session.minibatch_size, session.lr_reference_minibatch_size, warmup)


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


def config_path(run_dir: Path) -> Path:
    """Where this run's resolved config goes: ``config.yaml``, or for a resumed run the first free
    ``config.<n>.yaml`` (an earlier run's is never replaced)."""
    path, index = run_dir / "config.yaml", 1
    while os.path.lexists(path):
        path = run_dir / f"config.{index}.yaml"
        index += 1
    return path


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


def run(cfg: DictConfig, job: SweepJob | None = None) -> float | None:
    """Builds everything from ``cfg``, trains, and returns the run's objective.

    The objective (``TrainingResult.objective``: test error, else the last cross-validation
    error, else the last training error) is what Hydra's sweepers minimise.

    Any failure ends every rank of the job with one line, the failing rank's first: a bad
    input (config, run directory, data set, checkpoint, a minibatch too large for memory) with
    ``dtrain: error: ...`` and exit code 2, anything else with the exception's one line and
    exit code 1 (``DTRAIN_DEBUG=1`` adds the traceback). Exceptions never reach Hydra, whose
    traceback printer and ``sys.exit`` would leave the other ranks waiting in ``MPI_Finalize``.

    In a sweep (``job``), a failure that every rank of the job meets ends the job alone: rank 0
    prints its line and every rank raises :class:`JobFailed` (Hydra's failed job), so the sweep goes
    on. A failure of some ranks only still ends the whole sweep as above, since the others are
    inside a collective that will never complete.
    """
    # every rank looks (only rank 0 writes): a rank that went on into start-up alone would leave the
    # launcher to tear down a half-started job. In a sweep, the file system is looked at once the
    # ranks can agree on what they saw (a rank going on to the next job alone would pair jobs wrongly)
    problems = validate(cfg, check_run_dir=job is None)
    if problems:
        _fail_before_job("; ".join(problems), job=job)
    try:
        comm = create_communicator(cfg.comm.backend, timeout_s=cfg.comm.timeout_s)
    except Exception as error:  # noqa: BLE001 -- before the job exists; MPI start-up failures abort by themselves
        _debug_traceback()
        message, code = describe_failure(error, cfg)
        _fail_before_job(message, code, job=job)
    install_fail_fast(comm)
    heartbeat = start_heartbeat(comm, cfg.comm.heartbeat_timeout_s)  # comm.finalize() stops it
    failure = None
    try:
        if job is not None:
            _agree_on_the_file_system(comm, cfg)
        objective = _run_with(comm, cfg, job)
    except Exception as error:  # noqa: BLE001 -- every failure ends the whole job, with one line
        _debug_traceback()
        message, code = describe_failure(error, cfg)
        if job is None:
            end_job(comm, message, code, lost_peer=is_lost_peer(error))
        failure = (message, code, "diverged" if isinstance(error, TrainingDiverged) else "failed", is_lost_peer(error))
    if failure is not None:  # outside the except block: the failed job's objects are freed before the next job
        _end_failed_job(comm, heartbeat, cfg, *failure)
    comm.finalize()  # stops the heartbeat once every rank has arrived: rank 0 may still be writing its outputs
    return objective


def _fail_before_job(message: str, code: int = EXIT_BAD_INPUT, *, job: SweepJob | None) -> NoReturn:
    """A failure before the job's communicator exists: outside a sweep, ``_exit_bad_input``; in a sweep,
    rank 0 prints the line and the job raises :class:`JobFailed` (every rank finds the same problem)."""
    if job is None:
        _exit_bad_input(message, code)
    if launch_position()[0] == 0:
        sys.stdout.flush()
        print(f"dtrain: error: {message}", file=sys.stderr, flush=True)
    raise JobFailed(message, code)


def _agree_on_the_file_system(comm, cfg: DictConfig) -> None:
    """In a sweep: the run directory and restore_from checks on every rank, one verdict for all.

    Raises:
        UserError: on every rank, when any rank found a problem (the first such rank's).
    """
    problems = comm.allgather_object(validate(cfg, check_run_dir=True))
    found = next((rank_problems for rank_problems in problems if rank_problems), None)
    if found:
        raise UserError("; ".join(found))


#: seconds the ranks of a failed sweep job wait for each other's failure: ranks failing at the same
#: point (a bad setting, a divergence found by an all-reduce) arrive within a step of each other
AGREEMENT_TIMEOUT_S = 30.0


def _end_failed_job(comm, heartbeat, cfg: DictConfig, message: str, code: int, kind: str, secondary: bool) -> NoReturn:
    """A failed job of a sweep: once every rank agrees it failed, rank 0 prints its line and every rank
    leaves the job (heartbeat stopped, communicator finalized) and raises :class:`JobFailed`.

    Ranks that do not all report the failure within ``AGREEMENT_TIMEOUT_S`` (at most
    ``comm.heartbeat_timeout_s`` and ``comm.timeout_s``) cannot go on together: the whole job ends
    with ``end_job``, as outside a sweep.
    """
    if comm.size > 1:
        agreed = agree_on_failure(comm, message, code, kind, secondary=secondary,
                                  timeout_s=min(AGREEMENT_TIMEOUT_S, cfg.comm.timeout_s, cfg.comm.heartbeat_timeout_s))
        if agreed is None:
            end_job(comm, message, code, lost_peer=secondary)
        message, code, kind = agreed
    if comm.is_main:
        sys.stdout.flush()
        print(f"dtrain: error: {message}", file=sys.stderr, flush=True)
    if heartbeat is not None:
        heartbeat.stop()
    comm.finalize()
    raise JobFailed(message, code, kind)


def _debug_traceback() -> None:
    if os.environ.get("DTRAIN_DEBUG", "").strip().lower() in ("1", "true", "yes", "on"):
        traceback.print_exc()


#: what an allocator says when memory runs out (torch's CPU and CUDA allocators, numpy)
_OUT_OF_MEMORY = re.compile(r"can't allocate|cannot allocate|out of memory|Unable to allocate", re.IGNORECASE)


def describe_failure(error: BaseException, cfg: DictConfig | None = None) -> tuple[str, int]:
    """The one line (without ``dtrain: error:``) and the exit code for a failure.

    User errors (bad config, data, checkpoint, run directory) and running out of memory (named
    against ``session.minibatch_size``) give exit code 2; anything else is reported as
    ``ExceptionType: message`` with exit code 1.
    """
    text = first_line(error)
    if isinstance(error, MemoryError) or (isinstance(error, RuntimeError) and _OUT_OF_MEMORY.search(str(error))):
        size = cfg.session.minibatch_size if cfg is not None else "?"
        return (f"out of memory ({text or type(error).__name__}) with session.minibatch_size={size}: expected a "
                f"minibatch that fits in this machine's memory; lower session.minibatch_size"), EXIT_BAD_INPUT
    if isinstance(error, (UserError, *USER_ERRORS)):
        return text or type(error).__name__, EXIT_BAD_INPUT
    if isinstance(error, OSError):  # a disk that is full, a file system that went away
        return f"{type(error).__name__}: {text}", 1
    return exception_message(type(error), error) + " (DTRAIN_DEBUG=1 shows the traceback)", 1


#: seconds a rank whose collective failed because a peer went away waits before reporting: the
#: peer that failed (or the launcher) normally ends the job first, so its line comes first
LOST_PEER_GRACE_S = 5.0

#: seconds a rank other than 0 waits before reporting its own error: when every rank meets the
#: same problem, rank 0's report ends the job and the user reads it once
PEER_REPORT_DELAY_S = 2.0


def is_lost_peer(error: BaseException) -> bool:
    """Whether ``error`` is a collective failing because another rank died, stopped or aborted."""
    import torch.distributed as dist

    if isinstance(error, getattr(dist, "DistError", ())):
        return True
    return isinstance(error, RuntimeError) and bool(re.search(
        r"Connection (closed|reset) by peer|Broken pipe|Socket Timeout|timed out|Timeout", str(error)))


def end_job(comm, message: str, code: int, *, lost_peer: bool = False) -> NoReturn:
    """Ends every rank with ``dtrain: error: message`` and ``code`` (one process: no rank prefix)."""
    if comm.size == 1:
        _exit_bad_input(message, code)
    if lost_peer:
        time.sleep(LOST_PEER_GRACE_S)
    elif not comm.is_main:
        time.sleep(PEER_REPORT_DELAY_S)
    comm.abort(f"dtrain: error: {message}", code)


def launch_position() -> tuple[int, int]:
    """``(rank, size)`` the launcher gave this process, read from the environment; ``(0, 1)`` if unclear."""
    try:
        info = detect_launcher(os.environ)
    except ValueError:
        return 0, 1
    return info.rank, info.size


def _exit_bad_input(message: str, code: int = EXIT_BAD_INPUT) -> NoReturn:
    """Prints ``dtrain: error: message`` and exits with ``code`` before a communicator exists.

    Under a launcher every rank finds the same problem: rank 0 reports it and the launcher then
    ends the others, which report only if they are still running after a pause (a problem only
    they have), prefixed with their rank.
    """
    rank, size = launch_position()
    line = f"dtrain: error: {message}"
    if size > 1 and rank != 0:
        time.sleep(PEER_REPORT_DELAY_S)
        line = format_rank_message(rank, size, line)
    sys.stdout.flush()
    print(line, file=sys.stderr, flush=True)
    os._exit(code)


def _run_with(comm, cfg: DictConfig, job: SweepJob | None = None) -> float | None:
    # one run directory and one config for all ranks
    cfg.run_dir = comm.broadcast_object(os.path.abspath(cfg.run_dir) if comm.is_main else None, root=0)
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
    train_source = _instantiate(cfg.source.train, f"source.train (data.root={cfg.data.root})")
    test_source = _instantiate(cfg.source.test, "source.test") if cfg.source.test is not None else None
    cv_source = _instantiate(cfg.source.cv, "source.cv") if cfg.source.cv is not None else None
    inputs = OmegaConf.to_container(cfg.session.inputs, resolve=True) \
        if isinstance(cfg.session.inputs, (DictConfig, ListConfig)) else cfg.session.inputs
    check_model_outputs(model, train_source, cfg.model.get("num_classes"), StreamBinding(inputs, cfg.session.target))
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
        lr_schedule=_schedule(session.lr_schedule, warmup=session.lr_scaling == "none"),
        lr_scaling=_lr_scaling(session),
        ema_decay=session.ema_decay,
        momentum_time_constant_schedule=_schedule(session.momentum_time_constant_schedule),
        unit_gain_momentum=session.unit_gain_momentum,
        run_dir=run_dir,
        tensorboard=session.tensorboard,
        progress_bar=session.progress_bar,
        micro_batch_size=session.micro_batch_size,
        clip_grad_norm=session.clip_grad_norm,
        precision=session.precision,
        compile=session.compile,
        **device_and_profile_options(session),
        inputs=inputs,
        target=cfg.session.target,
        config_fingerprint=config_hash,
        checkpoint_identity=checkpoint_identity(cfg),
        run_config=run_config(cfg),
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


#: signals with which Open MPI's ``mpiexec`` ends itself at once (exit code 1) after passing SIGTERM
#: to the ranks: their output no longer reaches the user through it
_LAUNCHER_ENDING_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP")


def continue_command(comm, run_dir: str, argv: list[str] | None = None, sweep_dir: str | None = None) -> str:
    """The command that continues this run: the same arguments with ``run_dir`` pinned to this run's
    (in a sweep, ``hydra.sweep.dir`` pinned to the sweep's: the sweep continues each job)."""
    pinned = ("hydra.sweep.dir=", f"hydra.sweep.dir={sweep_dir}") if sweep_dir is not None \
        else ("run_dir=", f"run_dir={run_dir}")
    args = [argument for argument in (sys.argv[1:] if argv is None else argv) if not argument.startswith(pinned[0])]
    command = shlex.join(["python", "-m", "dtrain", *args, pinned[1]])
    launcher = {"mpi": f"mpiexec -n {comm.size} ", "torchrun": "torchrun [the same options] ",
                "slurm": "srun [the same options] "}
    return launcher.get(comm.launcher, "") + command if comm.size > 1 else command


def exit_preempted(comm, cfg: DictConfig, result, sweep_dir: str | None = None) -> NoReturn:
    """After a preemption checkpoint: say where it is and how to continue, then exit with code 75 (in a
    sweep too: the sweep stops, and the command continues it).

    Rank 0 prints the line to stderr; when Open MPI's ``mpiexec`` itself got SIGTERM/SIGINT it has
    already exited (with code 1) and no longer forwards output, so the line also goes to the
    controlling terminal, if there is one.
    """
    if comm.is_main:
        line = (f"dtrain: stopped by {cfg.session.checkpoint.preemption_signal}: checkpoint saved at "
                f"{result.samples_seen} samples ({result.last_checkpoint}); continue with: "
                f"{continue_command(comm, cfg.run_dir, sweep_dir=sweep_dir)}")
        with contextlib.suppress(OSError):  # a launcher that has gone away closed our pipes
            sys.stdout.flush()
            print(line, file=sys.stderr, flush=True)
        if comm.launcher == "mpi" and comm.size > 1 and cfg.session.checkpoint.preemption_signal in _LAUNCHER_ENDING_SIGNALS:
            with contextlib.suppress(OSError), open("/dev/tty", "w") as terminal:
                terminal.write(f"\r\n{line}\r\n")
    comm.finalize()
    with contextlib.suppress(OSError):
        sys.stdout.flush()
    os._exit(EXIT_PREEMPTED)


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
    os._exit(EXIT_PREEMPTED)


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


@hydra.main(version_base="1.3", config_path=config_dir(), config_name="config")
def _hydra_main(cfg: DictConfig) -> float | None:
    job = current_job()
    if job is not None:
        return run_sweep_job(cfg, job)
    try:
        job_dir = sweep_run_dir(cfg)
    except UserError as error:
        _exit_bad_input(str(error))
    if job_dir is not None:
        cfg.run_dir = job_dir
    return run(cfg)


def run_sweep_job(cfg: DictConfig, job: SweepJob) -> float | None:
    """One job of a sweep: rank 0 names it (``dtrain: job 1/3: optimizer.lr=-1``), then it runs in its own
    directory; how it ended is recorded for the sweep's summary, and a failure is raised to Hydra as
    :class:`JobFailed` (the sweep goes on)."""
    is_main = launch_position()[0] == 0
    if is_main:
        print(f"dtrain: {job.describe()}", flush=True)
    try:
        try:
            cfg.run_dir = sweep_run_dir(cfg)
        except UserError as error:
            _fail_before_job(str(error), job=job)
        objective = run(cfg, job)
    except JobFailed as failure:
        record_outcome(job, failure.kind, code=failure.code, message=failure.message, write=is_main)
        raise
    record_outcome(job, "finished", objective=objective, write=is_main)
    return objective


def _sweeper_error(error: BaseException) -> str:
    """One line for an error of Hydra or a sweeper (a bad sweep override, a study with no finished trial)."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    if not isinstance(error, (HydraException, OmegaConfBaseException)):
        return describe_failure(error)[0]
    cause = error.__cause__
    return first_line(error) + (f" ({first_line(cause)})" if cause is not None and first_line(cause) else "") + \
        " (python -m dtrain +recipe=NAME --cfg job lists every key)"


def run_sweep(argv: list[str]) -> int:
    """``python -m dtrain -m ...``: runs Hydra's sweep, whose jobs fail alone (``run_sweep_job``), then
    prints its summary; returns the sweep's exit status (0: every job finished).

    Hydra's sweepers re-raise a failed job (the basic sweeper once its batch has run) and Optuna's
    stops at ``hydra.sweeper.max_failure_rate``, which is therefore 1.0 unless given. Their errors
    come back here (``HYDRA_FULL_ERROR``) instead of as Hydra's traceback.
    """
    start_sweep(argv)
    if "hydra/sweeper=optuna" in argv and not any(a.startswith("hydra.sweeper.max_failure_rate=") for a in argv):
        sys.argv.append("hydra.sweeper.max_failure_rate=1.0")  # failed trials are told as failed; the study goes on
    previous = os.environ.get("HYDRA_FULL_ERROR")
    os.environ["HYDRA_FULL_ERROR"] = "1"
    stopped_by = None
    try:
        _hydra_main()
    except JobFailed:
        pass  # a failed job the sweeper re-raised: it is in the outcomes already
    except Exception as error:  # noqa: BLE001 -- a sweeper or Hydra error: one line, not a traceback
        _debug_traceback()
        stopped_by = _sweeper_error(error)
    finally:
        if previous is None:
            os.environ.pop("HYDRA_FULL_ERROR", None)
        else:
            os.environ["HYDRA_FULL_ERROR"] = previous
    is_main = launch_position()[0] == 0
    if stopped_by is not None and not sweep_outcomes():
        if is_main:
            print(f"dtrain: error: {stopped_by}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    return finish_sweep(is_main, stopped_by)


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


def config_groups() -> list[str]:
    """The config group names (``learner``, ``optimizer``, ``session``, ...) of the shipped tree."""
    return sorted(p.name for p in Path(config_dir()).iterdir() if p.is_dir() and not p.name.startswith("."))


def check_overrides(argv: list[str]) -> str | None:
    """Composes the config once to turn Hydra's multi-line override errors into one line.

    Skipped when Hydra flags (``--cfg``, ``-m``, ...) are present: Hydra then reports by itself.
    """
    if any(argument.startswith("-") for argument in argv):
        return None
    from hydra import compose, initialize_config_dir
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        overrides = OverridesParser.create().parse_overrides(argv)
    except HydraException as error:
        sliced = next((argument for argument in argv if "=" in argument and "[" in argument.split("=", 1)[1]
                       and not argument.split("=", 1)[1].startswith(("[", "'", '"'))), None)
        if sliced is not None:  # session.target=text[1:]: Hydra reads [ as the start of a list
            key, value = sliced.split("=", 1)
            return (f"{sliced}: a value with brackets (a step slice) must be quoted on the command line; expected "
                    f"'{key}=\"{value}\"' ({first_line(error)})")
        return f"{first_line(error)} (python -m dtrain +recipe=NAME --cfg job lists every key)"
    groups = config_groups()
    for override in overrides:
        key = override.key_or_group
        if key in groups and not isinstance(override.value(), str):
            return (f"{override.input_line}: expected the name of one {key} option "
                    f"({', '.join(sorted(p.stem for p in (Path(config_dir()) / key).glob('*.yaml')))})")
    try:
        with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
            compose("config", overrides=argv)
    except (HydraException, OmegaConfBaseException) as error:
        lines = str(error).strip().splitlines()
        parts = [lines[0]]
        hint = nested_group_hint(config_dir(), lines[0], argv)
        if hint:
            parts.append(hint)
        options = [line.strip() for line in lines if line.startswith("\t") and "provider=" not in line]
        if "Available options" in str(error) and options:
            parts.append(f"(available: {', '.join(options)})")
        cause = error.__cause__
        if cause is not None and str(cause).strip():
            parts.append(first_line(cause))
            full_key = re.search(r"full_key: (\S+)", str(cause))
            if full_key and full_key.group(1) not in " ".join(parts):
                parts.append(f"(key {full_key.group(1)})")
        if not hint and (len(parts) == 1 or "Available options" not in str(error)):
            parts.append("(python -m dtrain +recipe=NAME --cfg job lists every key)")
        return " ".join(parts)
    except Exception as error:  # noqa: BLE001 -- Hydra lets some malformed overrides through as raw errors
        found = re.search(r"full_key: (\S+)", str(error))
        where = f"the override of {found.group(1)}" if found else f"the command line {' '.join(argv)!r}"
        return (f"{where} could not be composed into a config ({type(error).__name__}: {first_line(error)}); "
                f"expected key=value pairs of the keys that python -m dtrain +recipe=NAME --cfg job lists")
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
    if "" not in sys.path and os.getcwd() not in sys.path:
        # the installed `dtrain` command imports your modules (model: {_target_: mymodels.MLP}) from the working
        # directory, as `python -m dtrain` does
        sys.path.insert(0, os.getcwd())
    argv = sys.argv[1:]
    answer = quick_answer(argv)  # dtrain's own --help (Hydra's stays at --hydra-help) and --version
    if answer is not None:
        print(answer, end="")
        sys.exit(0)
    register_schemas()
    problem = check_recipe_argument(argv) or check_overrides(argv) or check_sweep_arguments(argv)
    if problem:
        _exit_bad_input(problem)
    if any(argument in ("-m", "--multirun") for argument in argv):
        sys.exit(run_sweep(argv))
    _hydra_main()


if __name__ == "__main__":
    main()
