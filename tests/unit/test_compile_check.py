"""``compile=True`` compares the first minibatch's loss and gradients with eager PyTorch's before any
step: a compiled model that computes other gradients is refused in one line; a faithful one trains
exactly as eager (the check changes no parameter, buffer, gradient, optimizer state or random draw)."""
from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from torch import nn

from dtrain import LocalLearner, MinibatchSource, training_session
from dtrain.data import ArrayDeserializer


def small_cnn() -> nn.Module:
    """Two convolutions (BatchNorm: buffers a forward changes) and dropout (random draws)."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1),
                      nn.ReLU(), nn.MaxPool2d(2)),
        nn.Sequential(nn.Flatten(), nn.Dropout(0.3), nn.Linear(8 * 4 * 4, 10)))


class FeaturesWithoutGradient(nn.Module):
    """A "compiled" model as torch 2.13's inductor compiles the digits CNN on some CPUs: the same
    outputs, but no gradient reaches the convolutions."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, images):
        return self.model[1](self.model[0](images).detach())


class Faithful(nn.Module):
    """A "compiled" model that computes exactly what the model does."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, images):
        return self.model(images)


def images() -> ArrayDeserializer:
    generator = np.random.default_rng(0)
    return ArrayDeserializer(generator.normal(size=(96, 1, 8, 8)).astype(np.float32),
                             generator.integers(0, 10, 96), num_classes=10)


def train(tmp_path, model, **options):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    session = training_session(model, nn.functional.cross_entropy, LocalLearner(optimizer),
                               MinibatchSource(images(), randomize=True, randomization_seed=3), 32, max_samples=96,
                               run_dir=tmp_path, tensorboard=False, stream=io.StringIO(), **options)
    return session.train(), optimizer


def test_a_compiled_model_with_other_gradients_is_refused_before_any_step_and_a_faithful_one_trains_as_eager(
        tmp_path, monkeypatch):
    model = small_cnn()
    before = {name: value.clone() for name, value in model.state_dict().items()}
    monkeypatch.setattr(torch, "compile", FeaturesWithoutGradient)
    with pytest.raises(ValueError) as refused:
        train(tmp_path / "wrong", model, compile=True)
    message = str(refused.value)
    assert "\n" not in message and message.startswith("session.compile=true: torch.compile computes the gradient "
                                                      "of 0.0.weight 100% away from eager PyTorch")
    assert "tolerance 0.01 in float32" in message and message.endswith("(session.compile=false)")
    assert all(torch.equal(value, before[name]) for name, value in model.state_dict().items())
    assert all(parameter.grad is None for parameter in model.parameters())

    monkeypatch.setattr(torch, "compile", Faithful)
    compiled, eager = small_cnn(), small_cnn()
    torch.manual_seed(7)
    _, compiled_optimizer = train(tmp_path / "faithful", compiled, compile=True)
    torch.manual_seed(7)
    _, eager_optimizer = train(tmp_path / "eager", eager)
    for (name, value), reference in zip(compiled.state_dict().items(), eager.state_dict().values()):
        assert torch.equal(value, reference), name  # parameters and BatchNorm statistics, dropout's draws
    for state, reference in zip(compiled_optimizer.state.values(), eager_optimizer.state.values()):
        assert torch.equal(state["momentum_buffer"], reference["momentum_buffer"])
