"""A small CNN for scikit-learn's 8x8 handwritten digits (the offline `digits` recipe)."""
from __future__ import annotations

import torch
from torch import nn


class DigitsCNN(nn.Module):
    """Conv3x3-32, Conv3x3-64, MaxPool 2, Dense(hidden), Dense(num_classes); input [n, 1, 8, 8].

    Args:
        num_classes: output logits.
        hidden: width of the hidden dense layer.
        dropout: dropout probability before the last layer (0 disables it).
    """

    def __init__(self, num_classes: int = 10, hidden: int = 128, dropout: float = 0.0):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(),
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(64 * 4 * 4, hidden), nn.ReLU(),
            nn.Dropout(dropout),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(images))
