"""Hydra sweeps (``-m``): one run directory per job, the objective returned to sweepers, launchers."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from dtrain.session import checkpoint

from tests.helpers.cli import run_dtrain

TINY = ("+recipe=digits", "session.max_samples=640", "session.progress_frequency=320", "session.tensorboard=false")


def final_test_error(run_dir: Path) -> float:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return next(r["error"] for r in records if r["kind"] == "test")


def test_a_two_job_sweep_trains_twice_into_two_run_directories(tmp_path):
    sweep = tmp_path / "sweep"
    result = run_dtrain("-m", *TINY, "optimizer.lr=0.02,0.05", f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "restored" not in result.stdout
    for job, lr in ((0, 0.02), (1, 0.05)):
        run = sweep / str(job)
        assert f"run directory {run} " in result.stdout
        assert checkpoint.load(run / "checkpoint-640.pt")["samples_seen"] == 640
        assert yaml.safe_load((run / "config.yaml").read_text())["optimizer"]["lr"] == lr
    assert final_test_error(sweep / "0") != final_test_error(sweep / "1")
    # the same command with the same sweep directory continues each job from its own checkpoint
    again = run_dtrain("-m", *TINY[:-3], "session.max_samples=960", "session.tensorboard=false", "optimizer.lr=0.02,0.05",
                       f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert again.returncode == 0, again.stdout + again.stderr
    for job in (0, 1):
        assert f"restored {sweep / str(job) / 'checkpoint-640.pt'} at 640 samples" in again.stdout


def test_an_optuna_sweep_minimises_the_returned_test_error(tmp_path):
    sweep = tmp_path / "optuna"
    result = run_dtrain("-m", *TINY, "hydra/sweeper=optuna", "hydra.sweeper.n_trials=3", "hydra.sweeper.sampler.seed=1",
                        "optimizer.lr=interval(0.01,0.1)", f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    errors = [final_test_error(sweep / str(job)) for job in range(3)]
    best = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    assert best["best_value"] == pytest.approx(min(errors))
    assert len({yaml.safe_load((sweep / str(job) / "config.yaml").read_text())["optimizer"]["lr"]
                for job in range(3)}) == 3


def test_a_sweep_through_submitit_trains_distinct_runs(tmp_path):
    sweep = tmp_path / "submitit"
    result = run_dtrain("-m", *TINY, "hydra/launcher=submitit_local", "optimizer.lr=0.02,0.05", f"hydra.sweep.dir={sweep}",
                        cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    logs = "".join(p.read_text() for p in sweep.glob(".submitit/*/*_log.out"))
    assert "restored" not in logs
    assert final_test_error(sweep / "0") != final_test_error(sweep / "1")
    assert [yaml.safe_load((sweep / str(job) / "config.yaml").read_text())["optimizer"]["lr"] for job in (0, 1)] \
        == [0.02, 0.05]


@pytest.mark.parametrize("args, fragment", [
    (("run_dir=fixed",), "run_dir cannot be set in a sweep"),
    (("hydra/launcher=submitit_local", "hydra.launcher.tasks_per_node=2"), "starts 2 independent copies of each job"),
])
def test_a_sweep_that_would_share_or_copy_a_run_is_refused_in_one_line(tmp_path, args, fragment):
    result = run_dtrain("-m", *TINY, *args, "optimizer.lr=0.02,0.05", f"hydra.sweep.dir={tmp_path / 'sweep'}", cwd=tmp_path)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dtrain: error: ") and fragment in lines[0], result.stderr
    assert not (tmp_path / "sweep").exists() and not (tmp_path / "fixed").exists()
