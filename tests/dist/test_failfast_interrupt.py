"""Interrupting ``mpiexec`` itself: the ranks save a preemption checkpoint, the user is told where it
is and the command that continues, and that command resumes from it.

Open MPI's ``mpiexec`` ends itself at once (exit code 1) on SIGTERM or SIGINT after passing
SIGTERM to the ranks, and stops forwarding their output; the line then reaches the user's
terminal directly, which these tests provide as a pseudo-terminal. With
``session.checkpoint.preemption_signal=SIGUSR1`` (which ``mpiexec`` forwards without ending
itself) the same line arrives through ``mpiexec`` and its exit code is 75.
"""
from __future__ import annotations

import os
import pty
import re
import select
import shlex
import signal
import time
from pathlib import Path

import pytest

from tests.helpers.mpi import (OPEN_MPI_ENV, failed_to_launch, kill_session, mpi_command, mpiexec_path, run_mpi,
                               say_launching_once_more)

STOPPED = re.compile(r"dtrain: stopped by (\w+): checkpoint saved at (\d+) samples \((\S+)\); continue with: (.+?)\r?$",
                     re.MULTILINE)


def _train_command(run_dir: Path, *extra: str) -> list[str]:
    return ["-m", "dtrain", "+recipe=digits", f"run_dir={run_dir}", "session.max_samples=400000",
            "session.checkpoint.frequency=1500", "session.tensorboard=false", "session.progress_frequency=100000",
            *extra]


def _run_on_terminal(command: list[str], run_dir: Path, signum: int, timeout: float = 180,
                     wait_for_exit: bool = False) -> tuple[str, int | None]:
    """Runs ``command`` on a pseudo-terminal, sends ``signum`` to it once training has written a
    checkpoint, and returns (everything written to the terminal until the stop line, and with
    ``wait_for_exit`` until ``command`` ended; its exit status, None if it was still running).
    After Open MPI's intermittent failure to start (``failed_to_launch``) it runs once more."""
    text, status = _run_on_terminal_once(command, run_dir, signum, timeout, wait_for_exit)
    if failed_to_launch(status, text):
        say_launching_once_more(status, text)
        text, status = _run_on_terminal_once(command, run_dir, signum, timeout, wait_for_exit)
    return text, status


def _run_on_terminal_once(command: list[str], run_dir: Path, signum: int, timeout: float,
                          wait_for_exit: bool) -> tuple[str, int | None]:
    """One run of :func:`_run_on_terminal`; it returns as soon as ``command`` ends before the signal."""
    env = {**os.environ, **OPEN_MPI_ENV, "PYTHONUNBUFFERED": "1"}
    pid, terminal = pty.fork()
    if pid == 0:  # the child: mpiexec on the terminal, in its own session (as from a shell)
        os.execvpe(command[0], command, env)
    output, status, signalled, closed = b"", None, False, False
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if not signalled and list(run_dir.glob("checkpoint-*.pt")):
                os.kill(pid, signum)  # training is under way
                signalled = True
            ready, _, _ = select.select([terminal], [], [], 0.2)
            if ready:
                try:
                    chunk = os.read(terminal, 65536)
                except OSError:  # the terminal closed: every process on it has ended
                    chunk = b""
                output += chunk
                closed = not chunk  # all of it read
            if status is None:
                done, raw = os.waitpid(pid, os.WNOHANG)
                if done:
                    status = os.waitstatus_to_exitcode(raw)
            if signalled and STOPPED.search(output.decode(errors="replace")) \
                    and (status is not None or not wait_for_exit):
                break
            if status is not None and closed and not signalled:  # it ended before training got under way
                break
    finally:
        kill_session(pid)
        if status is None:
            os.waitpid(pid, 0)
        os.close(terminal)
    return output.decode(errors="replace"), status


@pytest.mark.parametrize("signum", [pytest.param(signal.SIGTERM, marks=pytest.mark.slow),
                                    pytest.param(signal.SIGINT, marks=pytest.mark.slow)])
def test_signalled_mpiexec_tells_the_terminal_where_the_checkpoint_is_and_how_to_continue(tmp_path, signum):
    if mpiexec_path() is None:
        pytest.skip("mpiexec not found")
    run_dir = tmp_path / "run"
    text, _ = _run_on_terminal(mpi_command(2, _train_command(run_dir)), run_dir, signum)
    found = STOPPED.search(text)
    assert found, text
    samples, saved = int(found.group(2)), Path(found.group(3))
    assert found.group(1) == "SIGTERM" and 0 < samples < 400000 and saved.is_file(), text
    continuing = shlex.split(found.group(4))
    assert continuing[:3] == ["mpiexec", "-n", "2"] and f"run_dir={run_dir}" in continuing, text
    # the printed command continues the run from that checkpoint
    arguments = [a if not a.startswith("session.max_samples=") else f"session.max_samples={samples + 320}"
                 for a in continuing[continuing.index("-m"):]]
    resumed = run_mpi(2, arguments, timeout=180)
    assert resumed.returncode == 0, resumed.report()
    assert f"at {samples} samples" in resumed.stdout, resumed.report()


@pytest.mark.slow  # the SIGTERM case above keeps the preemption path in the default suite
def test_sigusr1_preemption_through_mpiexec_exits_75_with_the_line(tmp_path):
    if mpiexec_path() is None:
        pytest.skip("mpiexec not found")
    run_dir = tmp_path / "run"
    text, status = _run_on_terminal(
        mpi_command(2, _train_command(run_dir, "session.checkpoint.preemption_signal=SIGUSR1")), run_dir,
        signal.SIGUSR1, wait_for_exit=True)
    found = STOPPED.search(text)
    assert found and found.group(1) == "SIGUSR1", text
    assert status == 75, text
    assert text.count("dtrain: stopped by") == 1, text  # through mpiexec only, not also on the terminal
