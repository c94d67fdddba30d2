"""training_session in one process: CNTK's action timing, bit-exact restore, safe checkpoints."""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from dtrain import CheckpointConfig, CrossValidationConfig, MinibatchSource, Schedule, TestConfig, training_session
from dtrain import LocalLearner as Learner  # one process: the local learner (the base Learner is abstract)
from dtrain.data import ArrayDeserializer
from dtrain.session import checkpoint
from dtrain.session.checkpoint import CheckpointError

from tests.helpers.toy_data import four_class_data


def make_data(num_samples: int = 200, seed: int = 0) -> ArrayDeserializer:
    """This file's data: 200 samples unless told."""
    return four_class_data(num_samples, seed)


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 4))


def make_session(run_dir: Path, max_samples: int, cv_callback=None, restore: bool = True, progress_frequency=None,
                 checkpoint_frequency: int | None = 64, test: bool = False):
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    data = make_data()
    source = MinibatchSource(data, randomize=True, randomization_seed=3)
    cv = None
    if cv_callback is not None:
        cv = CrossValidationConfig(MinibatchSource(make_data(50, seed=1), randomize=False, max_sweeps=1),
                                   frequency=96, minibatch_size=20, callback=cv_callback)
    return model, training_session(
        model=model, loss=nn.functional.cross_entropy, learner=Learner(optimizer), minibatch_source=source,
        minibatch_size=Schedule([[1, 16], [1, 32]], epoch_size=200), max_samples=max_samples,
        progress_frequency=progress_frequency,
        checkpoint_config=CheckpointConfig("ckpt.pt", frequency=checkpoint_frequency, restore=restore),
        cv_config=cv, test_config=TestConfig(MinibatchSource(make_data(60, seed=2), randomize=False, max_sweeps=1), 25) if test else None,
        lr_schedule=Schedule([[1, 1.0], [1, 0.5]], epoch_size=150), run_dir=run_dir, tensorboard=False,
    )


def test_restored_run_ends_with_exactly_the_parameters_of_an_uninterrupted_run(tmp_path):
    torch.manual_seed(123)
    model_a, session_a = make_session(tmp_path / "a", max_samples=480)
    session_a.train()

    class Crash(RuntimeError):
        pass

    def crash_at_third_cv(index, error, samples, minibatches):
        if index == 2:  # third CV point, 304 samples: after the checkpoint at 272
            raise Crash("simulated failure")

    torch.manual_seed(123)
    _, interrupted = make_session(tmp_path / "b", max_samples=480, cv_callback=crash_at_third_cv)
    with pytest.raises(Crash):
        interrupted.train()
    assert sorted(p.name for p in (tmp_path / "b").glob("ckpt-*.pt")) == ["ckpt-192.pt", "ckpt-272.pt"]  # keep_last=2
    assert checkpoint.load(tmp_path / "b" / "ckpt-272.pt")["samples_seen"] == 272

    torch.manual_seed(999)  # a different process state: only the checkpoint may matter
    model_b, resumed = make_session(tmp_path / "b", max_samples=480)
    result = resumed.train()
    assert result.restored_from == tmp_path / "b" / "ckpt-272.pt"
    assert result.samples_seen == 480
    for (name, a), (_, b) in zip(model_a.state_dict().items(), model_b.state_dict().items()):
        assert torch.equal(a, b), name


def test_actions_fire_each_period_and_once_more_at_the_end(tmp_path):
    calls = []
    _, session = make_session(tmp_path, max_samples=300, progress_frequency=100,
                              cv_callback=lambda *args: calls.append(args), checkpoint_frequency=0)
    result = session.train()
    # minibatches of 16 up to 200 samples, then 32: sample counts 16, 32, ..., 192, 208, 240, 272, 300 (last clipped)
    assert result.samples_seen == 300
    # CV every 96 samples fires at 96, 192 and 300 (the first count past 288); nothing is left for the end
    assert [c[0] for c in calls] == [0, 1, 2]
    assert all(c[2] == 50 for c in calls)  # every CV pass reads the whole CV source again
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["samples"] for r in records if r["kind"] == "train"] == [112, 208, 300]
    assert [r["samples"] for r in records if r["kind"] == "cv"] == [96, 192, 300]
    assert not list(tmp_path.glob("ckpt*"))  # frequency 0 disables checkpoints


def test_cv_callback_returning_false_stops_training(tmp_path):
    _, session = make_session(tmp_path, max_samples=1000, cv_callback=lambda index, *rest: index < 1)
    result = session.train()
    assert result.stopped_early and result.samples_seen == 192


def test_test_config_reads_the_whole_test_source_once(tmp_path):
    _, session = make_session(tmp_path, max_samples=100, test=True)
    result = session.train()
    assert result.test.num_samples == 60 and result.test.num_minibatches == 3
    assert 0.0 <= result.test.error <= 1.0


