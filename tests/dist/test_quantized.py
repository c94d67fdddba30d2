"""Quantized data parallelism under a real ``mpiexec``: 2 and 4 ranks, and the CLI end to end.

One launch per world size runs every check of ``_quant_worker.py`` (each launch starts Python
and torch on every rank), each its own test: the exchange against a direct computation, parameters
identical on all ranks after every step at 1/2/4/8 bits with bytes per step below a float32
all-reduce's, the warm-start switch, and 1-bit SGD with error feedback converging to the
full-precision loss.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.helpers.checks import CheckLaunch, launch_checks
from tests.helpers.mpi import run_mpi

WORKER = Path(__file__).with_name("_quant_worker.py")

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module", params=[2, pytest.param(4, marks=pytest.mark.slow)], ids=lambda n: f"nprocs={n}")
def launch(request, tmp_path_factory) -> CheckLaunch:
    """One run of every check of ``_quant_worker.py`` on ``request.param`` ranks."""
    return launch_checks(request.param, [WORKER], tmp_path_factory.mktemp(f"quant{request.param}"), timeout=240)


def test_exchange_equals_the_direct_computation(launch: CheckLaunch) -> None:
    launch.results("exchange")  # the worker compared every step bit for bit, on every rank


def test_learner_keeps_ranks_identical_and_sends_fewer_bytes_with_fewer_bits(launch: CheckLaunch) -> None:
    per_bits = {int(bits): row for bits, row in launch.result("learner").items()}
    assert sorted(per_bits) == [1, 2, 4, 8], per_bits
    # fewer bits, fewer bytes where the sums are formed alike: beyond 2 ranks 1 bit gathers every rank's codes
    # and 2 bits or more re-quantize (requantize_sum's auto)
    alike = (1, 2, 4, 8) if launch.nprocs == 2 else (2, 4, 8)
    sent = [per_bits[bits]["sent"] for bits in alike]
    assert sent == sorted(sent) and sent[-1] < per_bits[8]["full"], per_bits
    # 1 bit per value gathered from N - 1 ranks against float32's 2 (N - 1) / N x 32: 64 / N times fewer bytes
    # (the default up to 8 ranks), less the two float32 scales each column of this small net carries
    assert per_bits[1]["ratio"] > 0.5 * 64 / launch.nprocs, per_bits
    # k bits through the two phases (or gathered at 2 ranks): 32 / k times fewer, less the scales
    assert all(per_bits[bits]["ratio"] > 0.5 * 32 / bits for bits in (2, 4, 8)), per_bits


def test_the_warm_start_all_reduces_float32_and_the_ranks_stay_identical_through_the_switch(launch: CheckLaunch) -> None:
    launch.results("warm_start")


def test_one_bit_sgd_with_error_feedback_reaches_the_full_precision_loss(launch: CheckLaunch) -> None:
    converge = launch.result("convergence")
    assert converge["one_bit_loss"] < 1.05 * converge["full_precision_loss"], converge


def test_the_launch_ends_cleanly(launch: CheckLaunch) -> None:
    assert launch.returncode == 0, launch.output


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_cli_trains_digits_with_one_bit_sgd(run_dir: Path) -> None:
    result = run_mpi(2, ["-m", "dtrain", "+recipe=digits", "learner=quantized", "session.max_samples=3000",
                         f"run_dir={run_dir}"], timeout=240)
    assert result.returncode == 0, result.report()
    assert "finished: 3,000 samples" in result.stdout, result.report()
    assert (run_dir / "metrics.jsonl").exists()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_cli_one_bit_sgd_without_warm_start_collapses_and_says_so(run_dir: Path) -> None:
    """The issue's case: 1-bit SGD from a fresh model (distributed_after=0), with CNTK's two phases (the sum
    re-quantized), learns, then returns to chance (digits: ~10% accuracy). It must end with one line and a
    non-zero exit, not a result. At the recipe's length (30,000 samples): where it collapses depends on the
    CPU's rounding (seeds 0, 1, 2 at 15,008, 7,520 and 13,504 samples on an AVX2 CPU; seed 0 recovered to 40%
    error by 12,000 there, not on others)."""
    result = run_mpi(2, ["-m", "dtrain", "+recipe=digits", "learner=quantized", "learner.distributed_after=0",
                         "learner.exchange.requantize_sum=true", "session.progress_frequency=1500", "seed=0",
                         "session.tensorboard=false", f"run_dir={run_dir}"], timeout=240)
    assert result.returncode == 2, result.report()
    errors = [line for line in result.stderr.splitlines() if "dtrain: error:" in line]
    assert errors and "training collapsed: the mean loss" in errors[0], result.report()
    assert "ln 10 = 2.3026" in errors[0] and "learner.distributed_after" in errors[0], result.report()
    assert "test: accuracy" not in result.stdout and "finished:" not in result.stdout, result.report()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_cli_one_bit_sgd_at_four_ranks_keeps_learning_on_a_short_run_with_its_defaults(run_dir: Path) -> None:
    """1-bit SGD's defaults at 4 ranks on a run too short for the recipe's learning-rate drop (12,000 samples,
    warm start 3,008): with each stripe's sum re-quantized (CNTK's two phases, the default before) this run
    ended at 73.40% test accuracy with exit 0, its training loss swinging up to 1.16 at the end; summing
    every worker's 1-bit codes instead (the default up to 8 workers) tests at 99.33% (data_parallel: 99.33%)."""
    result = run_mpi(4, ["-m", "dtrain", "+recipe=digits", "learner=quantized", "session.max_samples=12000", "seed=0",
                         "session.tensorboard=false", f"run_dir={run_dir}"], timeout=240)
    assert result.returncode == 0, result.report()
    assert "(every worker sums every worker's codes, auto)" in result.stdout, result.report()
    accuracy = float(re.search(r"test: accuracy ([0-9.]+)%", result.stdout).group(1))
    assert accuracy >= 97.0, result.report()
