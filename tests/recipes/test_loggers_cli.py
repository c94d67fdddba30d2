"""``logger=...`` from the command line: a digits run in MLflow and W&B, a sweep's jobs grouped, bad settings."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.cli import run_dtrain
from tests.helpers.mpi import plain_environment
from tests.helpers.tracking import mlflow_client, mlflow_runs, mlflow_steps, wandb_offline_runs, wandb_run_facts

TINY = ("+recipe=digits", "session.max_samples=640", "session.progress_frequency=320", "session.tensorboard=false")


def train_samples(run_dir: Path) -> list[int]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [record["samples"] for record in map(json.loads, lines) if record["kind"] == "train"]


def test_logger_mlflow_and_wandb_log_a_digits_run(tmp_path):
    pytest.importorskip("mlflow")
    pytest.importorskip("wandb")
    result = run_dtrain(*TINY, "run_dir=run", "logger=[mlflow,wandb]", "logger.wandb.mode=offline", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    run_dir = tmp_path / "run"
    [run] = mlflow_runs(f"file:{run_dir}/mlruns")
    assert run.info.status == "FINISHED" and run.data.tags["mlflow.runName"] == "run"
    assert mlflow_client(f"file:{run_dir}/mlruns").get_experiment(run.info.experiment_id).name == "digits"
    assert [step for step, _ in mlflow_steps(f"file:{run_dir}/mlruns", run.info.run_id, "train/loss")] == \
        train_samples(run_dir) == [320, 640]
    assert run.data.params["optimizer.lr"] == "0.05" and run.data.params["session.max_samples"] == "640"
    artifacts = mlflow_client(f"file:{run_dir}/mlruns").list_artifacts(run.info.run_id)
    assert {"model.safetensors", "report.png"} <= {item.path for item in artifacts}
    [wandb_file] = wandb_offline_runs(run_dir)
    facts = wandb_run_facts(wandb_file)
    assert facts["project"] == "digits" and facts["config"]["optimizer"]["lr"] == 0.05 and facts["exit_code"] == 0
    assert f"dtrain: MLflow run {run.info.run_id} started in file:{run_dir}/mlruns" in result.stdout


@pytest.mark.slow  # a sweep of two jobs, about 14 s
def test_a_sweeps_jobs_are_one_tracking_run_each_grouped_by_the_sweep(tmp_path):
    pytest.importorskip("mlflow")
    pytest.importorskip("wandb")
    sweep = tmp_path / "sweep"
    result = run_dtrain("-m", *TINY, "optimizer.lr=0.02,0.05", f"hydra.sweep.dir={sweep}", "logger=[mlflow,wandb]",
                        "logger.wandb.mode=offline", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    runs = mlflow_runs(f"file:{sweep}/mlruns")  # one store for the sweep
    assert sorted(run.data.params["optimizer.lr"] for run in runs) == ["0.02", "0.05"]
    assert {run.data.tags["dtrain.sweep"] for run in runs} == {str(sweep)}
    assert sorted(run.data.tags["mlflow.runName"] for run in runs) == ["sweep/0", "sweep/1"]
    groups = {wandb_run_facts(path)["group"] for job in ("0", "1") for path in wandb_offline_runs(sweep / job)}
    assert groups == {"sweep"}


def test_a_missing_logger_package_is_one_line_and_exit_2_with_nothing_written(tmp_path):
    # the package hidden from this process: importlib finds no spec for a name mapped to None
    code = "import sys; sys.modules['wandb'] = None; from dtrain.cli import main; sys.argv[0] = 'dtrain'; main()"
    result = subprocess.run([sys.executable, "-c", code, *TINY, "run_dir=run", "logger=wandb"], cwd=tmp_path,
                            env=plain_environment(), capture_output=True, text=True, timeout=240)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.strip().splitlines() == [
        "dtrain: error: logger.wandb: WandbLogger needs the wandb package: pip install 'dtrain[wandb]' "
        "(or leave logger=wandb out)"]
    assert not (tmp_path / "run").exists()


def test_a_tracking_directory_that_cannot_be_written_is_one_line_and_exit_2_with_nothing_written(tmp_path):
    pytest.importorskip("mlflow")
    (tmp_path / "a_file").write_text("")
    result = run_dtrain(*TINY, "run_dir=run", "logger=mlflow",
                        f"logger.mlflow.tracking_uri=file:{tmp_path}/a_file/mlruns", cwd=tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    [line] = result.stderr.strip().splitlines()
    assert line == (f"dtrain: error: MLflowLogger tracking_uri: {tmp_path}/a_file/mlruns cannot be a directory "
                    f"({tmp_path}/a_file is a file); expected a writable directory")
    assert not (tmp_path / "run").exists()


def test_logger_csv_and_tensorboard_put_the_runs_record_files_where_they_say(tmp_path):
    pytest.importorskip("tensorboard")
    result = run_dtrain(*TINY[:-1], "run_dir=run", "logger=[csv,tensorboard]", "logger.csv.path=rows.csv",
                        f"logger.tensorboard.log_dir={tmp_path}/tb/run", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = (tmp_path / "run" / "rows.csv").read_text().splitlines()
    assert rows[0].startswith("kind,samples,time,loss,error") and [row.split(",")[1] for row in rows[1:3]] == \
        ["320", "640"]
    assert list((tmp_path / "tb" / "run").glob("events.out.tfevents.*"))
    assert not (tmp_path / "run" / "metrics.csv").exists() and not (tmp_path / "run" / "tensorboard").exists()


def test_logger_tensorboard_beside_session_tensorboard_false_is_one_line_and_exit_2_with_nothing_written(tmp_path):
    pytest.importorskip("tensorboard")
    result = run_dtrain(*TINY, "run_dir=run", "logger=tensorboard", cwd=tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.strip().splitlines() == [
        "dtrain: error: session.tensorboard=false and logger=tensorboard contradict each other; expected one of them "
        "(session.tensorboard=false writes no TensorBoard events)"]
    assert not (tmp_path / "run").exists()


def test_a_wandb_directory_in_the_way_is_one_line_and_exit_2_with_nothing_written(tmp_path):
    pytest.importorskip("wandb")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "wandb").write_text("")  # W&B writes below RUN_DIR/wandb
    result = run_dtrain(*TINY, "run_dir=run", "logger=wandb", "logger.wandb.mode=offline", cwd=tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.strip().splitlines() == [
        f"dtrain: error: WandbLogger dir: {tmp_path}/run/wandb cannot be a directory ({tmp_path}/run/wandb is a "
        f"file); expected a writable directory"]
    assert [path.name for path in (tmp_path / "run").iterdir()] == ["wandb"]