def test_restore_off_refuses_to_overwrite_an_existing_checkpoint(tmp_path):
    make_session(tmp_path, max_samples=64)[1].train()
    before = (tmp_path / "ckpt-64.pt").read_bytes()
    with pytest.raises(CheckpointError, match="already exists and restore is off"):
        make_session(tmp_path, max_samples=64, restore=False)[1].train()
    assert (tmp_path / "ckpt-64.pt").read_bytes() == before


def test_unreadable_checkpoint_is_one_clear_error_and_left_alone(tmp_path):
    (tmp_path / "ckpt-64.pt").write_bytes(b"not a checkpoint at all")
    with pytest.raises(CheckpointError, match=r"ckpt-64.pt could not be read") as caught:
        make_session(tmp_path, max_samples=64)[1].train()
    assert "\n" not in str(caught.value)
    assert (tmp_path / "ckpt-64.pt").read_bytes() == b"not a checkpoint at all"


@pytest.mark.parametrize("damage", ["truncate", "flip_byte", "empty"])
def test_damaged_newest_checkpoint_falls_back_to_the_previous_good_one(tmp_path, damage):
    make_session(tmp_path, max_samples=128)[1].train()
    newest = tmp_path / "ckpt-128.pt"
    data = newest.read_bytes()
    if damage == "truncate":
        newest.write_bytes(data[: len(data) // 2])
    elif damage == "flip_byte":
        newest.write_bytes(data[:-100] + bytes([data[-100] ^ 0xFF]) + data[-99:])
    else:
        newest.write_bytes(b"")
    with pytest.raises(CheckpointError) as direct:
        checkpoint.load(newest)
    assert {"truncate": "truncated", "flip_byte": "checksum mismatch", "empty": "no valid header"}[damage] in str(direct.value)
    with pytest.warns(RuntimeWarning, match="using the previous checkpoint ckpt-64.pt"):
        result = make_session(tmp_path, max_samples=160)[1].train()
    assert result.restored_from == tmp_path / "ckpt-64.pt"


def test_a_write_killed_midway_leaves_the_previous_checkpoint_in_use(tmp_path, monkeypatch):
    make_session(tmp_path, max_samples=64)[1].train()
    # what SIGKILL during a write leaves behind: a partial temporary file, never the final name
    (tmp_path / ".ckpt-128.pt.abc123.tmp").write_bytes(b"DTRAIN-CHECKPOINT 2 partial")

    def dies_before_the_data_is_durable(fd):
        raise KeyboardInterrupt("killed while writing")

    monkeypatch.setattr(os, "fsync", dies_before_the_data_is_durable)
    with pytest.raises(KeyboardInterrupt):
        make_session(tmp_path, max_samples=128)[1].train()
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("ckpt")) == ["ckpt-64.pt"]
    assert make_session(tmp_path, max_samples=128)[1].train().restored_from == tmp_path / "ckpt-64.pt"


def test_checkpoint_of_another_model_is_refused_naming_the_difference(tmp_path):
    make_session(tmp_path, max_samples=64)[1].train()
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Dropout(0.2), nn.Linear(8, 4))
    session = training_session(model, nn.functional.cross_entropy, Learner(torch.optim.SGD(model.parameters(), lr=0.1)),
                               MinibatchSource(make_data()), 16, max_samples=64,
                               checkpoint_config=CheckpointConfig("ckpt.pt"), run_dir=tmp_path, tensorboard=False)
    with pytest.raises(CheckpointError, match=r"0.weight has shape \(16, 6\) in the checkpoint, \(8, 6\) in the model"):
        session.train()


def test_checkpoint_of_another_configuration_is_refused_naming_the_key(tmp_path):
    def run(identity):
        model = make_model()
        return training_session(model, nn.functional.cross_entropy, Learner(torch.optim.SGD(model.parameters(), lr=0.1)),
                                MinibatchSource(make_data()), 16, max_samples=64, checkpoint_config=CheckpointConfig("ckpt.pt"),
                                run_dir=tmp_path, tensorboard=False, checkpoint_identity=identity).train()
    run({"model": {"hidden": 16}, "seed": 0})
    with pytest.raises(CheckpointError, match="model.hidden was 16 in the checkpoint's run and is 32 now"):
        run({"model": {"hidden": 32}, "seed": 0})


@pytest.mark.parametrize("key", ["learner_kind", "per_rank"])
def test_checkpoint_missing_a_required_entry_is_refused_naming_it(tmp_path, key):
    make_session(tmp_path, max_samples=64)[1].train()
    path = tmp_path / "ckpt-64.pt"
    state = checkpoint.load(path)
    del state[key]
    checkpoint.save_atomic(state, path)  # well-formed and checksummed, but not a whole dtrain checkpoint
    before = path.read_bytes()
    with pytest.raises(CheckpointError, match=rf"ckpt-64.pt lacks '{key}': it was not written by this dtrain"):
        make_session(tmp_path, max_samples=128)[1].train()
    assert path.read_bytes() == before


