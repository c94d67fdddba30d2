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


def make_data(num_samples: int = 200, seed: int = 0) -> ArrayDeserializer:
    generator = np.random.default_rng(seed)
    features = generator.normal(size=(num_samples, 6)).astype(np.float32)
    labels = (features[:, 0] + features[:, 1] > 0).astype(np.int64) + 2 * (features[:, 2] > 0.5)
    return ArrayDeserializer(features, labels, num_classes=4)


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
        model=model, loss=nn.functional.cross_entropy, learner=Learner(optimizer), mb_source=source,
        mb_size=Schedule([[1, 16], [1, 32]], epoch_size=200), max_samples=max_samples,
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
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary left behind
    assert (tmp_path / "ckpt-64.pt").read_bytes().startswith(b"DTRAIN-CHECKPOINT 2 sha256=")
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
    with pytest.raises(ValueError, match="mb_size must be a positive"):
        training_session(model, nn.functional.cross_entropy, learner, source, 0)
    with pytest.raises(ValueError, match="max_samples"):
        training_session(model, nn.functional.cross_entropy, learner, source, 8, max_samples=-5)
    with pytest.raises(TypeError, match="dtrain Learner"):
        training_session(model, nn.functional.cross_entropy, learner.optimizer, source, 8)
    with pytest.raises(ValueError, match="checkpoint frequency"):
        CheckpointConfig("x", frequency=-1)
    adam = Learner(torch.optim.Adam(model.parameters()))
    with pytest.raises(ValueError, match="momentum"):
        training_session(model, nn.functional.cross_entropy, adam, source, 8, momentum_schedule=Schedule(600))


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
                            MinibatchSource(make_data(), randomization_seed=3), mb_size=20, max_samples=100,
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
        MinibatchSource(ArrayDeserializer(features, targets), randomization_seed=1), mb_size=20, max_samples=2000,
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
    (tmp_path / "metrics.jsonl").write_text('{"kind": "train", "samples": 16, "time": 1.0, "loss": 1.0}\n{"kind": "tr')
    _simple_session(tmp_path, stream=io.StringIO(), tensorboard=False).train()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert lines[1] == '{"kind": "tr' and all(json.loads(line) for line in lines[2:])
    assert len((tmp_path / "metrics.csv").read_text().splitlines()) == 1 + len(lines) - 1  # header + parseable records
    assert (tmp_path / "report.png").is_file()
