"""Compressed outer updates (block momentum through ``learner/exchange=quantized``) and DiLoCo under
a real mpiexec: one model on all ranks after every sync, DiLoCo equal to torch's SGD-Nesterov
reference, bit-exact resume with the residuals, and the command line at another world size (the
command line's resume of every learner: test_resume.py)."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.checks import CheckLaunch, launch_checks
from tests.helpers.learners import LEARNERS
from tests.helpers.mpi import run_mpi

from dtrain.session import checkpoint

WORKER = Path(__file__).with_name("_diloco_worker.py")
SYNCED = ("bmuf_q8", "bmuf_q4", "diloco", "diloco_q4")


@pytest.fixture(scope="module", params=[2, pytest.param(4, marks=pytest.mark.slow)], ids=lambda n: f"nprocs={n}")
def launch(request, tmp_path_factory) -> CheckLaunch:
    """One run of every check of ``_diloco_worker.py`` on ``request.param`` ranks."""
    return launch_checks(request.param, [WORKER], tmp_path_factory.mktemp(f"diloco{request.param}"), timeout=180)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("case", SYNCED)
def test_ranks_hold_one_model_after_every_sync(launch: CheckLaunch, case: str) -> None:
    syncs = launch.result(case)  # diloco: also equal to torch's SGD-Nesterov reference (checked in the worker)
    assert len(syncs) >= 4 and all(sync["difference"] == 0.0 for sync in syncs), syncs
    ratios = {sync["ratio"] for sync in syncs}
    if case.endswith(("q4", "q8")):
        assert min(ratios) > 1.5, (case, ratios)  # fewer bytes than a float32 all-reduce
    else:
        assert ratios == {1.0}, (case, ratios)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("case", ["resume_bmuf_q4", "resume_diloco_q4"])
def test_resume_with_the_residuals_is_exact(launch: CheckLaunch, case: str) -> None:
    launch.results(case)


@pytest.mark.timeout(200)
def test_the_launch_ends_cleanly(launch: CheckLaunch) -> None:
    assert launch.returncode == 0, launch.output


# -- the command line ------------------------------------------------------------------------------
COMMON = ["-m", "dtrain", "+recipe=digits", "session.minibatch_size=64", "session.checkpoint.frequency=640",
          "session.progress_frequency=640", "session.tensorboard=false", "model.hidden=32"]
def dtrain_job(nprocs: int, run_dir: Path, *overrides: str, timeout: float = 240):
    return run_mpi(nprocs, [*COMMON, f"run_dir={run_dir}", *overrides], timeout=timeout)


@pytest.mark.slow  # a long multi-process case; .ci/run runs the slow set
@pytest.mark.timeout(300)
def test_diloco_at_another_world_size_resets_the_residuals_and_says_so(tmp_path: Path) -> None:
    first = dtrain_job(2, tmp_path, *LEARNERS["diloco_4bit"], "session.max_samples=640")
    assert first.returncode == 0, first.report()
    assert "inner optimizer AdamW" in first.stdout and "outer SGD lr 0.7 momentum 0.9 Nesterov on" in first.stdout
    second = dtrain_job(1, tmp_path, *LEARNERS["diloco_4bit"], "session.max_samples=1280")
    assert second.returncode == 0, second.report()
    assert "restoring a checkpoint of 2 workers on 1" in second.stdout
    assert "the exchange strategy's residuals and factors) reset" in second.stdout
    state = checkpoint.load(tmp_path / "checkpoint-1280.pt")
    assert state["world_size"] == 1 and state["samples_seen"] == 1280
