"""``TrainingSession.from_settings``: the typed front door trains exactly as the keywords it stands for."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from dtrain import CheckpointConfig, CrossValidationConfig, LocalLearner, MinibatchSource, Schedule, TrainingSession
from dtrain import training_session
from dtrain.session.settings import CrossValidationSettings, ScheduleConfig, SessionConfig

from tests.helpers.toy_data import four_class_data


def _parts(seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 4))
    learner = LocalLearner(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    source = MinibatchSource(four_class_data(200, 0), randomize=True, randomization_seed=3)
    held_out = MinibatchSource(four_class_data(40, 1), randomize=False, max_sweeps=1)
    return model, learner, source, held_out


def test_settings_train_exactly_as_the_keywords_they_stand_for(tmp_path):
    model_a, learner, source, held_out = _parts()
    by_settings = TrainingSession.from_settings(
        model_a, nn.functional.cross_entropy, learner, source, SessionConfig(
            minibatch_size=16, max_samples=320, progress_frequency=64,
            lr_schedule=ScheduleConfig(values=[[1, 1.0], [1, 0.5]], epoch_size=160),
            checkpoint=CheckpointConfig("ckpt.pt", frequency=128), cv=CrossValidationSettings(frequency=160,
                                                                                                minibatch_size=20),
            clip_grad_norm=1.0, tensorboard=False),
        cv_source=held_out, run_dir=tmp_path / "a").train()
    model_b, learner, source, held_out = _parts()
    by_keywords = training_session(
        model_b, nn.functional.cross_entropy, learner, source, 16, max_samples=320, progress_frequency=64,
        lr_schedule=Schedule([[1, 1.0], [1, 0.5]], epoch_size=160),
        checkpoint_config=CheckpointConfig("ckpt.pt", frequency=128),
        cv_config=CrossValidationConfig(held_out, 160, 20), clip_grad_norm=1.0,
        run_dir=tmp_path / "b", tensorboard=False).train()
    assert by_settings.samples_seen == by_keywords.samples_seen == 320
    assert by_settings.last_cross_validation.loss == by_keywords.last_cross_validation.loss
    for a, b in zip(model_a.parameters(), model_b.parameters()):
        assert torch.equal(a, b)
    assert sorted(p.name for p in (tmp_path / "a").glob("ckpt-*")) == ["ckpt-256.pt", "ckpt-320.pt"]


def test_a_setting_given_twice_and_settings_that_break_the_rules_are_refused(tmp_path):
    model, learner, source, _ = _parts()
    with pytest.raises(TypeError, match=r"^max_samples: given both in settings and as an argument"):
        TrainingSession.from_settings(model, nn.functional.cross_entropy, learner, source,
                                      SessionConfig(max_samples=10), max_samples=20, run_dir=tmp_path)
    with pytest.raises(ValueError, match=r"session.minibatch_size.*session.precision"):
        TrainingSession.from_settings(model, nn.functional.cross_entropy, learner, source,
                                      SessionConfig(minibatch_size=0, precision="16x"), run_dir=tmp_path)
    with pytest.raises(TypeError, match="settings must be a dtrain SessionConfig"):
        TrainingSession.from_settings(model, nn.functional.cross_entropy, learner, source, {"minibatch_size": 8})
