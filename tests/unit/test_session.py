"""training_session in one process: CNTK's action timing, bit-exact restore, safe checkpoints."""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from dtrain import CheckpointConfig, CrossValidationConfig, Learner, MinibatchSource, Schedule, TestConfig, training_session
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
    with pytest.raises(ValueError, match="minibatch_size must be a positive"):
        training_session(model, nn.functional.cross_entropy, learner, source, 0)
    with pytest.raises(ValueError, match="max_samples"):
        training_session(model, nn.functional.cross_entropy, learner, source, 8, max_samples=-5)
    with pytest.raises(TypeError, match="dtrain Learner"):
        training_session(model, nn.functional.cross_entropy, learner.optimizer, source, 8)
    with pytest.raises(ValueError, match="checkpoint frequency"):
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