def test_checkpoint_write_is_atomic_checksummed_and_loads_without_code(tmp_path):
    _, session = make_session(tmp_path, max_samples=64)
    session.train()
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []  # no temporary left behind
    assert (tmp_path / "ckpt-64.pt").read_bytes().startswith(b"DTRAIN-CHECKPOINT 3 sha256=")
    state = checkpoint.load(tmp_path / "ckpt-64.pt")
    assert state["learner"]["kind"] == "local" and state["world_size"] == 1
    assert set(state) >= {"model", "learner", "source", "per_rank", "samples_seen", "identity", "versions"}
    assert state["per_rank"][0]["rng"].dtype == torch.uint8


def test_preserve_all_keeps_every_checkpoint_and_restores_the_latest(tmp_path):
    model = make_model()
    def build(max_samples):
        return training_session(model, nn.functional.cross_entropy, Learner(torch.optim.SGD(model.parameters(), lr=0.1)),
                                MinibatchSource(make_data()), 16, max_samples=max_samples,
                                checkpoint_config=CheckpointConfig("ckpt.pt", frequency=32, preserve_all=True),
                                run_dir=tmp_path, tensorboard=False)
    build(96).train()
    assert sorted(p.name for p in tmp_path.glob("ckpt-*.pt")) == ["ckpt-32.pt", "ckpt-64.pt", "ckpt-96.pt"]
    assert build(128).train().restored_from == tmp_path / "ckpt-96.pt"


def test_bad_arguments_are_refused_when_built():
    model = make_model()
    learner = Learner(torch.optim.SGD(model.parameters(), lr=0.1))
    source = MinibatchSource(make_data())
    with pytest.raises(ValueError, match="minibatch_size=0: expected a positive whole number of samples"):
        training_session(model, nn.functional.cross_entropy, learner, source, 0)
    with pytest.raises(ValueError, match="max_samples"):
        training_session(model, nn.functional.cross_entropy, learner, source, 8, max_samples=-5)
    with pytest.raises(TypeError, match="dtrain Learner"):
        training_session(model, nn.functional.cross_entropy, learner.optimizer, source, 8)
    with pytest.raises(ValueError, match="CheckpointConfig.frequency=-1"):
        CheckpointConfig("x", frequency=-1)
    adam = Learner(torch.optim.Adam(model.parameters()))
    with pytest.raises(ValueError, match="momentum"):
        training_session(model, nn.functional.cross_entropy, adam, source, 8, momentum_time_constant_schedule=Schedule(600))


def test_a_diverging_run_stops_with_one_line_and_keeps_the_last_good_checkpoint(tmp_path):
    from dtrain.session import TrainingDiverged

    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e6)  # a learning rate that blows up
    session = training_session(model, nn.functional.cross_entropy, Learner(optimizer), MinibatchSource(make_data()), 16,
                               max_samples=2000, progress_frequency=160,
                               checkpoint_config=CheckpointConfig("ckpt.pt", frequency=16), run_dir=tmp_path,
                               tensorboard=False)
    with pytest.raises(TrainingDiverged, match="training diverged") as caught:
        session.train()
    assert "\n" not in str(caught.value)
    saved = checkpoint.CheckpointFiles(tmp_path / "ckpt.pt").existing()
    assert saved  # the good ones from before the blow-up
    for _, path in saved:
        assert all(torch.isfinite(t).all() for t in checkpoint.load(path)["model"].values())


# -- TensorBoard is an optional extra ------------------------------------------------------------------


def _simple_session(run_dir: Path, **options):
    model = make_model()
    return training_session(model, nn.functional.cross_entropy, Learner(torch.optim.SGD(model.parameters(), lr=0.1)),
                            MinibatchSource(make_data(), randomization_seed=3), minibatch_size=20, max_samples=100,
                            run_dir=run_dir, **options)


def test_tensorboard_by_default_only_when_installed_and_a_clear_error_when_asked_for_without_it(tmp_path, monkeypatch):
    import io

    from dtrain.session import metrics

    monkeypatch.setattr(metrics, "tensorboard_available", lambda: False)
    out = io.StringIO()
    _simple_session(tmp_path / "default", stream=out).train()  # the default run never fails
    assert not (tmp_path / "default" / "tensorboard").exists()
    assert "no TensorBoard events: pip install 'dtrain[tensorboard]'" in out.getvalue()
    with pytest.raises(ValueError, match=r"session.tensorboard=true needs the tensorboard package"):
        _simple_session(tmp_path / "asked", tensorboard=True)
    assert not (tmp_path / "asked").exists()  # refused before anything is written
    monkeypatch.setattr(metrics, "tensorboard_available", lambda: True)
    _simple_session(tmp_path / "installed", stream=io.StringIO()).train()
    assert list((tmp_path / "installed" / "tensorboard").glob("events.out.tfevents.*"))


