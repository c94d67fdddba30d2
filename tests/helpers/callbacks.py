"""A short training session on the four-class toy data with cross-validation, checkpoints and a test, for the
callback tests: 16-sample minibatches, a progress report every 32 samples, cross-validation and a checkpoint
every 64."""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from dtrain import CheckpointConfig, CrossValidationConfig, LocalLearner, MinibatchSource, TestConfig, training_session

from tests.helpers.toy_data import four_class_data


def toy_session(run_dir: Path, max_samples: int, callbacks, **options):
    """The session (``options`` replace its keywords: ``cv_config=None``, ``progress_frequency=0``)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    options.setdefault("cv_config", CrossValidationConfig(
        MinibatchSource(four_class_data(40, 1), randomize=False, max_sweeps=1), frequency=64, minibatch_size=20))
    options.setdefault("progress_frequency", 32)
    return training_session(
        model=model, loss=nn.functional.cross_entropy, learner=LocalLearner(optimizer),
        minibatch_source=MinibatchSource(four_class_data(200, 0), randomize=True, randomization_seed=3),
        minibatch_size=16, max_samples=max_samples,
        checkpoint_config=CheckpointConfig("ckpt.pt", frequency=64),
        test_config=TestConfig(MinibatchSource(four_class_data(40, 2), randomize=False, max_sweeps=1), 20),
        run_dir=run_dir, tensorboard=False, callbacks=callbacks, **options)
