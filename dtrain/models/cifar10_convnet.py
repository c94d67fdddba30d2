"""The ConvNet of CNTK's ConvNet_CIFAR10_DataAug example (``docs/semantics.md#cifar-10-example``), in PyTorch."""
from __future__ import annotations

import torch
from torch import nn

from dtrain.models.settings import CIFAR10_CONVNET
from dtrain.rules import check_settings


class ConvNetCIFAR10(nn.Module):
    """[Conv3x3-64, Conv3x3-64, MaxPool 3x3/2] x 2, Dense256+Dropout, Dense128+Dropout, Dense10.

    Input: mean-subtracted images [n, 3, 32, 32] on the 0..255 scale; the network scales them
    by 1/256 first, as the CNTK example does. Weights use Glorot-uniform initialisation and zero
    biases (CNTK's defaults).

    Args:
        num_classes: output logits.
        dropout: dropout probability after each hidden dense layer (0.5 in the example).

    Raises:
        ValueError: ``num_classes`` below 2 or ``dropout`` outside [0, 1).
    """

    def __init__(self, num_classes: int = 10, dropout: float = 0.5):
        super().__init__()
        check_settings(CIFAR10_CONVNET, num_classes=num_classes, dropout=dropout)

        def conv(cin: int, cout: int) -> list[nn.Module]:
            return [nn.Conv2d(cin, cout, 3, padding=1), nn.ReLU()]

        self.features = nn.Sequential(
            *conv(3, 64), *conv(64, 64), nn.MaxPool2d(3, stride=2),   # 32 -> 15
            *conv(64, 64), *conv(64, 64), nn.MaxPool2d(3, stride=2),  # 15 -> 7
        )
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(64 * 7 * 7, 256), nn.ReLU(), nn.Dropout(dropout),
            nn.Linear(256, 128), nn.ReLU(), nn.Dropout(dropout),
            nn.Linear(128, num_classes),
        )
        for module in self.modules():
            if isinstance(module, (nn.Conv2d, nn.Linear)):
                nn.init.xavier_uniform_(module.weight)
                nn.init.zeros_(module.bias)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(images * (1.0 / 256.0)))