# -- outputs people read: metrics.csv, the time split, report.png --------------------------------------


def test_csv_rows_match_the_jsonl_records_and_a_resumed_run_keeps_one_header(tmp_path):
    import csv
    import io

    _, session = make_session(tmp_path, max_samples=240, progress_frequency=40, test=True)
    session.stream = io.StringIO()
    session.train()
    _, session = make_session(tmp_path, max_samples=400, progress_frequency=40, test=True)  # resumes
    session.stream = io.StringIO()
    session.train()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    with open(tmp_path / "metrics.csv", newline="") as file:
        rows = list(csv.DictReader(file))
    assert len(rows) == len(records) > 10
    for row, record in zip(rows, records):
        assert set(record) <= set(row)
        for key, value in record.items():
            assert row[key] == str(value), (key, row, record)
    assert list(rows[0])[:5] == ["kind", "samples", "time", "loss", "error"]


def test_each_progress_period_records_a_time_split_that_sums_to_the_period(tmp_path):
    import io

    _, session = make_session(tmp_path, max_samples=400, progress_frequency=80, checkpoint_frequency=None)
    session.stream = io.StringIO()
    session.train()
    train = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in train if r["kind"] == "train"]
    assert len(train) == 5
    for record in train:
        parts = [record[key] for key in ("data_s", "compute_s", "update_s", "other_s")]
        assert all(part >= 0 for part in parts), record
        assert record["period_s"] > 0 and sum(parts) == pytest.approx(record["period_s"], abs=1e-4), record
        assert record["compute_s"] > 0 and record["data_s"] > 0 and record["update_s"] > 0
        assert record["samples_per_second"] > 0


def test_report_png_is_written_at_the_end_and_is_a_real_picture(tmp_path):
    import io
    import struct

    out = io.StringIO()
    _, session = make_session(tmp_path, max_samples=400, progress_frequency=80, test=True)
    session.stream = out
    session.train()
    report = tmp_path / "report.png"
    assert f"report: {report}" in out.getvalue()
    data = report.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert 800 <= width <= 2000 and 600 <= height <= 2000
    assert 20_000 < len(data) < 2_000_000


def test_report_draws_bytes_per_step_when_the_learner_reports_them(tmp_path):
    from dtrain.session.report import write_report

    records = [{"kind": "train", "samples": 100 * i, "time": 1000.0 + i, "loss": 1.0 / i, "error": 0.5 / i,
                "samples_per_second": 100.0, "period_s": 1.0, "data_s": 0.1, "compute_s": 0.6, "update_s": 0.2,
                "other_s": 0.1, "bytes_sent_per_step": 4096} for i in range(1, 6)]
    with_bytes = write_report(records, tmp_path / "with.png").read_bytes()
    for record in records:
        del record["bytes_sent_per_step"]
    without = write_report(records, tmp_path / "without.png").read_bytes()
    import struct
    assert struct.unpack(">II", with_bytes[16:24])[1] > struct.unpack(">II", without[16:24])[1]  # one more row of plots



def test_report_gives_each_further_metric_its_own_row(tmp_path):
    """metric=wer also reports per: report.png draws it too, not only the first name."""
    import struct

    from dtrain.session.report import write_report

    records = [{"kind": "train", "samples": 100 * i, "time": 1000.0 + i, "loss": 1.0 / i, "wer": 0.5 / i,
                "samples_per_second": 100.0, "period_s": 1.0, "compute_s": 1.0} for i in range(1, 6)]
    records.append({"kind": "test", "samples": 500, "time": 1006.0, "loss": 0.2, "wer": 0.3, "per": 0.1})
    one = write_report(records, tmp_path / "one.png", metric_name="wer", percent=True).read_bytes()
    two = write_report(records, tmp_path / "two.png", metric_name="wer", percent=True, more_metrics=("wer", "per")).read_bytes()
    height = lambda png: struct.unpack(">II", png[16:24])[1]  # noqa: E731
    assert height(two) > height(one)  # one more row: per against samples and against time


# -- your own loss and metric ---------------------------------------------------------------------------


def test_top5_error_matches_a_hand_computation():
    from dtrain.session import TopKError

    logits = torch.tensor([[0.0, 1, 2, 3, 4, 5, 6],    # label 0 is 7th largest: error
                           [6.0, 5, 4, 3, 2, 1, 0],    # label 4 is 5th largest: fine
                           [0.0, 0, 0, 0, 0, 0, 9],    # label 6 is largest: fine
                           [1.0, 2, 3, 4, 5, 6, 7]])   # label 1 is 6th largest: error
    labels = torch.tensor([0, 4, 6, 1])
    metric = TopKError(5)
    assert metric.name == "top5_error" and int(metric(logits, labels)) == 2
    assert int(TopKError(1)(logits, labels)) == int((logits.argmax(1) != labels).sum()) == 3


