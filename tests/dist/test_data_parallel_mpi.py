"""The data-parallel learner under a real mpiexec: 1, 2 and 4 ranks, and the CLI end to end.

One launch per world size runs every check of ``_dp_worker.py`` (starting the ranks costs more
than the checks); each check is asserted in its own test (``tests.helpers.checks``).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.helpers.checks import CheckLaunch, launch_checks
from tests.helpers.mpi import run_mpi

WORKER = Path(__file__).with_name("_dp_worker.py")

pytestmark = pytest.mark.timeout(150)


@pytest.fixture(scope="module", params=[pytest.param((1, "gloo"), marks=pytest.mark.slow), pytest.param((2, "gloo"), marks=pytest.mark.slow), (2, "mpi"), pytest.param((4, "gloo"), marks=pytest.mark.slow),
                                        pytest.param((4, "mpi"), marks=pytest.mark.slow)],
                ids=lambda param: f"nprocs={param[0]}-{param[1]}")
def launch(request, tmp_path_factory) -> CheckLaunch:
    """One run of every check of ``_dp_worker.py`` on ``nprocs`` ranks whose tensors travel by ``backend``."""
    nprocs, backend = request.param
    run_dir = tmp_path_factory.mktemp(f"dp{nprocs}{backend}")
    return launch_checks(nprocs, [WORKER, run_dir / "runs"], run_dir / "checks", timeout=140,
                         env={"WORKER_BACKEND": backend})


def test_ranks_equal_one_process_with_the_same_global_minibatches(launch: CheckLaunch) -> None:
    """N ranks: identical parameters everywhere; equal to one process with the same global minibatches
    (shares of 7, 1 and 3 samples: uneven, and ranks with 0 samples); BatchNorm buffers identical."""
    equivalence = launch.result("equivalence")
    assert equivalence["size"] == launch.nprocs and equivalence["samples_seen"] == 200
    assert equivalence["differing_parameters"] == [], equivalence
    assert equivalence["differing_batchnorm_state"] == [], equivalence
    assert equivalence["max_difference_to_one_process"] <= 1e-5, equivalence
    assert equivalence["parameters_moved_by"] > 0.1, equivalence  # the comparison is not vacuous
    if launch.nprocs > 1:
        assert equivalence["num_buckets"] >= 3, equivalence  # several buckets, launched in order
        assert equivalence["num_in_place_buckets"] >= 1, equivalence  # and gradients reduced in place


def test_ranks_that_drifted_while_local_are_identical_after_distributed_after(launch: CheckLaunch) -> None:
    """With distributed_after, ranks that drifted apart while local are identical after the switch."""
    after = launch.result("distributed_after")
    assert after["samples_seen"] == 160 and after["differing_parameters"] == [], after
    if launch.nprocs > 1:  # dropout made the local phase diverge; the switch broadcast rank 0's model
        assert after["differing_before_switch"], after


def test_the_launch_ends_cleanly(launch: CheckLaunch) -> None:
    assert launch.returncode == 0, launch.output


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_cli_trains_digits_on_two_ranks_and_rank_0_alone_reports(run_dir: Path) -> None:
    """``mpiexec -n 2 python -m dtrain +recipe=digits learner=data_parallel`` exits 0 with one test line."""
    result = run_mpi(2, ["-m", "dtrain", "+recipe=digits", "learner=data_parallel", "session.max_samples=3000",
                         f"run_dir={run_dir}", "session.tensorboard=false"], timeout=110)
    assert result.returncode == 0, result.report()
    test_lines = re.findall(r"^test: accuracy ([0-9.]+)%", result.stdout, re.MULTILINE)
    assert len(test_lines) == 1, result.report()
    assert float(test_lines[0]) > 50.0, result.report()  # 2 sweeps of digits: far above chance (10%)
    assert (run_dir / "metrics.jsonl").is_file()
    # the run's total exchange: every minibatch's float32 all-reduce, as many bytes each as the progress records say
    minibatches = int(re.search(r"^finished: [\d,]+ samples in ([\d,]+) minibatches", result.stdout,
                                re.MULTILINE).group(1).replace(",", ""))
    per_step = {record["bytes_sent_per_step"] for record in map(json.loads, (run_dir / "metrics.jsonl").open())
                if record.get("kind") == "train"}
    sent = float(re.search(r"^exchange: rank 0 sent ([\d,.]+) MB to the other ranks in this job \(data_parallel\)$",
                           result.stdout, re.MULTILINE).group(1).replace(",", ""))
    assert len(per_step) == 1 and sent == pytest.approx(minibatches * per_step.pop() / 1e6, abs=0.05), result.report()
