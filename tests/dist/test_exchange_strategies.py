"""Every exchange strategy of the data-parallel learner under ``mpiexec -n 2`` and ``-n 4``:
identical parameters on all ranks after every step, exact "has a gradient" flags, bit-exact
resume at the same world size, state reset at another, bytes below float32's where compressed.

One launch per world size runs every check of ``_exchange_strategies_worker.py``; each strategy
is its own test.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.checks import CheckLaunch, launch_checks
from tests.helpers.strategies import STRATEGIES

WORKER = Path(__file__).with_name("_exchange_strategies_worker.py")

pytestmark = pytest.mark.timeout(420)


@pytest.fixture(scope="module", params=[(2, "gloo"), pytest.param((2, "mpi"), marks=pytest.mark.slow),
                                        pytest.param((4, "gloo"), marks=pytest.mark.slow)],
                ids=lambda param: f"nprocs={param[0]}-{param[1]}")
def launch(request, tmp_path_factory) -> CheckLaunch:
    """One run of every check of the worker on ``nprocs`` ranks whose tensors travel by ``backend``."""
    nprocs, backend = request.param
    return launch_checks(nprocs, [WORKER], tmp_path_factory.mktemp(f"exchange{nprocs}{backend}"), timeout=400,
                         env={"WORKER_BACKEND": backend})


def test_all_to_all_delivers_per_pair_lengths(launch: CheckLaunch) -> None:
    launch.results("all_to_all")


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_strategy_keeps_ranks_identical_and_resumes_exactly(launch: CheckLaunch, strategy: str) -> None:
    row = launch.result(strategy)
    if strategy == "allreduce":
        assert row["sent"] == row["full"], row
    elif strategy in ("bf16", "fp16"):
        assert row["sent"] * 2 == pytest.approx(row["full"], abs=len(STRATEGIES)), row
    else:
        assert 0 < row["sent"] < row["full"] and row["stateful"] == 1, row


def test_the_sparse_exchange_equals_sparselocos_algorithm_on_every_rank(launch: CheckLaunch) -> None:
    row = launch.result("sparse_reference")
    assert 0 < row["sent"] < row["full"], row


def test_the_launch_ends_cleanly(launch: CheckLaunch) -> None:
    assert launch.returncode == 0, launch.output