def test_a_regression_run_with_mse_keeps_float_labels_and_names_its_metric(tmp_path):
    import io

    from dtrain.session import MeanAbsoluteError, MSELoss

    generator = np.random.default_rng(0)
    features = generator.normal(size=(200, 3)).astype(np.float32)
    targets = (features @ np.array([0.5, -0.25, 0.125], dtype=np.float32) + 0.25).astype(np.float32)
    seen_labels = []

    def mse(output, labels):
        seen_labels.append(labels)
        return MSELoss()(output, labels)

    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    out = io.StringIO()
    result = training_session(
        model, mse, Learner(torch.optim.SGD(model.parameters(), lr=0.1)),
        MinibatchSource(ArrayDeserializer(features, targets), randomization_seed=1), minibatch_size=20, max_samples=2000,
        progress_frequency=1000, metric=MeanAbsoluteError(), run_dir=tmp_path, tensorboard=False, stream=out,
        test_config=TestConfig(MinibatchSource(ArrayDeserializer(features, targets), randomize=False, max_sweeps=1), 50),
    ).train()
    assert all(labels.dtype == torch.float32 for labels in seen_labels)
    first_sweep = torch.cat(seen_labels[:10])  # 10 minibatches of 20: every target once, exactly
    assert torch.equal(first_sweep.sort().values, torch.from_numpy(np.sort(targets)))
    assert result.test.error < 0.05  # a mean absolute error: it learned the float targets
    lines = out.getvalue().splitlines()
    assert any(line.startswith("samples") and "| mean_abs_error 0.0" in line for line in lines), lines
    assert not any("error  " in line or "accuracy" in line for line in lines)
    assert any(line.startswith("test: mean_abs_error ") for line in lines), lines
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all("mean_abs_error" in r and "error" not in r and "accuracy" not in r for r in records)
    assert "mean_abs_error" in (tmp_path / "metrics.csv").read_text().splitlines()[0].split(",")


def test_progress_lines_name_the_metric(tmp_path):
    import io

    from dtrain.session import TopKError

    out = io.StringIO()
    _simple_session(tmp_path, metric=TopKError(3), progress_frequency=40, stream=out, tensorboard=False).train()
    progress = [line for line in out.getvalue().splitlines() if line.startswith("samples")]
    assert len(progress) == 3 and all("| top3_error " in line and "%" in line for line in progress)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all("top3_error" in r for r in records)


def test_mse_refuses_shapes_that_would_broadcast():
    from dtrain.session import MSELoss

    with pytest.raises(ValueError, match=r"outputs shape \(4, 2\) but the labels have shape \(4,\)"):
        MSELoss()(torch.zeros(4, 2), torch.zeros(4))
    assert float(MSELoss()(torch.ones(4, 1), torch.zeros(4))) == 1.0


def test_the_trained_weights_are_written_as_safetensors_equal_to_the_model(tmp_path):
    import io

    from safetensors.torch import load_file

    out = io.StringIO()
    model, session = make_session(tmp_path, max_samples=240)
    session.stream = out
    session.train()
    path = tmp_path / "model.safetensors"
    assert f"weights: {path}" in out.getvalue()
    weights = load_file(path)
    state = model.state_dict()
    assert weights.keys() == state.keys()
    for name, tensor in state.items():
        assert torch.equal(weights[name], tensor.cpu()), name
    fresh = make_model(seed=5)
    fresh.load_state_dict(weights)  # loads into a plain model without dtrain's help
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), state.values()))


def test_a_metrics_line_cut_by_a_kill_does_not_swallow_the_next_record(tmp_path):
    import io

    tmp_path.mkdir(exist_ok=True)
    torn = '{"kind": "train", "samples": 16, "time": 1.0, "loss": 1.0}\n{"kind": "tr'
    (tmp_path / "metrics.jsonl").write_text(torn)
    with pytest.warns(RuntimeWarning, match="line 2 is not JSON"):
        _simple_session(tmp_path, stream=io.StringIO(), tensorboard=False).train()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert json.loads(lines[0])["samples"] == 16 and len(lines) > 1 and all(json.loads(line) for line in lines)
    assert len((tmp_path / "metrics.csv").read_text().splitlines()) == 1 + len(lines)  # header + every record
    assert [p.read_text() for p in tmp_path.glob("metrics.jsonl.damaged-*")] == [torn]  # set aside as it was
    assert (tmp_path / "report.png").is_file()


