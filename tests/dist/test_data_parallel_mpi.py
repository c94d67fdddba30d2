"""The data-parallel learner under a real mpiexec: 1, 2 and 4 ranks, and the CLI end to end.

One launch per world size runs every scenario of ``_dp_worker.py`` (starting the ranks costs
more than the scenarios); rank 0 reports each as a ``RESULT {json}`` line.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from launch import run_mpi

WORKER = str(Path(__file__).with_name("_dp_worker.py"))
REPO = Path(__file__).resolve().parents[2]


def _results(stdout: str) -> dict[str, dict]:
    return {result["scenario"]: result
            for result in (json.loads(line[len("RESULT "):]) for line in stdout.splitlines() if line.startswith("RESULT "))}


@pytest.mark.timeout(150)
@pytest.mark.parametrize("nprocs", [1, 2, pytest.param(4, marks=pytest.mark.slow)])
def test_data_parallel_training_under_mpiexec(nprocs: int, tmp_path: Path) -> None:
    """N ranks: identical parameters everywhere; equal to one process with the same global minibatches
    (shares of 7, 1 and 3 samples: uneven, and ranks with 0 samples); BatchNorm buffers identical;
    with distributed_after, ranks that drifted apart while local are identical after the switch."""
    result = run_mpi(nprocs, [WORKER, "equivalence,distributed_after", tmp_path], timeout=140)
    assert result.returncode == 0, result.report()
    results = _results(result.stdout)
    assert set(results) == {"equivalence", "distributed_after"}, result.report()

    equivalence = results["equivalence"]
    assert equivalence["size"] == nprocs and equivalence["samples_seen"] == 200
    assert equivalence["differing_parameters"] == [], equivalence
    assert equivalence["differing_batchnorm_state"] == [], equivalence
    assert equivalence["max_difference_to_one_process"] <= 1e-5, equivalence
    assert equivalence["parameters_moved_by"] > 0.1, equivalence  # the comparison is not vacuous
    if nprocs > 1:
        assert equivalence["num_buckets"] >= 3, equivalence  # several buckets, launched in order

    after = results["distributed_after"]
    assert after["samples_seen"] == 160 and after["differing_parameters"] == [], after
    if nprocs > 1:  # dropout made the local phase diverge; the switch broadcast rank 0's model
        assert after["differing_before_switch"], after


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_cli_trains_digits_on_two_ranks_and_rank_0_alone_reports(tmp_path: Path) -> None:
    """``mpiexec -n 2 python -m dtrain +recipe=digits learner=data_parallel`` exits 0 with one test line."""
    run_dir = tmp_path / "run"
    result = run_mpi(2, ["-m", "dtrain", "+recipe=digits", "learner=data_parallel", "session.max_samples=3000",
                         f"run_dir={run_dir}", "session.tensorboard=false"], timeout=110, env={"PYTHONPATH": str(REPO)})
    assert result.returncode == 0, result.report()
    test_lines = re.findall(r"^test: accuracy ([0-9.]+)%", result.stdout, re.MULTILINE)
    assert len(test_lines) == 1, result.report()
    assert float(test_lines[0]) > 50.0, result.report()  # 2 sweeps of digits: far above chance (10%)
    assert (run_dir / "metrics.jsonl").is_file()
