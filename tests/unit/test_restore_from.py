"""``restore_from``: start a run from a checkpoint file of any name, verified as any restore, and say
at start-up which file was restored or why none was."""
from __future__ import annotations

import io
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from dtrain import CheckpointConfig, LocalLearner, MinibatchSource, training_session
from dtrain.session import checkpoint
from dtrain.session.checkpoint import CheckpointError

from tests.helpers.toy_data import four_class_data


def session_into(run_dir: Path, max_samples: int, restore_from: Path | None = None, hidden: int = 8):
    """Checkpoints every 64 samples of the toy data; returns the session and its start-up text."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, hidden), nn.ReLU(), nn.Linear(hidden, 4))
    out = io.StringIO()
    session = training_session(model, nn.functional.cross_entropy,
                               LocalLearner(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)),
                               MinibatchSource(four_class_data(), randomization_seed=3), 16, max_samples=max_samples,
                               progress_frequency=0,
                               checkpoint_config=CheckpointConfig("checkpoint.pt", frequency=64, restore_from=restore_from),
                               run_dir=run_dir, tensorboard=False, stream=out)
    return session, out


def test_a_checkpoint_under_another_name_starts_a_new_run_as_a_resume_would(tmp_path):
    session_into(tmp_path / "whole", 128)[0].train()
    session_into(tmp_path / "first", 64)[0].train()
    best = tmp_path / "best.pt"
    shutil.copy(tmp_path / "first" / "checkpoint-64.pt", best)
    session, out = session_into(tmp_path / "second", 128, restore_from=best)
    assert session.train().restored_from == best
    assert f"restored {best} at 64 samples (session.checkpoint.restore_from: {tmp_path / 'second'} has no " \
           f"checkpoint of its own yet)" in out.getvalue()
    whole = checkpoint.load(tmp_path / "whole" / "checkpoint-128.pt")["model"]
    second = checkpoint.load(tmp_path / "second" / "checkpoint-128.pt")["model"]
    assert all(torch.equal(whole[name], second[name]) for name in whole)
    # the same command again continues the run from its own newest checkpoint, and says why
    session, out = session_into(tmp_path / "second", 192, restore_from=best)
    assert session.train().restored_from == tmp_path / "second" / "checkpoint-128.pt"
    assert f"session.checkpoint.restore_from={best} not used: {tmp_path / 'second'} has checkpoints of its own" \
           in out.getvalue()


def test_restore_from_is_refused_like_any_restore_naming_the_file(tmp_path):
    session_into(tmp_path / "first", 64)[0].train()
    best = tmp_path / "best.pt"
    shutil.copy(tmp_path / "first" / "checkpoint-64.pt", best)
    with pytest.raises(CheckpointError, match=f"checkpoint {best} does not fit this model: parameter 0.weight"):
        session_into(tmp_path / "other", 128, restore_from=best, hidden=16)[0].train()
    best.write_bytes(best.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match=f"checkpoint {best} could not be read .truncated"):
        session_into(tmp_path / "other", 128, restore_from=best)[0].train()
    with pytest.raises(ValueError, match=r"restore_from='best.pt': expected CheckpointConfig.restore=true \(restore_from "
                                         "names the checkpoint to restore\\)"):
        CheckpointConfig(restore=False, restore_from="best.pt")


def test_the_start_up_says_why_no_checkpoint_was_restored_and_names_a_checkpoint_it_will_not_use(tmp_path):
    session, out = session_into(tmp_path, 64)
    session.train()
    assert f"dtrain: starting fresh: no checkpoint in {tmp_path}" in out.getvalue()
    shutil.copy(tmp_path / "checkpoint-64.pt", tmp_path / "best.pt")
    session, out = session_into(tmp_path, 128)
    with pytest.warns(RuntimeWarning, match=f"{tmp_path / 'best.pt'} holds a dtrain checkpoint but is not named "
                                            f"checkpoint-<samples>.pt, so it is not restored; to start from it, name "
                                            f"it in session.checkpoint.restore_from"):
        assert session.train().restored_from == tmp_path / "checkpoint-64.pt"


def test_a_checkpoint_past_max_samples_is_refused_and_one_at_it_finishes_the_run(tmp_path):
    session_into(tmp_path, 128)[0].train()
    written = {path.name: path.read_bytes() for path in tmp_path.iterdir() if path.is_file()}
    # a shorter run would report a model trained on 128 samples as one of 64
    with pytest.raises(CheckpointError, match=f"checkpoint {tmp_path / 'checkpoint-128.pt'} has trained on 128 "
                                              r"samples, past session.max_samples=64; set session.max_samples to at "
                                              r"least 128 to continue it, or use a new run directory"):
        session_into(tmp_path, 64)[0].train()
    assert {path.name: path.read_bytes() for path in tmp_path.iterdir() if path.is_file()} == written
    restored = tmp_path / "checkpoint-64.pt"
    with pytest.raises(CheckpointError, match="has trained on 128 samples, past session.max_samples=100"):
        session_into(tmp_path, 100, restore_from=restored)[0].train()  # the run's own newest is restored first
    # the same length again: nothing left to train, the restored model is the run's
    session, out = session_into(tmp_path, 128)
    result = session.train()
    assert result.restored_from == tmp_path / "checkpoint-128.pt"
    assert session.learner.samples_seen == 128
