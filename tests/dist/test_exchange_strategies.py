"""Every exchange strategy of the data-parallel learner under ``mpiexec -n 2`` and ``-n 4``:
identical parameters on all ranks after every step, exact "has a gradient" flags, bit-exact
resume at the same world size, state reset at another, bytes below float32's where compressed."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.helpers.mpi import run_mpi

WORKER = str(Path(__file__).with_name("_exchange_strategies_worker.py"))
STRATEGIES = ["allreduce", "bf16", "fp16", "quantized1", "quantized4", "powersgd1", "powersgd2"]


@pytest.mark.timeout(420)
@pytest.mark.parametrize("nprocs", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_every_strategy_keeps_ranks_identical_and_resumes_exactly(nprocs: int) -> None:
    result = run_mpi(nprocs, [WORKER, ",".join(STRATEGIES)], timeout=400)
    assert result.returncode == 0, result.report()
    passes = sorted(re.findall(rf"^PASS rank (\d+)/{nprocs}$", result.stdout, re.MULTILINE))
    assert passes == [str(rank) for rank in range(nprocs)], result.report()
    rows = {name: {key: int(value) for key, value in re.findall(r"(\w+)=(\d+)", rest)}
            for name, rest in re.findall(r"^RESULT (\w+) (.*)$", result.stdout, re.MULTILINE)}
    assert sorted(rows) == sorted(STRATEGIES), result.report()
    assert rows["allreduce"]["sent"] == rows["allreduce"]["full"], rows
    for name in ("bf16", "fp16"):
        assert rows[name]["sent"] * 2 == pytest.approx(rows[name]["full"], abs=len(rows)), rows
    for name in ("quantized1", "quantized4", "powersgd1", "powersgd2"):
        assert 0 < rows[name]["sent"] < rows[name]["full"] and rows[name]["stateful"] == 1, rows
