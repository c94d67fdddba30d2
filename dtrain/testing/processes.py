"""Running launcher commands as a test or a benchmark does: find ``mpiexec``, run a command in a session of
its own (so that everything it started can be killed), and keep its output and wall time."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

#: Every hang guard of the suites (a timeout on a run a test starts, and pytest-timeout's limits) is written for an
#: idle machine and multiplied by this (``DTRAIN_TEST_TIMEOUT_SCALE``, default 2): a loaded 2-core runner takes
#: several times as long at moments without anything hanging, and a guard only has to end a real hang.
TIMEOUT_SCALE = float(os.environ.get("DTRAIN_TEST_TIMEOUT_SCALE", "2"))

#: how many of the last lines of each stream a timed-out run's error shows
_TAIL_LINES = 30


def hang_guard(seconds: float) -> float:
    """``seconds``, a timeout written for an idle machine, as the suites apply it (:data:`TIMEOUT_SCALE`)."""
    return seconds * TIMEOUT_SCALE


class RunTimedOut(subprocess.TimeoutExpired):
    """A run killed at its timeout; its message ends with the last lines of both streams, so that a run that hung
    in CI says where."""

    def __str__(self) -> str:
        def tail(text: str | None) -> str:
            return "\n".join((text or "").splitlines()[-_TAIL_LINES:])

        return (f"{super().__str__()}\n--- last stdout ---\n{tail(self.output)}\n"
                f"--- last stderr ---\n{tail(self.stderr)}")


class MpiResult(subprocess.CompletedProcess):
    """A finished ``mpiexec`` run: ``args``, ``returncode``, ``stdout``, ``stderr`` (text) and
    ``duration_s`` (wall-clock seconds from start to exit)."""

    def __init__(self, args: list[str], returncode: int, stdout: str, stderr: str, duration_s: float) -> None:
        super().__init__(args, returncode, stdout, stderr)
        self.duration_s = duration_s

    def report(self) -> str:
        """Return a readable summary (command, exit code, time, both streams) for assertion messages."""
        return (f"$ {' '.join(self.args)}\nexit code {self.returncode} after {self.duration_s:.1f} s\n"
                f"--- stdout ---\n{self.stdout}\n--- stderr ---\n{self.stderr}")


def mpiexec_path() -> str | None:
    """Return the ``mpiexec`` to use, or None when there is none.

    Order: ``DTRAIN_MPIEXEC``; the ``mpiexec`` beside the running Python (a venv's
    pip-installed Open MPI, which matches its mpi4py); the first on ``PATH``.
    """
    chosen = os.environ.get("DTRAIN_MPIEXEC")
    if chosen:
        return chosen if shutil.which(chosen) else None
    beside_python = Path(sys.executable).parent / "mpiexec"
    if beside_python.exists() and os.access(beside_python, os.X_OK):
        return str(beside_python)
    return shutil.which("mpiexec")


def run_in_new_session(command: Sequence[str], env: Mapping[str, str], timeout: float,
                       kill: Callable[[subprocess.Popen], None], shown: Sequence[str] | None = None) -> MpiResult:
    """Run ``command`` in a new session, wait for it and return the finished run.

    Past ``timeout`` seconds times :data:`TIMEOUT_SCALE` (or on Ctrl-C) ``kill(process)`` must end everything the
    run started; a timeout then raises :class:`RunTimedOut` (a ``subprocess.TimeoutExpired``) with the output so far.
    ``shown`` is the command reported in the result and the error (default ``command``).
    """
    shown = list(map(str, command if shown is None else shown))
    timeout = hang_guard(timeout)
    started = time.monotonic()
    with subprocess.Popen(list(map(str, command)), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env=dict(env), start_new_session=True) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except BaseException as error:  # the timeout, or Ctrl-C: leave nothing running
            kill(process)
            stdout, stderr = process.communicate()
            if isinstance(error, subprocess.TimeoutExpired):
                raise RunTimedOut(shown, timeout, output=stdout, stderr=stderr) from None
            raise
    return MpiResult(shown, process.returncode, stdout, stderr, time.monotonic() - started)