# -- resume with changed settings ------------------------------------------------------------------
def plain_session(run_dir: Path, max_samples: int, lr=0.1, momentum=0.9, weight_decay=0.0, cv=None, **options):
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay)
    return model, training_session(
        model, nn.functional.cross_entropy, Learner(optimizer), MinibatchSource(make_data(), randomize=True,
                                                                                  randomization_seed=3),
        16, max_samples=max_samples, checkpoint_config=CheckpointConfig("ckpt.pt", frequency=64), cv_config=cv,
        run_dir=run_dir, tensorboard=False, **options)


def test_changed_optimizer_settings_take_effect_on_resume_and_are_named(tmp_path, capsys):
    plain_session(tmp_path, 64)[1].train()
    _, resumed = plain_session(tmp_path, 128, lr=0.001, momentum=0.0, weight_decay=0.5)
    resumed.restore()
    group = resumed.learner.optimizer.param_groups[0]
    assert (group["lr"], group["momentum"], group["weight_decay"]) == (0.001, 0.0, 0.5)
    assert resumed.learner.optimizer.state  # the momentum buffers of the checkpoint are kept
    result = resumed.train()
    assert result.restored_from == tmp_path / "ckpt-64.pt"
    printed = capsys.readouterr().out
    changes = next(line for line in printed.splitlines() if "settings changed since the checkpoint" in line)
    for fragment in ("optimizer[0].lr: 0.1 -> 0.001", "optimizer[0].momentum: 0.9 -> 0.0",
                     "optimizer[0].weight_decay: 0.0 -> 0.5", "max_samples: 64 -> 128"):
        assert fragment in changes, changes
    # what the next checkpoint records is what ran
    saved = checkpoint.load(tmp_path / "ckpt-128.pt")["learner"]["optimizer"]["param_groups"][0]
    assert (saved["lr"], saved["momentum"], saved["weight_decay"]) == (0.001, 0.0, 0.5)


def test_a_resume_with_changed_settings_equals_a_run_that_switched_at_that_point(tmp_path):
    plain_session(tmp_path / "split", 64)[1].train()
    torch.manual_seed(5)
    resumed_model, resumed = plain_session(tmp_path / "split", 160, lr=0.03, momentum=0.5, weight_decay=0.01)
    resumed.train()

    def switch(index, *rest):  # the callback fires after the step at 64 samples, as the resume point
        if index == 0:
            for group in session.learner.optimizer.param_groups:
                group.update(lr=0.03, momentum=0.5, weight_decay=0.01)
            session.schedules.base_learning_rates[:] = [0.03]

    cv = CrossValidationConfig(callback=switch, frequency=64)
    whole_model, session = plain_session(tmp_path / "whole", 160, cv=cv)
    session.train()
    for (name, a), (_, b) in zip(whole_model.state_dict().items(), resumed_model.state_dict().items()):
        assert torch.equal(a, b), name


def test_a_run_config_names_changed_keys_against_the_checkpoints_config(tmp_path, capsys):
    plain_session(tmp_path, 64, run_config={"optimizer": {"lr": 0.1}, "session": {"max_samples": 64}})[1].train()
    plain_session(tmp_path, 128, run_config={"optimizer": {"lr": 0.1}, "session": {"max_samples": 128}})[1].train()
    changes = next(line for line in capsys.readouterr().out.splitlines() if "settings changed" in line)
    assert changes.endswith("now in effect: session.max_samples: 64 -> 128")


# -- checkpoints that lie, temporaries, modes, bounded reads, unsafe content, disk full ---------------
def test_a_copy_named_as_newer_is_skipped_and_never_makes_pruning_delete_the_newest(tmp_path):
    plain_session(tmp_path, 128)[1].train()
    (tmp_path / "ckpt-9999.pt").write_bytes((tmp_path / "ckpt-64.pt").read_bytes())  # an old state, a big name
    with pytest.warns(RuntimeWarning, match=r"ckpt-9999.pt holds the state at 64 samples, not 9999"):
        result = plain_session(tmp_path, 192)[1].train()
    assert result.restored_from == tmp_path / "ckpt-128.pt"
    # keep_last=2 by content: 128 and 192 stay, the lying file is neither counted nor deleted
    assert sorted(p.name for p in tmp_path.glob("ckpt-*.pt")) == ["ckpt-128.pt", "ckpt-192.pt", "ckpt-9999.pt"]
    assert checkpoint.load(tmp_path / "ckpt-192.pt")["samples_seen"] == 192


def test_a_symlink_to_an_older_checkpoint_is_skipped(tmp_path):
    plain_session(tmp_path, 128)[1].train()
    (tmp_path / "ckpt-500.pt").symlink_to(tmp_path / "ckpt-64.pt")
    with pytest.warns(RuntimeWarning, match="not 500 as its name says"):
        assert plain_session(tmp_path, 192)[1].train().restored_from == tmp_path / "ckpt-128.pt"


