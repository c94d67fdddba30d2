"""A small CNN for scikit-learn's 8x8 handwritten digits (the offline `digits` recipe)."""
from __future__ import annotations

import torch
from torch import nn

from dtrain.models.settings import DIGITS_CNN
from dtrain.rules import check_settings


class DigitsCNN(nn.Module):
    """Conv3x3-32, Conv3x3-64, MaxPool 2, Dense(hidden), Dense(num_classes); input [n, 1, 8, 8].

    With ``batch_norm`` each convolution is Conv-BatchNorm-ReLU (the convolutions lose their bias, which
    BatchNorm's shift replaces), and the hidden dense layer Dense-BatchNorm1d-ReLU: a small model whose
    accuracy depends on how BatchNorm statistics are computed (``docs/batchnorm.md``).

    Args:
        num_classes: output logits.
        hidden: width of the hidden dense layer.
        dropout: dropout probability before the last layer (0 disables it).
        batch_norm: BatchNorm after every convolution and the hidden dense layer (default: none).

    Raises:
        ValueError: ``num_classes`` below 2, ``hidden`` below 1, ``dropout`` outside [0, 1).
    """

    def __init__(self, num_classes: int = 10, hidden: int = 128, dropout: float = 0.0, batch_norm: bool = False):
        super().__init__()
        check_settings(DIGITS_CNN, num_classes=num_classes, hidden=hidden, dropout=dropout, batch_norm=batch_norm)
        if not batch_norm:  # the default model, layer for layer as before (its checkpoints keep loading)
            self.features = nn.Sequential(
                nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(),
                nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
                nn.MaxPool2d(2),
            )
            hidden_layers = [nn.Linear(64 * 4 * 4, hidden), nn.ReLU()]
        else:
            self.features = nn.Sequential(
                nn.Conv2d(1, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU(),
                nn.Conv2d(32, 64, 3, padding=1, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
                nn.MaxPool2d(2),
            )
            hidden_layers = [nn.Linear(64 * 4 * 4, hidden, bias=False), nn.BatchNorm1d(hidden), nn.ReLU()]
        self.classifier = nn.Sequential(
            nn.Flatten(),
            *hidden_layers,
            nn.Dropout(dropout),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(images))
