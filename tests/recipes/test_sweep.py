"""Hydra sweeps (``-m``): one run directory per job, the objective returned to sweepers, launchers, and
failing jobs that end alone: each with its one line, named in the summary, the sweep going on."""
from __future__ import annotations

import csv
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


def summary(sweep: Path) -> list[dict]:
    with open(sweep / "sweep_summary.csv", newline="") as table:
        return list(csv.DictReader(table))


@pytest.mark.slow
def test_a_sweep_trains_each_job_in_its_own_directory_and_goes_on_past_failing_and_diverging_jobs(tmp_path):
    sweep = tmp_path / "sweep"
    result = run_dtrain("-m", *TINY, "optimizer.lr=0.02,-1,1e9,0.05", f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr  # every failure a bad input or a divergence
    assert "restored" not in result.stdout
    for job, lr in ((0, 0.02), (3, 0.05)):
        run = sweep / str(job)
        assert f"run directory {run} " in result.stdout
        assert checkpoint.load(run / "checkpoint-640.pt")["samples_seen"] == 640
        assert yaml.safe_load((run / "config.yaml").read_text())["optimizer"]["lr"] == lr
    assert final_test_error(sweep / "0") != final_test_error(sweep / "3")
    # each job names its overrides; each failure is its own one line; the summary ends the sweep
    jobs = [line for line in result.stdout.splitlines() if line.startswith("dtrain: job ")]
    assert jobs == ["dtrain: job 0/4: optimizer.lr=0.02", "dtrain: job 1/4: optimizer.lr=-1",
                    "dtrain: job 2/4: optimizer.lr=1000000000.0", "dtrain: job 3/4: optimizer.lr=0.05"]
    bad_input, diverged, ending = result.stderr.splitlines()
    assert bad_input == "dtrain: error: optimizer.lr=-1.0: expected a positive finite number"
    assert diverged.startswith("dtrain: error: training diverged: the mean loss is ")
    assert ending == "dtrain: error: sweep: 2 of 4 jobs failed (jobs 1, 2)"
    assert f"dtrain: sweep of 4 jobs: 2 finished, 2 failed (summary in {sweep / 'sweep_summary.csv'})" in result.stdout
    rows = summary(sweep)
    assert [(row["job"], row["overrides"], row["status"], row["exit_code"], row["run_dir"]) for row in rows] == [
        ("0", "optimizer.lr=0.02", "finished", "0", str(sweep / "0")), ("1", "optimizer.lr=-1", "failed", "2", str(sweep / "1")),
        ("2", "optimizer.lr=1000000000.0", "diverged", "2", str(sweep / "2")),
        ("3", "optimizer.lr=0.05", "finished", "0", str(sweep / "3"))]
    assert float(rows[3]["objective"]) == final_test_error(sweep / "3")
    first_summary = (sweep / "sweep_summary.csv").read_bytes()
    # the same command with the same sweep directory continues each job from its own checkpoint
    again = run_dtrain("-m", *TINY[:-3], "session.max_samples=960", "session.tensorboard=false",
                       "optimizer.lr=0.02,-1,1e9,0.05", f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert again.returncode == 2, again.stdout + again.stderr
    for job in (0, 3):
        assert f"restored {sweep / str(job) / 'checkpoint-640.pt'} at 640 samples" in again.stdout
    assert [row["status"] for row in summary(sweep)] == ["finished", "failed", "diverged", "finished"]
    # the first run's table is kept beside the new one
    assert "the earlier run's kept as sweep_summary.1.csv" in again.stdout
    assert (sweep / "sweep_summary.1.csv").read_bytes() == first_summary


@pytest.mark.slow
def test_an_optuna_sweep_minimises_the_returned_test_error_and_goes_on_past_a_diverging_trial(tmp_path):
    sweep = tmp_path / "optuna"
    # seed 2 draws 0.02, then the diverging 1e9, then 0.05, one trial per batch
    result = run_dtrain("-m", *TINY, "hydra/sweeper=optuna", "hydra.sweeper.n_trials=3", "hydra.sweeper.n_jobs=1",
                        "hydra.sweeper.sampler.seed=2", "optimizer.lr=choice(1e9,0.05,0.02)", f"hydra.sweep.dir={sweep}",
                        cwd=tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    rows = summary(sweep)
    assert [(row["overrides"], row["status"]) for row in rows] == [
        ("optimizer.lr=0.02", "finished"), ("optimizer.lr=1000000000.0", "diverged"), ("optimizer.lr=0.05", "finished")]
    errors = [final_test_error(sweep / str(job)) for job in (0, 2)]
    best = yaml.safe_load((sweep / "optimization_results.yaml").read_text())  # the failed trial is left out
    assert best["best_value"] == pytest.approx(min(errors)) and best["best_params"]["optimizer.lr"] in (0.02, 0.05)
    diverged, ending = [line for line in result.stderr.splitlines() if "error" in line.lower()]
    assert diverged.startswith("dtrain: error: training diverged: the mean loss is "), result.stderr
    assert ending == "dtrain: error: sweep: 1 of 3 jobs failed (job 1)", result.stderr


@pytest.mark.slow  # a long multi-process case; .ci/run runs the slow set
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
    pytest.param(("hydra/launcher=submitit_local", "hydra.launcher.tasks_per_node=2"), "starts 2 independent copies of each job",
                 marks=pytest.mark.slow),
    pytest.param(("optimizer.lrr=0.1",), "Could not override 'optimizer.lrr'. (Key 'lrr' not in 'SGDConfig')",
                 marks=pytest.mark.slow),  # Hydra's own error
])
def test_a_sweep_that_would_share_or_copy_a_run_is_refused_in_one_line(tmp_path, args, fragment):
    result = run_dtrain("-m", *TINY, *args, "optimizer.lr=0.02,0.05", f"hydra.sweep.dir={tmp_path / 'sweep'}", cwd=tmp_path)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dtrain: error: ") and fragment in lines[0], result.stderr
    assert not (tmp_path / "sweep").exists() and not (tmp_path / "fixed").exists()
