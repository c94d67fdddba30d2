"""The two-level learners under a real mpiexec, 2 hosts x 2 ranks (``comm.ranks_per_host=2``, and
once on two network-namespace hosts from the launcher): one model per host after every step, one
model after every sync equal to the outer formula on the hosts' models, the host step equal to SGD
on the host's mean gradient, bit-exact resume, a killed rank ending the job, and the refusals."""
from __future__ import annotations

import time
from pathlib import Path

import pytest

from dtrain.learners.outer import saved_first_moment

from tests.helpers.checks import CheckLaunch, launch_checks
from tests.helpers.mpi import run_mpi
from tests.helpers.cli_runs import CliRuns
from tests.helpers.two_level_runs import (SAME_SUMS, namespace_run_equals_rehearsal, resume_then_relayout,
                                          whole_and_split)

WORKER = Path(__file__).with_name("_two_level_worker.py")


@pytest.fixture(scope="module")
def launch(tmp_path_factory) -> CheckLaunch:
    """One run of every check of ``_two_level_worker.py`` on 4 ranks."""
    return launch_checks(4, [WORKER], tmp_path_factory.mktemp("two_level"), timeout=180)


@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.parametrize("case", ["diloco", "block_momentum", "local_sgd", "diloco_q4"])
def test_one_model_per_host_every_step_and_one_model_after_every_sync(launch: CheckLaunch, case: str) -> None:
    results = launch.results(case)  # the float32 cases also equal the outer formula on the hosts' models
    assert results[0]["syncs"] >= 4 and results[0]["worst"] <= 1e-5, results
    assert results[0]["bytes"] > 0 and results[1]["bytes"] is None  # rank 0 leads host 0, rank 1 does not


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_the_host_step_is_sgd_on_the_hosts_mean_gradient(launch: CheckLaunch) -> None:
    assert max(launch.results("host_step")) <= 1e-6


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_auto_block_size_counts_hosts(launch: CheckLaunch) -> None:
    launch.results("auto_block_size")


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_resume_through_the_python_api_is_exact(launch: CheckLaunch) -> None:
    launch.results("resume_diloco_q4")
    assert launch.returncode == 0, launch.output


# -- the command line ------------------------------------------------------------------------------
COMMON = ["+recipe=digits", "session.minibatch_size=64", "session.checkpoint.frequency=640",
          "session.progress_frequency=640", "session.tensorboard=false", "model.hidden=32",
          "learner=two_level_diloco", "learner/exchange=quantized", "learner.exchange.num_bits=4",
          "learner.block_size=320", "learner.distributed_after=0"]


@pytest.fixture(scope="module")
def resumed(tmp_path_factory) -> tuple[Path, CliRuns]:
    """COMMON's whole and split runs (``whole_and_split``): the resume test's, and the namespace test's rehearsal."""
    base = tmp_path_factory.mktemp("resumed")
    return base, whole_and_split(COMMON, base)


def job(nprocs: int, run_dir: Path, *overrides: str, timeout: float = 240):
    return run_mpi(nprocs, ["-m", "dtrain", *COMMON, f"run_dir={run_dir}", *overrides], timeout=timeout)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_an_interrupted_run_resumes_bit_for_bit_and_onto_other_hosts(resumed) -> None:
    # the same checkpoint onto 4 hosts x 1 rank: the model and outer state carry over, the per-rank state does not
    b, other = resume_then_relayout(COMMON, resumed[1], resumed[0])
    assert b["learner"]["hosts"] == [2, 2] and float(saved_first_moment(b["learner"]["block"]["outer_optimizer"]).abs().sum()) > 0
    assert "trained on 2 hosts x 2 ranks, this run has 4 x 1" in other.stdout, other.report()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_one_host_is_refused_with_one_line(tmp_path: Path) -> None:
    result = job(2, tmp_path)
    assert result.returncode == 2, result.report()
    lines = [line for line in (result.stdout + result.stderr).splitlines() if "dtrain: error:" in line]
    assert lines and "a two-level learner needs several hosts; this job runs on 1 host x 2 ranks" in lines[0], \
        result.report()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_killed_rank_in_one_host_ends_the_job_within_10_s(tmp_path: Path) -> None:
    mark = tmp_path / "acted"
    env = {"DTRAIN_TEST_FAIL_RANK": "3", "DTRAIN_TEST_FAIL_AFTER": "4", "DTRAIN_TEST_FAIL_HOW": "kill",
           "DTRAIN_TEST_MARK": str(mark)}
    result = run_mpi(4, ["-m", "dtrain", "+recipe=digits", f"run_dir={tmp_path / 'run'}",
                         "model._target_=tests.helpers.failing_model.FailingDigitsCNN", "session.tensorboard=false",
                         "session.max_samples=30000", "learner=two_level_diloco", "comm.ranks_per_host=2"],
                     timeout=240, env=env)
    ended = time.time()
    assert mark.exists(), f"the failure was never injected\n{result.report()}"
    assert result.returncode != 0, result.report()
    assert "Traceback" not in result.stdout + result.stderr, result.report()
    assert ended - float(mark.read_text()) < 10, result.report()


@pytest.mark.slow
@pytest.mark.root
@pytest.mark.timeout(400)
def test_two_namespace_hosts_from_the_launcher(resumed, tmp_path: Path) -> None:
    """2 network-namespace hosts x 2 ranks (hostfile, --npernode 2): the hosts come from the launcher,
    and the run equals, bit for bit, the same job rehearsed on one host with comm.ranks_per_host=2 (the
    uninterrupted run of ``resumed`` at the same sample count)."""
    namespace_run_equals_rehearsal([*COMMON, "session.max_samples=1280", *SAME_SUMS],
                                   resumed[0] / "whole" / "checkpoint-1280.pt", tmp_path)