def test_stale_temporaries_of_killed_writes_are_removed_at_start(tmp_path):
    plain_session(tmp_path, 64)[1].train()
    stale = [tmp_path / ".ckpt-128.pt.abc123.tmp", tmp_path / ".ckpt-192.pt.x_9.tmp"]
    for path in stale:
        path.write_bytes(b"DTRAIN-CHECKPOINT 3 partial")
    (tmp_path / ".other.pt.abc.tmp").write_bytes(b"not ours")
    plain_session(tmp_path, 128)[1].restore()
    assert not any(path.exists() for path in stale)
    assert (tmp_path / ".other.pt.abc.tmp").exists()


def test_checkpoints_get_the_umask_permissions_of_other_outputs(tmp_path):
    old = os.umask(0o002)
    try:
        plain_session(tmp_path, 64)[1].train()
    finally:
        os.umask(old)
    assert (tmp_path / "ckpt-64.pt").stat().st_mode & 0o777 == 0o664
    assert (tmp_path / "metrics.jsonl").stat().st_mode & 0o777 == 0o664


def test_load_compares_the_size_before_reading_and_reads_only_the_declared_bytes(tmp_path, monkeypatch):
    junk = tmp_path / "ckpt-64.pt"
    with open(junk, "wb") as stream:
        stream.write(b"DTRAIN-CHECKPOINT 3 sha256=" + b"0" * 64 + b" bytes=100 samples=64\n")
        stream.truncate(1 << 30)  # a sparse 1 GiB file: costs no disk, would cost 1 GiB of memory to read
    reads = []
    real_open = open

    class CountingFile:
        def __init__(self, stream):
            self.stream = stream

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.stream.close()

        def read(self, size=-1):
            reads.append(size)
            return self.stream.read(size)

        def __getattr__(self, name):
            return getattr(self.stream, name)

    monkeypatch.setattr("builtins.open", lambda *a, **k: CountingFile(real_open(*a, **k)))
    with pytest.raises(CheckpointError, match=r"damaged: 1073741711 bytes after the header, which declares 100"):
        checkpoint.load(junk)
    assert reads == []  # refused from the size alone
    with real_open(junk, "r+b") as stream:
        stream.truncate(113 + 100)  # the header line, then exactly the declared bytes
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        checkpoint.load(junk)
    assert reads == [100]
    reads.clear()
    with real_open(junk, "wb") as stream:
        stream.write(b"DTRAIN-CHECKPOINT 3 sha256=" + b"0" * 64 + b" bytes=1073741824 samples=64\nshort")
    with pytest.raises(CheckpointError, match=r"truncated: 5 of 1073741824 bytes"):
        checkpoint.load(junk)
    assert reads == []


def test_a_checkpoint_holding_other_objects_is_refused_as_unsafe_in_dtrains_words(tmp_path):
    path = tmp_path / "ckpt-64.pt"
    checkpoint.save_atomic({"samples_seen": 64, "model": {}, "payload": _NotATensor()}, path)
    with pytest.raises(CheckpointError) as caught:
        checkpoint.load(path)
    message = str(caught.value)
    assert "holds objects other than tensors" in message and "refused as unsafe" in message
    assert "_NotATensor" in message and str(path) in message
    assert "weights_only" not in message and "\x1b" not in message and "\n" not in message


class _NotATensor:
    pass


def test_load_checkpoint_is_public_and_plain_torch_reads_the_weights_after_the_header(tmp_path):
    import dtrain

    model, session = plain_session(tmp_path, 64)
    session.train()
    state = dtrain.load_checkpoint(tmp_path / "ckpt-64.pt")
    assert state["samples_seen"] == 64
    with open(tmp_path / "ckpt-64.pt", "rb") as stream:  # docs/run-directory.md's recipe without dtrain
        stream.readline()
        plain = torch.load(stream, weights_only=True)
    fresh = make_model(seed=1)
    fresh.load_state_dict(plain["model"])
    for (name, a), (_, b) in zip(fresh.state_dict().items(), model.state_dict().items()):
        assert torch.equal(a, b), name


def test_a_full_disk_while_saving_is_one_line_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    import errno

    plain_session(tmp_path, 64)[1].train()
    before = (tmp_path / "ckpt-64.pt").read_bytes()
    real_fsync = os.fsync

    def full(fd):
        if os.path.isfile(f"/proc/self/fd/{fd}"):
            raise OSError(errno.ENOSPC, "No space left on device")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(CheckpointError) as caught:
        plain_session(tmp_path, 128)[1].train()
    message = str(caught.value)
    assert message == (f"checkpoint {tmp_path / 'ckpt-128.pt'} could not be written (No space left on device); "
                       f"the previous checkpoint {tmp_path / 'ckpt-64.pt'} is kept")
    assert sorted(p.name for p in tmp_path.iterdir() if "ckpt" in p.name) == ["ckpt-64.pt"]  # no temporary
    assert (tmp_path / "ckpt-64.pt").read_bytes() == before


