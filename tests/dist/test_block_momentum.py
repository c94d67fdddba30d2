"""Block momentum under a real mpiexec: one model on all ranks after every sync, equal to the
single-process simulation of CNTK's formulas; and the CLI end to end.

Each launch starts torch in every rank (a few seconds on 2 cores), so one run of
``_bm_worker.py`` per world size covers both learner configurations, each its own test id.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.checks import CheckLaunch, launch_checks
from tests.helpers.mpi import run_mpi

WORKER = Path(__file__).with_name("_bm_worker.py")
CASES = ("defaults", "variants")


@pytest.fixture(scope="module", params=[2, pytest.param(4, marks=pytest.mark.slow)], ids=lambda n: f"nprocs={n}")
def launch(request, tmp_path_factory) -> CheckLaunch:
    """One run of ``_bm_worker.py`` (both configurations) on ``request.param`` ranks."""
    return launch_checks(request.param, [WORKER], tmp_path_factory.mktemp(f"bm{request.param}"), timeout=120)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("case", CASES)
def test_ranks_agree_after_every_sync_and_match_the_simulation(launch: CheckLaunch, case: str) -> None:
    for differences in (result["differences_between_ranks"] for result in launch.results(case)):
        assert len(differences) >= 3 and all(d == 0.0 for d in differences), differences


@pytest.mark.timeout(150)
def test_cntk_settings_for_data_parallel_sgd_give_its_parameters(launch: CheckLaunch) -> None:
    """Block momentum 0, a block of one global minibatch and block learning rate 1 through CNTK's
    factory: parameters equal to data_parallel SGD's (float tolerance), after a real move."""
    result = launch.result("cntk_data_parallel_sgd")
    assert result["max_difference"] <= 1e-5 and result["moved"] > 1e-2, result


@pytest.mark.timeout(150)
def test_powersgd_defaults_under_a_hand_driven_block_learner_are_the_sessions(launch: CheckLaunch) -> None:
    """Driven through ``step()`` without ``plan()``, PowerSGD under block momentum keeps error feedback off for
    syncs (the documented default): the model equals the planned one, the explicit default's and the one
    training_session trains on the same minibatches, bit for bit."""
    result = launch.result("powersgd_defaults_by_hand")
    assert result["error_feedback_difference"] > 1e-3 and result["session_difference"] == 0.0, result


@pytest.mark.timeout(150)
def test_the_launch_ends_cleanly(launch: CheckLaunch) -> None:
    assert launch.returncode == 0, launch.output


@pytest.mark.timeout(240)
@pytest.mark.slow
def test_cli_trains_digits_with_block_momentum_on_two_ranks(run_dir: Path) -> None:
    result = run_mpi(2, ["-m", "dtrain", "+recipe=digits", "learner=block_momentum", "learner.block_size=640",
                         "session.max_samples=3000", f"run_dir={run_dir}"], timeout=200)
    assert result.returncode == 0, result.report()
    assert "finished: 3,000 samples" in result.stdout, result.report()
    assert (run_dir / "config.yaml").is_file()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_cli_block_momentum_with_powersgd_starts_compressing_after_a_tenth_of_its_syncs(run_dir: Path) -> None:
    """``learner=block_momentum learner/exchange=powersgd`` as given: the start counts syncs (12,000 samples
    at 2 ranks: blocks of 160 samples for 50 syncs after the warm start, 57 syncs, so 6), the start-up line says so, and the syncs send a
    small part of the float32 all-reduce's bytes."""
    result = run_mpi(2, ["-m", "dtrain", "+recipe=digits", "learner=block_momentum", "learner/exchange=powersgd",
                         "session.max_samples=12000", "session.progress_frequency=3000", "session.tensorboard=false",
                         f"run_dir={run_dir}"], timeout=250)
    assert result.returncode == 0, result.report()
    assert "exchange powersgd rank 1 (all-reduce for the first 6 syncs, auto: 10% of the run's 57)" in result.stdout, \
        result.report()
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    sent = [record["bytes_sent_per_step"] for record in records if record.get("bytes_sent_per_step")]
    full_precision = 2 * (2 - 1) * 4 * 151_306 // 2  # a float32 all-reduce of the digits CNN's parameters
    assert sent and all(bytes_sent * 10 < full_precision for bytes_sent in sent), sent
