"""The tests' launches of ``mpiexec`` (``run_mpi``, ``start_ranks``, the terminal runs of
``test_failfast_interrupt``) run once more only when ``mpiexec`` failed before starting any rank."""
import os
import signal
import stat
import sys
import time

import pytest

from tests.dist.test_failfast_interrupt import _run_on_terminal
from tests.helpers import mpi

LAUNCHER_FAILURE = "The PMIx server's listener thread failed to start"


def _fake_mpiexec(tmp_path, failures: int, message: str, exit_code: int = 213):
    """An ``mpiexec`` that fails ``failures`` times with ``message``, then runs its command."""
    counter = tmp_path / "launches"
    script = tmp_path / "mpiexec"
    script.write_text(f"""#!/bin/bash
[ "$1" = "--version" ] && exit 0
echo x >> {counter}
if [ $(wc -l < {counter}) -le {failures} ]; then echo "{message}" >&2; exit {exit_code}; fi
shift 2; exec "$@"
""")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script, counter


def _launches(counter) -> int:
    return len(counter.read_text().splitlines())


def test_a_launcher_failure_is_launched_once_more(tmp_path, monkeypatch):
    script, counter = _fake_mpiexec(tmp_path, 1, LAUNCHER_FAILURE)
    monkeypatch.setenv("DTRAIN_MPIEXEC", str(script))
    result = mpi.run_mpi(2, ["-c", "print('ran')"], timeout=60)
    assert (result.returncode, result.stdout.strip(), _launches(counter)) == (0, "ran", 2)


def test_a_launcher_that_fails_twice_reports_the_second_failure(tmp_path, monkeypatch):
    script, counter = _fake_mpiexec(tmp_path, 2, LAUNCHER_FAILURE)
    monkeypatch.setenv("DTRAIN_MPIEXEC", str(script))
    result = mpi.run_mpi(2, ["-c", "print('ran')"], timeout=60)
    assert (result.returncode, _launches(counter)) == (213, 2)
    assert "listener thread failed to start" in result.stderr


def test_any_other_failure_is_not_run_again(tmp_path, monkeypatch):
    script, counter = _fake_mpiexec(tmp_path, 1, "a rank exited with status 1", exit_code=1)
    monkeypatch.setenv("DTRAIN_MPIEXEC", str(script))
    result = mpi.run_mpi(2, ["-c", "print('ran')"], timeout=60)
    assert (result.returncode, _launches(counter)) == (1, 1)


# the fake launcher's command once it runs: two "ranks" (children whose command line names dtrain)
TWO_RANKS = ("import subprocess, sys; ranks = [subprocess.Popen([sys.executable, '-c', 'import time; "
             "time.sleep(60)', 'dtrain']) for _ in range(2)]; [rank.wait() for rank in ranks]")


def test_start_ranks_launches_once_more_after_a_launcher_failure(tmp_path, monkeypatch):
    script, counter = _fake_mpiexec(tmp_path, 1, LAUNCHER_FAILURE)
    monkeypatch.setenv("DTRAIN_MPIEXEC", str(script))
    job, ranks = mpi.start_ranks(mpi.mpi_command(2, ["-c", TWO_RANKS]), dict(os.environ))
    try:
        assert (len(ranks), _launches(counter)) == (2, 2)
    finally:
        mpi.kill_session(job.pid)
        job.communicate()


def test_start_ranks_reports_any_other_failure_without_launching_again(tmp_path, monkeypatch):
    script, counter = _fake_mpiexec(tmp_path, 1, "a rank exited with status 1", exit_code=1)
    monkeypatch.setenv("DTRAIN_MPIEXEC", str(script))
    with pytest.raises(AssertionError, match="before its ranks started:\n.*a rank exited with status 1"):
        mpi.start_ranks(mpi.mpi_command(2, ["-c", TWO_RANKS]), dict(os.environ))
    assert _launches(counter) == 1


# the fake launcher's command on the terminal: "trains" (writes a checkpoint), and on SIGTERM prints
# the line dtrain prints and exits 1, as mpiexec does
TRAINS_UNTIL_SIGTERM = """
import pathlib, signal, sys, time
def stop(*_):
    print("dtrain: stopped by SIGTERM: checkpoint saved at 5 samples (x.pt); continue with: mpiexec -n 2 x", flush=True)
    sys.exit(1)
signal.signal(signal.SIGTERM, stop)
pathlib.Path(sys.argv[1], "checkpoint-5.pt").write_bytes(b"")
time.sleep(60)
"""


def test_a_terminal_run_is_launched_once_more_after_a_launcher_failure(tmp_path, monkeypatch):
    script, counter = _fake_mpiexec(tmp_path, 1, LAUNCHER_FAILURE)
    command = [str(script), "-n", "2", sys.executable, "-c", TRAINS_UNTIL_SIGTERM, str(tmp_path)]
    text, _ = _run_on_terminal(command, tmp_path, signal.SIGTERM, timeout=60)
    assert "dtrain: stopped by SIGTERM" in text and _launches(counter) == 2, text


def test_a_terminal_run_that_fails_otherwise_returns_at_once_without_launching_again(tmp_path):
    script, counter = _fake_mpiexec(tmp_path, 1, "a rank exited with status 1", exit_code=1)
    command = [str(script), "-n", "2", sys.executable, "-c", TRAINS_UNTIL_SIGTERM, str(tmp_path)]
    started = time.monotonic()
    text, status = _run_on_terminal(command, tmp_path, signal.SIGTERM, timeout=120)
    assert (status, _launches(counter)) == (1, 1) and "a rank exited with status 1" in text, text
    assert time.monotonic() - started < 60  # not kept waiting for a checkpoint until the timeout