# -- one run directory, one job --------------------------------------------------------------------
HOLD_LOCK = ("import sys, time; from dtrain.session.rundir import RunDirectoryLock; "
             "lock = RunDirectoryLock.acquire(sys.argv[1]); lock.record_holder(); print('locked', flush=True); time.sleep(120)")


def test_a_second_job_into_a_held_run_directory_is_refused_naming_the_holder(tmp_path):
    import signal
    import subprocess
    import sys

    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(CheckpointError) as caught:
            plain_session(tmp_path, 64)[1].train()
        assert f"run directory {tmp_path} is in use by another dtrain job (pid {holder.pid} on host" in str(caught.value)
        assert not (tmp_path / "metrics.jsonl").exists() and not list(tmp_path.glob("ckpt-*"))
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    # the dead holder's lock is taken over
    assert plain_session(tmp_path, 64)[1].train().samples_seen == 64
    assert not (tmp_path / ".lock").exists()  # removed with the lock: the directory is left as it was found


def test_the_lock_is_released_when_training_ends_or_fails(tmp_path):
    plain_session(tmp_path, 64)[1].train()
    with pytest.raises(CheckpointError):
        plain_session(tmp_path, 64, lr=0.1, momentum=0.9, checkpoint_identity={"seed": 1})[1].train()
    assert plain_session(tmp_path, 128)[1].train().restored_from == tmp_path / "ckpt-64.pt"


def test_another_optimizer_type_or_data_set_is_refused_naming_it(tmp_path):
    plain_session(tmp_path, 64)[1].train()
    model = make_model()
    adam = training_session(model, nn.functional.cross_entropy, Learner(torch.optim.Adam(model.parameters())),
                            MinibatchSource(make_data()), 16, max_samples=128,
                            checkpoint_config=CheckpointConfig("ckpt.pt"), run_dir=tmp_path, tensorboard=False)
    with pytest.raises(CheckpointError, match=r"learner.optimizer was 'torch.optim.sgd.SGD' in the checkpoint's run "
                                              r"and is 'torch.optim.adam.Adam' now"):
        adam.train()
    model = make_model()
    other_data = training_session(model, nn.functional.cross_entropy, Learner(torch.optim.SGD(model.parameters(), lr=0.1)),
                                  MinibatchSource(make_data(300)), 16, max_samples=128,
                                  checkpoint_config=CheckpointConfig("ckpt.pt"), run_dir=tmp_path, tensorboard=False)
    with pytest.raises(CheckpointError, match="train_data.num_samples was 200 in the checkpoint's run and is 300 now"):
        other_data.train()


def test_the_objective_is_the_test_error_else_the_last_cv_error_else_the_last_training_error(tmp_path):
    _, session = make_session(tmp_path / "test", max_samples=100, test=True, progress_frequency=50)
    result = session.train()
    assert result.objective == result.test.error
    cv = CrossValidationConfig(MinibatchSource(make_data(50, seed=1), randomize=False, max_sweeps=1), frequency=50)
    _, session = plain_session(tmp_path / "cv", 100, cv=cv, progress_frequency=50)
    result = session.train()
    assert result.test is None and result.objective == result.last_cross_validation.error
    _, session = plain_session(tmp_path / "train", 100, progress_frequency=50)
    result = session.train()
    records = [json.loads(line) for line in (tmp_path / "train" / "metrics.jsonl").read_text().splitlines()]
    assert result.objective == [r["error"] for r in records if r["kind"] == "train"][-1]


FULL_DISK = """
import json, resource, signal, sys
from pathlib import Path
from dtrain.session.metrics import MetricsWriteError, MetricsWriter

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG, as on a full disk
run_dir = Path(sys.argv[1])
writer = MetricsWriter(run_dir, tensorboard=False)
writer.write("train", 16, loss=1.0, error=0.5)
limit = (run_dir / "metrics.jsonl").stat().st_size + 40  # room for part of the next record only
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
try:
    writer.write("train", 32, loss=0.5, error=0.25, note="x" * 200)
except MetricsWriteError as error:
    print(str(error))
"""


@pytest.mark.slow
def test_a_full_disk_while_writing_metrics_is_one_line_and_leaves_no_torn_record(tmp_path):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", FULL_DISK, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    jsonl = tmp_path / "metrics.jsonl"
    assert done.stdout.strip().splitlines() == [
        f"{jsonl} could not be written (File too large); the records before this one are kept"]
    text = jsonl.read_text()
    assert text.endswith("\n") and [json.loads(line)["samples"] for line in text.splitlines()] == [16]
