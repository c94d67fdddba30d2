"""A 1-D convolutional classification task made on the spot, for learners with Adam inner steps.

Each example is 128 steps of Gaussian noise with one Hann-windowed sine burst of 32 steps at a random
place and amplitude; the burst's frequency (one of 4) is the class. The noise makes some examples
ambiguous and the model overfits 4,000 of them, so data-parallel Adam ends near 90% test accuracy and
a learner that steps too far measurably below.
``benchmarks/conf`` names the model and the arrays (``--config-dir benchmarks/conf +recipe=conv1d_adam``).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

LENGTH, BURST, CLASSES = 128, 32, 4
FREQUENCIES = (0.05, 0.12, 0.20, 0.30)  # cycles per step, one per class
NOISE = 0.5


def make_examples(count: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``count`` signals ``[count, 1, LENGTH]`` (float32) and their classes (int64), from ``seed``."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, CLASSES, count)
    signals = rng.normal(0.0, NOISE, (count, LENGTH)).astype(np.float32)
    steps = np.arange(BURST)
    window = np.hanning(BURST)
    for row, label in enumerate(labels):
        start = rng.integers(0, LENGTH - BURST)
        phase = rng.uniform(0, 2 * np.pi)
        amplitude = rng.uniform(0.6, 1.4)
        signals[row, start:start + BURST] += amplitude * window * np.sin(2 * np.pi * FREQUENCIES[label] * steps + phase)
    return signals[:, None, :], labels.astype(np.int64)


def write_arrays(root: Path, train: int = 4000, test: int = 2000) -> None:
    """``root/train.npz`` and ``root/test.npz`` (``features``, ``labels``), for ``dtrain.data.NpzStreams``."""
    root.mkdir(parents=True, exist_ok=True)
    for name, count, seed in (("train", train, 1), ("test", test, 2)):
        features, labels = make_examples(count, seed)
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
