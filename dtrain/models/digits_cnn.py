"""A small CNN for scikit-learn's 8x8 handwritten digits (the offline `digits` recipe)."""
from __future__ import annotations

import torch
from torch import nn

from dtrain import checks


class DigitsCNN(nn.Module):
    """Conv3x3-32, Conv3x3-64, MaxPool 2, Dense(hidden), Dense(num_classes); input [n, 1, 8, 8].

    Args:
        num_classes: output logits.
        hidden: width of the hidden dense layer.
        dropout: dropout probability before the last layer (0 disables it).

    Raises:
        ValueError: ``num_classes`` below 2, ``hidden`` below 1, ``dropout`` outside [0, 1).
    """

    def __init__(self, num_classes: int = 10, hidden: int = 128, dropout: float = 0.0):
        super().__init__()
        checks.whole_number("num_classes", num_classes, low=2, unit="classes")
        checks.whole_number("hidden", hidden, low=1, unit="units")
        checks.number_in_range("dropout", dropout, 0.0, 1.0, include_high=False)
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
