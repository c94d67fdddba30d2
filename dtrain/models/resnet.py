"""ResNet-50 (He et al. 2016, "Deep Residual Learning"), bottleneck blocks, without torchvision.

The standard ImageNet layout: 7x7/2 stem + 3x3/2 max pool, stages of [3, 4, 6, 3] bottlenecks
(1x1 reduce, 3x3, 1x1 expand x4) with the stride on the 3x3 (the "v1.5" variant torchvision and
MLPerf use), global average pool and a linear classifier. ``width`` scales every channel count
(64 = the paper's network), so tests can run a narrow copy in seconds.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from dtrain.models.settings import RESNET
from dtrain.rules import check_settings

__all__ = ["Bottleneck", "ResNet", "ResNet50"]


class Bottleneck(nn.Module):
    """1x1 → 3x3 (stride) → 1x1 (x4 channels), batch norm after each, identity or projected shortcut."""

    expansion = 4

    def __init__(self, in_channels: int, channels: int, stride: int = 1) -> None:
        super().__init__()
        out_channels = channels * self.expansion
        self.conv1 = nn.Conv2d(in_channels, channels, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.conv3 = nn.Conv2d(channels, out_channels, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU(inplace=True)
        self.shortcut = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                                          nn.BatchNorm2d(out_channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    """A bottleneck ResNet on images ``[n, 3, H, W]`` (any H, W >= 32), returning logits ``[n, num_classes]``.

    Args:
        layers: bottlenecks per stage, e.g. ``[3, 4, 6, 3]`` for ResNet-50.
        num_classes: classifier outputs.
        width: channels of the stem and first stage (64 in the paper; later stages double it).
        zero_init_residual: start each block's last BN gamma at 0, so every block begins as the
            identity (Goyal et al. 2017, for large-minibatch training).

    Raises:
        ValueError: an empty or non-positive ``layers``, ``num_classes`` below 2 or ``width`` below 1.
    """

    def __init__(self, layers: Sequence[int], num_classes: int = 1000, width: int = 64,
                 zero_init_residual: bool = False) -> None:
        super().__init__()
        if not layers or any(int(count) < 1 for count in layers):
            raise ValueError(f"layers must be positive block counts per stage, got {list(layers)!r}")
        check_settings(RESNET, num_classes=num_classes, width=width)
        self.stem = nn.Sequential(nn.Conv2d(3, width, 7, stride=2, padding=3, bias=False), nn.BatchNorm2d(width),
                                  nn.ReLU(inplace=True), nn.MaxPool2d(3, stride=2, padding=1))
        blocks, in_channels = [], width
        for stage, count in enumerate(layers):
            channels = width * 2**stage
            for block in range(int(count)):
                blocks.append(Bottleneck(in_channels, channels, stride=2 if stage > 0 and block == 0 else 1))
                in_channels = channels * Bottleneck.expansion
        self.blocks = nn.Sequential(*blocks)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(in_channels, num_classes)
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(module, nn.BatchNorm2d):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)
        if zero_init_residual:
            for module in self.modules():
                if isinstance(module, Bottleneck):
                    nn.init.zeros_(module.bn3.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(self.blocks(self.stem(x))), 1))


class ResNet50(ResNet):
    """ResNet-50: stages [3, 4, 6, 3]; 25.6 M parameters at ``width=64``, ``num_classes=1000``."""

    def __init__(self, num_classes: int = 1000, width: int = 64, zero_init_residual: bool = False) -> None:
        super().__init__([3, 4, 6, 3], num_classes=num_classes, width=width, zero_init_residual=zero_init_residual)
