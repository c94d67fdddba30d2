"""Loggers: what W&B (offline files) and MLflow (a file store) hold after a run and its resume; refused settings."""
from __future__ import annotations

import csv
import importlib.util
import io
import json
import os
import signal
from pathlib import Path

import pytest
import torch
from torch import nn

from dtrain import CheckpointConfig, CrossValidationConfig, LocalLearner, MinibatchSource, TestConfig, training_session
from dtrain.loggers import CsvLogger, MLflowLogger, TensorBoardLogger, WandbLogger
from dtrain.loggers.mlflow_logger import flatten
from dtrain.session.logger_requirements import package_installed
from dtrain.session.callbacks import Callback

from tests.helpers.toy_data import four_class_data
from tests.helpers.tracking import (mlflow_client, mlflow_runs, mlflow_steps, wandb_history, wandb_offline_runs,
                                    wandb_run_facts)

CONFIG = {"recipe_name": "toy", "optimizer": {"lr": 0.1, "betas": [0.9, 0.99]}, "seed": 0}


def session(run_dir: Path, max_samples: int, callbacks, preemption_signal: str | None = None, config=None, **options):
    """A four-class run: progress every 32 samples, cross-validation and a checkpoint every 64, a test."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 4))
    learner = LocalLearner(torch.optim.SGD(model.parameters(), lr=0.1))
    return training_session(
        model=model, loss=nn.functional.cross_entropy, learner=learner,
        minibatch_source=MinibatchSource(four_class_data(200, 0), randomize=True, randomization_seed=3),
        minibatch_size=16, max_samples=max_samples, progress_frequency=32,
        checkpoint_config=CheckpointConfig("ckpt.pt", frequency=64, preemption_signal=preemption_signal),
        cv_config=CrossValidationConfig(MinibatchSource(four_class_data(40, 1), randomize=False, max_sweeps=1),
                                        frequency=64, minibatch_size=20),
        test_config=TestConfig(MinibatchSource(four_class_data(40, 2), randomize=False, max_sweeps=1), 20),
        run_dir=run_dir, callbacks=callbacks, run_config=config or CONFIG, **{"tensorboard": False, **options})


def records(run_dir: Path, kind: str) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [record for record in map(json.loads, lines) if record["kind"] == kind]


def test_mlflow_holds_the_records_config_and_outputs_and_a_resume_continues_its_run(tmp_path):
    pytest.importorskip("mlflow")
    session(tmp_path, 64, [MLflowLogger()]).train()
    first_id = (tmp_path / "mlflow_run_id").read_text().strip()
    session(tmp_path, 128, [MLflowLogger()]).train()  # resumed from the checkpoint at 64 samples

    uri = f"file:{tmp_path}/mlruns"
    [run] = mlflow_runs(uri)  # one MLflow run for both
    assert run.info.run_id == first_id == (tmp_path / "mlflow_run_id").read_text().strip()
    assert run.info.status == "FINISHED"
    assert mlflow_client(uri).get_experiment(run.info.experiment_id).name == "toy"
    train = records(tmp_path, "train")
    assert [step for step, _ in mlflow_steps(uri, run.info.run_id, "train/loss")] == [32, 64, 96, 128]
    assert mlflow_steps(uri, run.info.run_id, "train/loss") == [(r["samples"], r["loss"]) for r in train]
    assert [step for step, _ in mlflow_steps(uri, run.info.run_id, "cv/error")] == [64, 128]
    test = records(tmp_path, "test")
    assert mlflow_steps(uri, run.info.run_id, "test/error") == [(r["samples"], r["error"]) for r in test]
    assert {key for key in run.data.metrics} >= {"train/loss", "train/error", "train/lr", "cv/loss", "test/loss"}
    assert run.data.params == {"recipe_name": "toy", "optimizer.lr": "0.1", "optimizer.betas": "[0.9, 0.99]",
                               "seed": "0"}
    artifacts = {item.path for item in mlflow_client(uri).list_artifacts(run.info.run_id)}
    assert artifacts == {"model.safetensors", "report.png"}


def test_a_setting_changed_for_the_resume_is_an_mlflow_tag_beside_the_first_value(tmp_path):
    pytest.importorskip("mlflow")
    session(tmp_path, 64, [MLflowLogger()]).train()
    session(tmp_path, 128, [MLflowLogger()], config={**CONFIG, "optimizer": {"lr": 0.2, "betas": [0.9, 0.99]},
                                                     "new": 1}).train()
    [run] = mlflow_runs(f"file:{tmp_path}/mlruns")
    assert run.data.params["optimizer.lr"] == "0.1" and run.data.tags["changed.optimizer.lr"] == "0.2"
    assert run.data.params["new"] == "1" and "changed.seed" not in run.data.tags


def test_wandb_offline_files_hold_the_records_and_a_resume_continues_the_same_run(tmp_path):
    pytest.importorskip("wandb")
    session(tmp_path, 64, [WandbLogger(mode="offline")]).train()
    session(tmp_path, 128, [WandbLogger(mode="offline")]).train()

    files = wandb_offline_runs(tmp_path)
    assert len(files) == 2  # one offline file per job, both of the same W&B run
    facts = [wandb_run_facts(path) for path in files]
    run_id = (tmp_path / "wandb_run_id").read_text().strip()
    assert [fact["id"] for fact in facts] == [run_id, run_id]
    assert facts[0]["project"] == "toy" and facts[0]["config"]["optimizer"] == {"lr": 0.1, "betas": [0.9, 0.99]}
    history = [row for path in files for row in wandb_history(path)]
    train = records(tmp_path, "train")
    assert [(row["_step"], row["train/loss"]) for row in history] == [(r["samples"], r["loss"]) for r in train]
    assert [row["_step"] for row in history if "cv/error" in row] == [64, 128]
    assert "test/error" in history[-1]
    assert [fact["exit_code"] for fact in facts] == [0, 0]
    assert facts[-1]["artifacts"] == [["model.safetensors", "report.png"]]


class FailAtCrossValidation(Callback):
    def on_cross_validation(self, run, record):
        raise RuntimeError("broken callback")


def test_a_failed_run_ends_its_tracking_runs_as_failed(tmp_path):
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    with pytest.raises(RuntimeError, match="broken callback"):
        session(tmp_path, 128, [MLflowLogger(tracking_uri=f"file:{tmp_path}/store"),
                                WandbLogger(mode="offline", dir=tmp_path / "wb"), FailAtCrossValidation()]).train()
    [run] = mlflow_runs(f"file:{tmp_path}/store")
    assert run.info.status == "FAILED"
    assert mlflow_steps(f"file:{tmp_path}/store", run.info.run_id, "train/loss")[0][0] == 32
    [wandb_file] = wandb_offline_runs(tmp_path / "wb")
    assert wandb_run_facts(wandb_file)["exit_code"] == 1


class FailAtProgress(Callback):
    def __init__(self, samples):
        self.samples = samples

    def on_progress(self, run, record):
        if record["samples"] == self.samples:
            raise RuntimeError("the node went down")


def test_the_steps_trained_again_after_a_crash_are_logged_once(tmp_path):
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")

    def loggers():
        return [MLflowLogger(), WandbLogger(mode="offline")]

    # the first run logs 96 past its checkpoint at 64, then fails; the resumed run trains 65..128 again
    with pytest.raises(RuntimeError, match="the node went down"):
        session(tmp_path, 128, [*loggers(), FailAtProgress(96)]).train()
    stream = io.StringIO()
    session(tmp_path, 128, loggers(), stream=stream).train()

    train = records(tmp_path, "train")
    assert [r["samples"] for r in train] == [32, 64, 96, 96, 128]  # metrics.jsonl has both runs' 96
    uri = f"file:{tmp_path}/mlruns"
    [run] = mlflow_runs(uri)  # one value a step: the first run's at 96, as first logged
    assert mlflow_steps(uri, run.info.run_id, "train/loss") == \
        [(r["samples"], r["loss"]) for r in train[:3] + train[4:]]
    assert [step for step, _ in mlflow_steps(uri, run.info.run_id, "cv/error")] == [64, 128]
    first, second = wandb_offline_runs(tmp_path)
    assert [row["_step"] for row in wandb_history(first) if "train/loss" in row] == [32, 64, 96]
    assert [row["_step"] for row in wandb_history(second) if "train/loss" in row] == [128]
    assert f"dtrain: MLflow run {run.info.run_id} already holds records up to 96 samples, logged before the restart " \
           f"from 64; this run's records up to there are kept in metrics.jsonl only" in stream.getvalue()


class FullDiskMLflowLogger(MLflowLogger):
    def _log(self, values, step, timestamp):
        raise OSError(28, "No space left on device")


def test_a_tracker_failing_during_training_costs_a_warning_not_the_run(tmp_path):
    pytest.importorskip("mlflow")
    with pytest.warns(RuntimeWarning) as caught:
        result = session(tmp_path, 64, [FullDiskMLflowLogger()]).train()
    # one line per record the tracker missed: each names it, and metrics.jsonl has them all
    logged = list(map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines()))
    assert [str(warning.message) for warning in caught] == [
        f"FullDiskMLflowLogger: OSError: [Errno 28] No space left on device; the record at {r['samples']} samples "
        f"is missing there (metrics.jsonl has it)" for r in logged]
    assert result.samples_seen == 64 and result.test is not None
    [run] = mlflow_runs(f"file:{tmp_path}/mlruns")
    assert run.info.status == "FINISHED" and not run.data.metrics
    assert {item.path for item in mlflow_client(f"file:{tmp_path}/mlruns").list_artifacts(run.info.run_id)} == \
        {"model.safetensors", "report.png"}


class PreemptAt(Callback):
    """Sends the preemption signal to this process once ``samples`` are trained."""

    def __init__(self, samples):
        self.samples = samples

    def on_step_end(self, run, step):
        if step.samples_seen == self.samples:
            os.kill(os.getpid(), signal.SIGUSR1)


def test_a_preempted_run_leaves_its_tracking_runs_to_be_continued(tmp_path):
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    result = session(tmp_path, 128, [MLflowLogger(), WandbLogger(mode="offline"), PreemptAt(48)], "SIGUSR1").train()
    assert result.preempted and result.samples_seen < 128  # at 48 or, once the signal is seen, a step later
    uri = f"file:{tmp_path}/mlruns"
    [run] = mlflow_runs(uri)
    assert run.info.status == "KILLED"
    [first] = wandb_offline_runs(tmp_path)
    assert wandb_run_facts(first)["preempting"] and wandb_run_facts(first)["exit_code"] == 75
    assert wandb_run_facts(first)["artifacts"] == []  # the outputs come with the end of training

    session(tmp_path, 128, [MLflowLogger(), WandbLogger(mode="offline")], "SIGUSR1").train()
    [run] = mlflow_runs(uri)
    assert run.info.status == "FINISHED"
    steps = [step for step, _ in mlflow_steps(uri, run.info.run_id, "train/loss")]
    assert steps == [r["samples"] for r in records(tmp_path, "train")] and steps == sorted(set(steps))
    assert steps[0] == 32 and steps[-1] == 128 and result.samples_seen in steps
    second = [path for path in wandb_offline_runs(tmp_path) if path != first]
    assert [wandb_run_facts(path)["id"] for path in second] == [wandb_run_facts(first)["id"]]
    assert [row["_step"] for row in wandb_history(second[0]) if "train/loss" in row] == \
        [step for step in steps if step > result.samples_seen]


def test_a_missing_client_package_names_its_extra(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("wandb", "mlflow") else real(name, *a))
    with pytest.raises(ValueError, match=r"WandbLogger needs the wandb package: pip install 'dtrain\[wandb\]'"):
        WandbLogger(mode="offline")
    with pytest.raises(ValueError, match=r"MLflowLogger needs the mlflow package: pip install 'dtrain\[mlflow\]'"):
        MLflowLogger()


def test_a_directory_named_like_the_package_is_not_the_package(tmp_path, monkeypatch):
    (tmp_path / "tracker_client").mkdir()  # as W&B's own ./wandb in the working directory
    monkeypatch.syspath_prepend(str(tmp_path))
    assert importlib.util.find_spec("tracker_client") is not None and not package_installed("tracker_client")
    assert package_installed("json")


@pytest.mark.parametrize("make", [lambda blocked: WandbLogger(mode="offline", dir=blocked),
                                  lambda blocked: MLflowLogger(tracking_uri=f"file:{blocked}")],
                         ids=["wandb", "mlflow"])
def test_a_directory_that_cannot_be_written_is_refused_before_anything_is_written(tmp_path, make):
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    (tmp_path / "a_file").write_text("")
    with pytest.raises(ValueError, match=r"a_file/logs(/wandb)? cannot be a directory .*a_file is a file"):
        session(tmp_path / "run", 64, [make(tmp_path / "a_file" / "logs")])
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())
    if os.geteuid() != 0:  # root writes anywhere
        (tmp_path / "read_only").mkdir(mode=0o500)
        with pytest.raises(ValueError, match="read_only/logs(/wandb)? is not writable"):
            session(tmp_path / "run", 64, [make(tmp_path / "read_only" / "logs")])


def test_a_wandb_directory_in_the_way_is_refused_when_the_session_is_built_not_when_the_run_starts(tmp_path):
    # W&B writes below <dir>/wandb: a file (or, for another user, a read-only directory) there made wandb.init fail
    # after config.yaml and the metrics files were written
    pytest.importorskip("wandb")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "wandb").write_text("")
    with pytest.raises(ValueError, match=r"^WandbLogger dir: .*run/wandb cannot be a directory \(.*run/wandb is a "
                                         r"file\); expected a writable directory$"):
        session(tmp_path / "run", 64, [WandbLogger(mode="offline")])
    assert [path.name for path in (tmp_path / "run").iterdir()] == ["wandb"]


class UnreachableMLflowLogger(MLflowLogger):
    def _start(self, run, resume_id):
        raise ConnectionError("mlflow:5000 is unreachable")


def test_a_tracker_that_cannot_start_its_run_fails_it_before_the_runs_first_write(tmp_path):
    pytest.importorskip("mlflow")
    with pytest.raises(ConnectionError, match="unreachable"):
        session(tmp_path / "run", 64, [UnreachableMLflowLogger()]).train()
    assert not (tmp_path / "run").exists()  # no metrics.jsonl, metrics.csv (nor, from the CLI, config.yaml)
    session(tmp_path / "run", 64, []).train()
    before = {path: path.read_bytes() for path in (tmp_path / "run").rglob("*") if path.is_file()}
    with pytest.raises(ConnectionError, match="unreachable"):  # a resumed run: its directory as it was
        session(tmp_path / "run", 128, [UnreachableMLflowLogger()]).train()
    assert {path: path.read_bytes() for path in (tmp_path / "run").rglob("*") if path.is_file()} == before


def test_wandb_online_without_credentials_is_refused_before_training(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    for name in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_MODE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no_netrc"))
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(ValueError, match="mode=online: no W&B credentials"):
        session(tmp_path / "run", 64, [WandbLogger()])
    with pytest.raises(ValueError, match="mode='cloud': expected one of online, offline, disabled"):
        WandbLogger(mode="cloud")


def test_the_config_is_flattened_into_mlflow_parameters():
    assert flatten({"a": {"b": {"c": 1}, "d": None}, "e": [1, "x"], "f": {}}) == \
        {"a.b.c": "1", "a.d": "None", "e": '[1, "x"]', "f": "{}"}
    assert flatten({"long": "x" * 7000})["long"].endswith("...")
    assert flatten({"inputs": {"text[:-1]": 1}}) == {"inputs.text_:-1_": "1"}


# -- logger=csv and logger=tensorboard: the run's own record files, placed elsewhere ------------------------------


def tensorboard_scalars(directory: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of the event files in ``directory``: tag -> [(step, value)] (float32, as TensorBoard keeps it)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(directory))
    events.Reload()
    return {tag: [(event.step, event.value) for event in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_csv_and_tensorboard_loggers_write_the_runs_records_where_they_say_and_nothing_twice(tmp_path):
    pytest.importorskip("tensorboard")
    run_dir, stream = tmp_path / "run", io.StringIO()
    session(run_dir, 64, [CsvLogger("rows.csv"), TensorBoardLogger(tmp_path / "tb" / "run")], stream=stream,
            tensorboard=None).train()
    session(run_dir, 128, [CsvLogger("rows.csv"), TensorBoardLogger(tmp_path / "tb" / "run")], stream=stream,
            tensorboard=None).train()  # resumed: the rows rewritten from metrics.jsonl, a second event file

    logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    with open(run_dir / "rows.csv", newline="") as rows:
        assert [(int(row["samples"]), row["kind"], float(row["loss"])) for row in csv.DictReader(rows)] == \
            [(r["samples"], r["kind"], r["loss"]) for r in logged]
    scalars = tensorboard_scalars(tmp_path / "tb" / "run")
    train = [r for r in logged if r["kind"] == "train"]
    assert [step for step, _ in scalars["train/loss"]] == [r["samples"] for r in train] == [32, 64, 96, 128]
    assert [value for _, value in scalars["train/loss"]] == pytest.approx([r["loss"] for r in train], rel=1e-6)
    assert {"cv/error", "test/error", "train/lr"} <= set(scalars)
    # the session's own files of those kinds are not written beside them
    assert not (run_dir / "metrics.csv").exists() and not (run_dir / "tensorboard").exists()
    assert f"metrics: {run_dir / 'metrics.jsonl'}, rows.csv, TensorBoard: {tmp_path / 'tb' / 'run'}" in \
        stream.getvalue()


def test_tensorboard_events_are_asked_for_by_the_logger_and_refused_beside_session_tensorboard_false(tmp_path,
                                                                                                   monkeypatch):
    pytest.importorskip("tensorboard")
    with pytest.raises(ValueError, match=r"^session.tensorboard=false and logger=tensorboard contradict each other"):
        session(tmp_path / "run", 64, [TensorBoardLogger()], tensorboard=False)
    assert not (tmp_path / "run").exists()
    session(tmp_path / "run", 64, [TensorBoardLogger()], tensorboard=True).train()  # the same thing asked twice
    assert len(list((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"))) == 1
    # the logger needs the package whatever session.tensorboard says
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    with pytest.raises(ValueError, match=r"^TensorBoardLogger needs the tensorboard package: pip install "
                                         r"'dtrain\[tensorboard\]' \(or leave logger=tensorboard out\)$"):
        TensorBoardLogger()


def test_bad_csv_and_tensorboard_logger_settings_are_refused_before_anything_is_written(tmp_path):
    with pytest.raises(ValueError, match=r"CsvLogger path='rows.txt': expected a file name ending in .csv"):
        CsvLogger("rows.txt")
    with pytest.raises(ValueError, match=r"^2 CsvLoggers were given; expected at most one"):
        session(tmp_path / "run", 64, [CsvLogger(), CsvLogger("more.csv")])
    (tmp_path / "a_file").write_text("")
    with pytest.raises(ValueError, match=r"CsvLogger path: .*a_file/rows cannot be a directory .*a_file is a file"):
        session(tmp_path / "run", 64, [CsvLogger(tmp_path / "a_file" / "rows" / "rows.csv")]).train()
    assert not (tmp_path / "run").exists()
