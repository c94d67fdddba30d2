"""Named checks: several behaviours checked in one multi-process launch, each one its own test id.

Starting Python and torch on every rank costs seconds on a small machine, so one worker script
checks several behaviours per launch. So that a failure still names the behaviour, the worker
runs them as named checks and the test module asserts each in a test of its own.

Worker side (a script run by ``mpiexec``, ``torchrun``, ...)::

    from tests.helpers.checks import run_checks

    run_checks(comm, {"equivalence": check_equivalence, "distributed_after": check_distributed_after})

Each check is called as ``check(comm)`` on every rank, asserts what it can there and may return
JSON-able figures for the test. Every rank appends one JSON line per check to
``$CHECK_RESULTS_DIR/rank<r>.jsonl``: ``{"check", "rank", "size", "seconds", "passed", "result"}``,
or for a check that raised ``"passed": false`` with ``"error"`` and ``"traceback"``. The exception
is then raised again, so the job ends as it would without this helper and later checks never run.

Test side: a module-scoped fixture launches once, then each test reads one check::

    @pytest.fixture(scope="module")
    def launch(tmp_path_factory):
        return launch_checks(2, [WORKER], tmp_path_factory.mktemp("checks"), timeout=140)

    def test_equivalence(launch):
        figures = launch.result("equivalence")  # rank 0's figures; fails naming the check

A check that failed fails its own test with its rank, error and traceback; a check the launch
never finished (a crash, a timeout, an earlier failure) fails with the launch's whole output.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

RESULTS_DIR_VARIABLE = "CHECK_RESULTS_DIR"  # not DTRAIN_*: test_comm.py strips those from the ranks' environment


def run_checks(comm, checks: Mapping[str, Callable[[Any], Any]]) -> None:
    """Run ``checks`` in order on this rank, recording each outcome (see the module docstring).

    ``comm`` gives the rank and size of the record; each check gets it as its one argument. Without
    ``CHECK_RESULTS_DIR`` (a worker run by hand) only the ``PASS``/``FAIL`` lines are printed.
    Raises whatever a check raised, after recording it.
    """
    directory = os.environ.get(RESULTS_DIR_VARIABLE)
    for name, check in checks.items():
        started = time.perf_counter()
        record: dict[str, Any] = {"check": name, "rank": comm.rank, "size": comm.size}
        try:
            record.update(passed=True, result=check(comm))
        except BaseException as error:
            record.update(passed=False, error=f"{type(error).__name__}: {error}", traceback=traceback.format_exc())
            _record(directory, record, started)
            raise
        _record(directory, record, started)


def _record(directory: str | None, record: dict[str, Any], started: float) -> None:
    record["seconds"] = round(time.perf_counter() - started, 3)
    line = json.dumps(record)  # before the PASS line: a result that is not JSON fails the check's test
    if directory:
        with open(Path(directory) / f"rank{record['rank']}.jsonl", "a") as results:
            results.write(line + "\n")
    outcome = "PASS" if record["passed"] else "FAIL"
    # one write: lines from ranks sharing a pipe stay whole
    sys.stdout.write(f"{outcome} {record['check']} rank {record['rank']}/{record['size']}\n")
    sys.stdout.flush()


@dataclass
class CheckLaunch:
    """What one launch of a worker reported: its checks by name and rank, and its output.

    ``returncode`` is None when the launch was killed at its timeout; ``output`` is the command,
    exit status and both streams, quoted when a check's test fails.
    """

    nprocs: int
    returncode: int | None
    output: str
    records: dict[str, dict[int, dict[str, Any]]] = field(default_factory=dict)

    @classmethod
    def read(cls, results_dir: Path, nprocs: int, returncode: int | None, output: str) -> CheckLaunch:
        """Collect the records every rank wrote under ``results_dir``."""
        records: dict[str, dict[int, dict[str, Any]]] = {}
        for path in sorted(Path(results_dir).glob("rank*.jsonl")):
            for line in path.read_text().splitlines():
                record = json.loads(line)
                records.setdefault(record["check"], {})[record["rank"]] = record
        return cls(nprocs, returncode, output, records)

    def results(self, name: str) -> list[Any]:
        """Each rank's figures for check ``name``, by rank; fails the calling test unless it passed on all ranks."""
        import pytest

        by_rank = self.records.get(name, {})
        for rank in sorted(by_rank):
            if not by_rank[rank]["passed"]:
                record = by_rank[rank]
                pytest.fail(f"check {name!r} failed on rank {rank}/{self.nprocs}: {record['error']}\n"
                            f"{record['traceback']}\n{self.output}", pytrace=False)
        missing = [rank for rank in range(self.nprocs) if rank not in by_rank]
        if missing:
            ended = "timed out" if self.returncode is None else f"ended with exit code {self.returncode}"
            pytest.fail(f"check {name!r} never finished on ranks {missing} of {self.nprocs}: the launch {ended} "
                        f"before it\n{self.output}", pytrace=False)
        return [by_rank[rank]["result"] for rank in range(self.nprocs)]

    def result(self, name: str) -> Any:
        """Rank 0's figures for check ``name`` (after :meth:`results` found it passed on every rank)."""
        return self.results(name)[0]


def launch_checks(nprocs: int, args: Sequence[str | os.PathLike], results_dir: Path, timeout: float,
                  env: Mapping[str, str] | None = None) -> CheckLaunch:
    """Run ``python ARGS`` as ``nprocs`` ranks under ``mpiexec`` (``run_mpi``) and collect its checks.

    ``results_dir`` is created when missing and must hold no records yet (a path under a module
    fixture's ``tmp_path_factory.mktemp``). A launch past ``timeout`` seconds is killed and
    reported, not raised, so each check's test fails on its own.
    """
    from tests.helpers.mpi import run_mpi

    Path(results_dir).mkdir(parents=True, exist_ok=True)
    env = {**(env or {}), RESULTS_DIR_VARIABLE: str(results_dir)}
    try:
        run = run_mpi(nprocs, args, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as error:
        output = (f"$ {' '.join(map(str, error.cmd))}\ntimed out after {error.timeout:.0f} s\n"
                  f"--- stdout ---\n{error.output}\n--- stderr ---\n{error.stderr}")
        return CheckLaunch.read(results_dir, nprocs, None, output)
    return CheckLaunch.read(results_dir, nprocs, run.returncode, run.report())
