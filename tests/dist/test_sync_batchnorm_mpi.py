"""Synchronized BatchNorm and recomputed statistics under a real ``mpiexec -n 2`` and ``-n 4 --oversubscribe``:
the data-parallel learner with ``sync_batchnorm`` equals one process (parameters and running statistics,
uneven shares, a rank without samples), without it it does not; micro-batches stay in step; recomputed
statistics are the exact ones; evaluation issues no BatchNorm collective.

One launch per world size runs every check of ``_sync_batchnorm_worker.py``; each is asserted in its own test.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers.checks import CheckLaunch, launch_checks

WORKER = Path(__file__).with_name("_sync_batchnorm_worker.py")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module", params=[2, 4], ids=["2ranks", "4ranks"])
def launch(request, tmp_path_factory) -> CheckLaunch:
    run_dir = tmp_path_factory.mktemp(f"sync_batchnorm_{request.param}")
    return launch_checks(request.param, [WORKER, run_dir / "runs"], run_dir / "checks", timeout=360)


def test_sync_batchnorm_equals_one_process_and_plain_batchnorm_does_not(launch: CheckLaunch) -> None:
    record = launch.result("equal_to_one_process")
    assert record["moved"] > 0.05, record  # training changed the model measurably
    assert record["differing_on_ranks"] == [], record
    for key, difference in record["sync"].items():  # parameters, running_mean/var, num_batches_tracked
        assert difference < 1e-9, (key, record)
    assert max(record["plain"][key] for key in record["plain"] if "running" in key) > 1e-3, record
    assert max(record["plain"].values()) > 1e-3, record


def test_micro_batches_keep_the_ranks_in_step(launch: CheckLaunch) -> None:
    record = launch.result("micro_batches")
    assert record["differing_on_ranks"] == [] and record["padded_differing_on_ranks"] == [], record
    if launch.nprocs == 4:  # every share within the cap: one pass each, the union is one process's minibatch
        assert record["difference"] < 1e-9, record


def test_recomputed_statistics_are_the_exact_ones(launch: CheckLaunch) -> None:
    record = launch.result("recomputed")
    assert max(record["differences"]) < 1e-4, record
    assert record["position_unchanged"], record
    assert record["differing_on_ranks"] == [], record


@pytest.fixture(scope="module")
def one_process_recomputed(tmp_path_factory) -> dict:
    """The ``recomputed`` check alone under ``mpiexec -n 1``."""
    run_dir = tmp_path_factory.mktemp("recomputed_1")
    return launch_checks(1, [WORKER, run_dir / "runs", "recomputed"], run_dir / "checks", timeout=300).result("recomputed")


def test_recomputed_statistics_do_not_depend_on_the_world_size(launch: CheckLaunch, one_process_recomputed) -> None:
    """The same run at 1 rank (``mpiexec -n 1``) and at N recomputes the same statistics."""
    means = [one_process_recomputed["running_mean"], launch.result("recomputed")["running_mean"]]
    assert means[0] == pytest.approx(means[1], abs=1e-9), means


def test_evaluation_issues_no_batchnorm_collective(launch: CheckLaunch) -> None:
    record = launch.result("eval_without_traffic")
    assert record["collectives_in_eval"] == 0 and record["collectives"] > 0, record
    assert record["test_samples"] == 297, record


def test_a_finished_run_resumed_recomputes_the_same_statistics(tmp_path) -> None:
    """Recomputing reads training samples past the end without moving the checkpointed position: running the
    finished command again (restore, nothing left to train) writes the same model.safetensors."""
    from safetensors.torch import load_file

    from dtrain.session import checkpoint

    from tests.helpers.cli import run_dtrain

    command = ["+recipe=digits", "model.batch_norm=true", "session.batchnorm_statistics=recomputed",
               "session.batchnorm_recompute_samples=200", "session.max_samples=320", f"run_dir={tmp_path / 'run'}"]
    first = run_dtrain(*command, cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    weights = load_file(tmp_path / "run" / "model.safetensors")
    again = run_dtrain(*command, cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert "recomputed over 200 training samples" in again.stdout
    resumed = load_file(tmp_path / "run" / "model.safetensors")
    assert all(torch.equal(weights[key], resumed[key]) for key in weights)
    # the checkpoint keeps the running statistics training resumes with, not the recomputed ones
    state = checkpoint.load(next((tmp_path / "run").glob("checkpoint-*.pt")))
    assert not torch.equal(state["model"]["features.1.running_var"], weights["features.1.running_var"])


def test_sync_batchnorm_with_block_momentum_is_refused_on_every_rank(tmp_path) -> None:
    from tests.helpers.mpi import run_mpi

    result = run_mpi(2, ["-m", "dtrain", "+recipe=digits", "model.batch_norm=true", "learner=block_momentum",
                         "session.sync_batchnorm=true", f"run_dir={tmp_path / 'run'}"], timeout=120)
    assert result.returncode == 2, result.report()
    assert "sync_batchnorm=true with the block_momentum learner" in result.stderr, result.report()
    assert not (tmp_path / "run").exists()


def test_compiled_and_bf16_runs_keep_synchronized_statistics(tmp_path) -> None:
    """session.compile=true equals the eager run (the reducing forward is left out of the graph); bf16 autocast
    keeps float32 statistics; both identical on every rank (2 ranks, compiling takes minutes on a small CPU)."""
    launch = launch_checks(2, [WORKER, tmp_path / "runs", "compile_and_bf16"], tmp_path / "checks", timeout=500)
    record = launch.result("compile_and_bf16")
    assert record["differing_on_ranks"] == [], record
    assert record["compiled_difference"] < 1e-5, record
    assert record["bf16_statistics_dtype"] == "torch.float32" and record["bf16_difference"] < 0.1, record
