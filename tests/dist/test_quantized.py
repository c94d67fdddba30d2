"""Quantized data parallelism under a real ``mpiexec``: 2 and 4 ranks, and the CLI end to end.

One launch per world size runs every check of ``_quant_worker.py`` (each launch starts Python
and torch on every rank): the exchange against a direct computation, parameters identical on
all ranks after every step at 1/2/4/8 bits, bytes per step below a float32 all-reduce's, the
warm-start switch, and 1-bit SGD with error feedback converging to the full-precision loss.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from launch import run_mpi

WORKER = str(Path(__file__).with_name("_quant_worker.py"))


def _figures(output: str, tag: str) -> list[dict[str, float]]:
    """``TAG key=value ...`` lines as dicts."""
    return [{key: float(value) for key, value in re.findall(r"(\w+)=([0-9.]+)", line)}
            for line in re.findall(rf"^{tag} (.*)$", output, re.MULTILINE)]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("nprocs", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_quantized_exchange_and_learner_under_mpiexec(nprocs: int) -> None:
    result = run_mpi(nprocs, [WORKER, "checks"], timeout=240)
    assert result.returncode == 0, result.report()
    passes = sorted(re.findall(rf"^PASS checks rank (\d+)/{nprocs}$", result.stdout, re.MULTILINE))
    assert passes == [str(rank) for rank in range(nprocs)], result.report()

    per_bits = {int(row["bits"]): row for row in _figures(result.stdout, "BYTES")}
    assert sorted(per_bits) == [1, 2, 4, 8], result.report()
    sent = [per_bits[bits]["sent"] for bits in (1, 2, 4, 8)]
    assert sent == sorted(sent) and sent[-1] < per_bits[8]["full"], result.report()  # fewer bits, fewer bytes
    assert per_bits[1]["ratio"] > 10, result.report()

    (converge,) = _figures(result.stdout, "CONVERGE")
    assert converge["one_bit_loss"] < 1.05 * converge["full_precision_loss"], result.report()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_cli_trains_digits_with_one_bit_sgd(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    result = run_mpi(2, ["-m", "dtrain", "+recipe=digits", "learner=quantized", "session.max_samples=3000",
                         f"run_dir={run_dir}"], timeout=240)
    assert result.returncode == 0, result.report()
    assert "finished: 3,000 samples" in result.stdout, result.report()
    assert (run_dir / "metrics.jsonl").exists()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_cli_one_bit_sgd_without_warm_start_collapses_and_says_so(tmp_path: Path) -> None:
    """The issue's case: 1-bit SGD from a fresh model (distributed_after=0) learns, then returns to
    chance (digits: ~10% accuracy). It must end with one line and a non-zero exit, not a result."""
    result = run_mpi(2, ["-m", "dtrain", "+recipe=digits", "learner=quantized", "learner.distributed_after=0",
                         "session.max_samples=12000", "session.progress_frequency=1500", "seed=0",
                         "session.tensorboard=false", f"run_dir={tmp_path / 'run'}"], timeout=240)
    assert result.returncode == 2, result.report()
    errors = [line for line in result.stderr.splitlines() if "dtrain: error:" in line]
    assert errors and "training collapsed: the mean loss" in errors[0], result.report()
    assert "ln 10 = 2.3026" in errors[0] and "learner.distributed_after" in errors[0], result.report()
    assert "test: accuracy" not in result.stdout and "finished:" not in result.stdout, result.report()
