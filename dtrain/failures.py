"""How ``python -m dtrain`` ends a failed or preempted job: one line, the failing rank's first, and an exit
code (2 a bad input, 1 any other failure, 75 preempted after a checkpoint), on every rank at once."""
from __future__ import annotations

import contextlib
import os
import re
import shlex
import sys
import time
import traceback
from typing import NoReturn

from omegaconf import DictConfig

from dtrain.comm import detect_launcher
from dtrain.comm.base import first_line, format_rank_message
from dtrain.comm.failfast import exception_message
from dtrain.session import TrainingDiverged
from dtrain.session.checkpoint import CheckpointError
from dtrain.sweep import JobFailed, SweepJob, agree_on_failure


#: exit code for a bad config, data set or checkpoint (the user's input, not a crash)
EXIT_BAD_INPUT = 2


#: exit code after a preemption signal: a checkpoint was saved, run the same command again
EXIT_PREEMPTED = 75


#: the errors that name a bad input (exit code 2); anything else is reported as a failure (exit code 1)
USER_ERRORS = (ValueError, TypeError, FileNotFoundError, PermissionError, CheckpointError, TrainingDiverged)


class UserError(Exception):
    """A problem with what the user asked for; printed as one line."""


def fail_before_job(message: str, code: int = EXIT_BAD_INPUT, *, job: SweepJob | None) -> NoReturn:
    """A failure before the job's communicator exists: outside a sweep, ``exit_bad_input``; in a sweep,
    rank 0 prints the line and the job raises :class:`JobFailed` (every rank finds the same problem)."""
    if job is None:
        exit_bad_input(message, code)
    if launch_position()[0] == 0:
        sys.stdout.flush()
        print(f"dtrain: error: {message}", file=sys.stderr, flush=True)
    raise JobFailed(message, code)


#: seconds the ranks of a failed sweep job wait for each other's failure: ranks failing at the same
#: point (a bad setting, a divergence found by an all-reduce) arrive within a step of each other
AGREEMENT_TIMEOUT_S = 30.0


def end_failed_sweep_job(comm, heartbeat, cfg: DictConfig, message: str, code: int, kind: str, secondary: bool) -> NoReturn:
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


def print_debug_traceback() -> None:
    """Prints the current exception's traceback when ``DTRAIN_DEBUG`` is set (failures are one line otherwise)."""
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

#: the same before a communicator exists (a bad config): the ranks have not met yet, and reaching the
#: check after importing torch took rank 0 over 2 s longer than rank 1 on a loaded machine (rank 1's
#: line then came first); a problem only one rank has is reported this much later
PEER_REPORT_DELAY_BEFORE_JOB_S = 5.0


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
        exit_bad_input(message, code)
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


def exit_bad_input(message: str, code: int = EXIT_BAD_INPUT) -> NoReturn:
    """Prints ``dtrain: error: message`` and exits with ``code`` before a communicator exists.

    Under a launcher every rank finds the same problem: rank 0 reports it and the launcher then
    ends the others, which report only if they are still running after a pause (a problem only
    they have), prefixed with their rank.
    """
    rank, size = launch_position()
    line = f"dtrain: error: {message}"
    if size > 1 and rank != 0:
        time.sleep(PEER_REPORT_DELAY_BEFORE_JOB_S)
        line = format_rank_message(rank, size, line)
    sys.stdout.flush()
    print(line, file=sys.stderr, flush=True)
    os._exit(code)


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
