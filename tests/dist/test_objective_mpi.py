"""Your own objective under a real ``mpiexec -n 2``: a two-loss objective and a distillation objective under
data_parallel equal one process on the same global minibatches (parameters and logged figures), also in
micro-batches, and a resume from a checkpoint is bit-identical (``_objective_worker.py``)."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.checks import CheckLaunch, launch_checks

WORKER = Path(__file__).with_name("_objective_worker.py")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]


@pytest.fixture(scope="module")
def launch(tmp_path_factory) -> CheckLaunch:
    """One run of every check of ``_objective_worker.py`` on 2 ranks."""
    run_dir = tmp_path_factory.mktemp("objective")
    return launch_checks(2, [WORKER, run_dir / "runs"], run_dir / "checks", timeout=380)


@pytest.mark.parametrize("check", ["two_losses", "distillation"])
def test_an_objective_under_data_parallel_equals_one_process(launch: CheckLaunch, check: str) -> None:
    record = launch.result(check)
    assert record["moved"] > 0.05, record  # training changed the model measurably
    for name in ("uncapped", "micro_batches"):
        run = record[name]
        assert run["difference_to_one_process"] < 1e-5 and run["differing_parameters"] == [], (name, record)
        assert run["figure_difference"] < 1e-5, (name, record)  # the figures are averaged over ranks exactly
    figures = {"two_losses": {"main_loss", "aux"}, "distillation": {"kl", "cross_entropy"}}[check]
    assert figures <= set(record["uncapped"]["figures"]), record


def test_the_distillation_teacher_is_loaded_and_stays_frozen(launch: CheckLaunch) -> None:
    record = launch.result("distillation")
    assert record["teacher_loaded"] == 0.0 and record["teacher_unchanged"] and record["teacher_frozen"], record


def test_a_resumed_objective_run_is_bit_identical(launch: CheckLaunch) -> None:
    record = launch.result("resume")
    assert 96 <= record["restored_at"] < 200 and record["bit_identical"] and record["moved"] > 0.05, record


def test_a_bad_first_result_on_one_rank_is_refused_on_every_rank(launch: CheckLaunch) -> None:
    record = launch.result("bad_first_result")
    first, second = record["refusals"]
    assert first is not None and first == second, record  # the same line on both ranks
    assert "returned a torch.float32 tensor of shape (" in first and "at the first minibatch" in first, first
    assert record["unchanged"] == [True, True], record


def test_the_launch_ends_cleanly(launch: CheckLaunch) -> None:
    assert launch.returncode == 0, launch.output
