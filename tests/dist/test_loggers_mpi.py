"""Loggers under real mpiexec: one tracking run for all ranks (rank 0 logs), continued by a resume at another
world size with its steps (global samples) still increasing."""
from __future__ import annotations

import json

import pytest

from tests.helpers.cli import run_dtrain
from tests.helpers.mpi import run_mpi
from tests.helpers.tracking import mlflow_runs, mlflow_steps, wandb_history, wandb_offline_runs, wandb_run_facts

COMMON = ["+recipe=digits", "session.minibatch_size=64", "session.checkpoint.frequency=640",
          "session.progress_frequency=320", "session.tensorboard=false", "model.hidden=32",
          "logger=[mlflow,wandb]", "logger.wandb.mode=offline"]


@pytest.mark.slow  # about 25 s: a launch and a run (the default suite keeps under 10 minutes)
def test_one_tracking_run_continues_across_a_resume_at_another_world_size(tmp_path):
    pytest.importorskip("mlflow")
    pytest.importorskip("wandb")
    run_dir = tmp_path / "run"
    first = run_mpi(2, ["-m", "dtrain", *COMMON, f"run_dir={run_dir}", "session.max_samples=640"], timeout=300)
    assert first.returncode == 0, first.report()
    second = run_dtrain(*COMMON, f"run_dir={run_dir}", "session.max_samples=1280", cwd=tmp_path, timeout=300)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]  # one process: world size 1
    assert "restored" in second.stdout

    train = [r["samples"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
             if r["kind"] == "train"]
    assert train == [320, 640, 960, 1280]
    [run] = mlflow_runs(f"file:{run_dir}/mlruns")  # one run: rank 1 logged nothing, the resume continued it
    assert [step for step, _ in mlflow_steps(f"file:{run_dir}/mlruns", run.info.run_id, "train/loss")] == train
    assert run.info.status == "FINISHED" and run.data.tags["dtrain.world_size"] == "1"
    files = wandb_offline_runs(run_dir)
    assert len(files) == 2 and len({wandb_run_facts(path)["id"] for path in files}) == 1  # one per job, one run
    steps = [row["_step"] for path in files for row in wandb_history(path) if "train/loss" in row]
    assert steps == train
