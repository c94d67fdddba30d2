"""1-D convolutional classification tasks made on the spot, for learners with Adam inner steps.

Each example is Gaussian noise with one Hann-windowed sine burst at a random place and amplitude; the
burst's frequency is the class. ``conv1d_adam``: 128 steps, bursts of 32, 4 classes, noise 0.5: the noise
makes some examples ambiguous and the model overfits 4,000 of them, so data-parallel Adam ends near 90%
test accuracy and a learner that steps too far measurably below. ``conv1d10_adam``: 40 steps, bursts of
24, 10 classes, noise 0.35 (5,802 parameters): a short signal whose final layer sees 32 features of very
different sizes, where a 1-bit exchange with Adam's variance held and nothing else collapsed to chance.
A GRU reads the same signals as a recurrent model (``model=gru1d``), and a small transformer encoder as an
attention model (``model=attention1d``).
``benchmarks/conf`` names the models and the arrays (``--config-dir benchmarks/conf +recipe=conv1d_adam``).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

LENGTH, BURST, CLASSES = 128, 32, 4
FREQUENCIES = (0.05, 0.12, 0.20, 0.30)  # cycles per step, one per class
NOISE = 0.5

#: task name (its recipe in benchmarks/conf) -> (signal length, burst length, frequencies: one per class, noise)
TASKS = {
    "conv1d_adam": (LENGTH, BURST, FREQUENCIES, NOISE),
    "conv1d10_adam": (40, 24, tuple(np.linspace(0.05, 0.45, 10)), 0.35),
}


def make_examples(count: int, seed: int, task: str = "conv1d_adam") -> tuple[np.ndarray, np.ndarray]:
    """``count`` signals ``[count, 1, length]`` (float32) and their classes (int64) of ``task``, from ``seed``."""
    length, burst, frequencies, noise = TASKS[task]
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, len(frequencies), count)
    signals = rng.normal(0.0, noise, (count, length)).astype(np.float32)
    steps = np.arange(burst)
    window = np.hanning(burst)
    for row, label in enumerate(labels):
        start = rng.integers(0, length - burst)
        phase = rng.uniform(0, 2 * np.pi)
        amplitude = rng.uniform(0.6, 1.4)
        signals[row, start:start + burst] += amplitude * window * np.sin(2 * np.pi * frequencies[label] * steps + phase)
    return signals[:, None, :], labels.astype(np.int64)


def write_arrays(root: Path, train: int = 4000, test: int = 2000, task: str = "conv1d_adam") -> None:
    """``root/train.npz`` and ``root/test.npz`` (``features``, ``labels``) of ``task``, for ``dtrain.data.NpzStreams``."""
    root.mkdir(parents=True, exist_ok=True)
    for name, count, seed in (("train", train, 1), ("test", test, 2)):
        features, labels = make_examples(count, seed, task)
        np.savez(root / f"{name}.npz", features=features, labels=labels)


class Conv1dClassifier(nn.Module):
    """Two convolutions, a global max-pool and a linear read-out: ``[n, 1, LENGTH]`` -> ``[n, CLASSES]``."""

    def __init__(self, channels: int = 32, classes: int = CLASSES):
        super().__init__()
        self.layers = nn.Sequential(
            nn.Conv1d(1, channels, 9, padding=4), nn.ReLU(), nn.MaxPool1d(2),
            nn.Conv1d(channels, channels, 5, padding=2), nn.ReLU(), nn.AdaptiveMaxPool1d(1), nn.Flatten(),
            nn.Linear(channels, classes))

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.layers(features)


class GRUClassifier(nn.Module):
    """A recurrent reader of the same signals, as speech models read audio: a strided convolution makes a
    step of every 4 samples, a GRU runs over those steps and a linear layer reads out its last state,
    ``[n, 1, LENGTH]`` -> ``[n, CLASSES]`` (``model=gru1d``)."""

    def __init__(self, channels: int = 16, hidden: int = 32, classes: int = CLASSES):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv1d(1, channels, 9, stride=4, padding=4), nn.ReLU())
        self.gru = nn.GRU(channels, hidden, batch_first=True)
        self.readout = nn.Linear(hidden, classes)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        _, last = self.gru(self.stem(features).transpose(1, 2))
        return self.readout(last[-1])


class AttentionClassifier(nn.Module):
    """An attention reader of the same signals: a strided convolution makes a token of every 4 samples, a
    learned position embedding is added, a pre-norm transformer encoder (self-attention, then a feed-forward
    layer) runs over the tokens and a linear layer reads out their mean, ``[n, 1, length]`` -> ``[n, CLASSES]``
    (``model=attention1d``)."""

    def __init__(self, width: int = 32, heads: int = 4, layers: int = 2, max_tokens: int = 64,
                 classes: int = CLASSES):
        super().__init__()
        self.stem = nn.Conv1d(1, width, 9, stride=4, padding=4)
        self.position = nn.Parameter(torch.zeros(max_tokens, width))
        nn.init.normal_(self.position, std=0.02)
        layer = nn.TransformerEncoderLayer(width, heads, dim_feedforward=2 * width, dropout=0.0, batch_first=True,
                                           norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.readout = nn.Linear(width, classes)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        tokens = self.stem(features).transpose(1, 2)
        tokens = self.encoder(tokens + self.position[: tokens.shape[1]])
        return self.readout(self.norm(tokens).mean(dim=1))
