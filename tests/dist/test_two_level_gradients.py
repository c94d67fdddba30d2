"""The two-level gradient learner (``learner=two_level_quantized`` / ``two_level_powersgd``) under a real
mpiexec, 2 hosts x 2 ranks (``comm.ranks_per_host=2``): identical parameters on every rank after every
step, every step equal to an independent reference (exact host sums, then the k-bit or PowerSGD maths
over 2 hosts), bit-exact resume through the API and the command line, and a fresh exchange state, with
one line, onto another host layout."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.checks import CheckLaunch, launch_checks
from tests.helpers.cli_runs import CliRuns
from tests.helpers.two_level_runs import (SAME_SUMS, namespace_run_equals_rehearsal, resume_then_relayout,
                                          whole_and_split)

WORKER = Path(__file__).with_name("_two_level_gradients_worker.py")


@pytest.fixture(scope="module")
def launch(tmp_path_factory) -> CheckLaunch:
    """One run of every check of ``_two_level_gradients_worker.py`` on 4 ranks."""
    return launch_checks(4, [WORKER], tmp_path_factory.mktemp("two_level_gradients"), timeout=180)


@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.parametrize("case", ["quantized", "powersgd", "quantized_adamw"])
def test_every_step_is_the_reference_and_identical_on_every_rank(launch: CheckLaunch, case: str) -> None:
    results = launch.results(case)
    leader, other = results[0], results[1]  # rank 0 leads host 0, rank 1 does not
    assert leader["leader"] and not other["leader"]
    assert all(between > 0 for between in leader["between"]) and set(other["between"]) == {0}
    assert leader["compressed"], leader
    assert other["sent"] > 0  # a non-leader sends its gradient to the leader
    # AdamW under 1-bit between hosts: its variance held from the first 1-bit step, the same on every rank
    assert all(result["variance_held"] for result in results) == (case == "quantized_adamw")


@pytest.fixture(scope="module")
def launch_unequal(tmp_path_factory) -> CheckLaunch:
    """The same checks on 3 ranks over MPI: hosts of 2 ranks and of 1 (``comm.ranks_per_host=2``)."""
    return launch_checks(3, [WORKER, "mpi"], tmp_path_factory.mktemp("two_level_gradients_unequal"), timeout=180)


@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.parametrize("case", ["quantized", "powersgd"])
def test_unequal_hosts_over_mpi_step_as_the_reference(launch_unequal: CheckLaunch, case: str) -> None:
    """Hosts of 2 and 1 ranks on the MPI backend: every step the reference's (host sums of 2 and of 1), one
    model on every rank; the lone rank leads its host and sends only between hosts."""
    results = launch_unequal.results(case)
    assert [result["leader"] for result in results] == [True, False, True]
    assert all(between > 0 for between in results[2]["between"]) and set(results[1]["between"]) == {0}
    launch_unequal.results(f"resume_{case}")


@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.parametrize("case", ["quantized", "powersgd", "quantized_adamw"])
def test_resume_through_the_python_api_is_exact(launch: CheckLaunch, case: str) -> None:
    # quantized_adamw: the variance held from step 2 and restored at step 4, corrected as from step 2
    launch.results(f"resume_{case}")


# -- the command line ------------------------------------------------------------------------------
COMMON = ["+recipe=digits", "session.minibatch_size=64", "session.checkpoint.frequency=640",
          "session.progress_frequency=640", "session.tensorboard=false", "model.hidden=32",
          "learner=two_level_quantized", "learner.distributed_after=320"]


@pytest.fixture(scope="module")
def resumed(tmp_path_factory) -> tuple[Path, CliRuns]:
    """COMMON's whole and split runs (``whole_and_split``): the resume test's, and the namespace test's rehearsal."""
    base = tmp_path_factory.mktemp("resumed")
    return base, whole_and_split(COMMON, base)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_an_interrupted_run_resumes_bit_for_bit_and_afresh_onto_other_hosts(resumed) -> None:
    b, other = resume_then_relayout(COMMON, resumed[1], resumed[0])
    assert b["learner"]["hosts"] == [2, 2]
    assert ("the quantized exchange state between hosts was saved on 2 hosts x 2 ranks, this run has 4 hosts x 1 "
            "rank: starting it afresh") in other.stdout, other.report()


@pytest.mark.slow
@pytest.mark.root
@pytest.mark.timeout(400)
def test_two_namespace_hosts_from_the_launcher(resumed, tmp_path: Path) -> None:
    """2 network-namespace hosts x 2 ranks (hostfile, --npernode 2): the hosts come from the launcher,
    and the run equals, bit for bit, the same job rehearsed on one host with comm.ranks_per_host=2 (the
    uninterrupted run of ``resumed`` at the same sample count)."""
    namespace_run_equals_rehearsal([*COMMON, "session.max_samples=1280", *SAME_SUMS],
                                   resumed[0] / "whole" / "checkpoint-1280.pt", tmp_path)
