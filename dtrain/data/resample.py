"""Batch image resampling: crop boxes scaled to one size (bilinear) and horizontal mirroring.

One ``affine_grid`` + ``grid_sample`` serves a whole minibatch of per-image boxes; shared by
:class:`~dtrain.data.transform.ImageTransform` and the native backend of
:class:`~dtrain.data.augmentation.ImageAugmentation`.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

__all__ = ["mirror_where", "resample_boxes"]


def mirror_where(images: torch.Tensor, flipped: np.ndarray) -> torch.Tensor:
    """``images`` ``[n, C, H, W]`` with the ones where ``flipped`` (bool ``[n]``) is True mirrored left to right."""
    mask = torch.from_numpy(np.asarray(flipped, dtype=bool)).view(-1, 1, 1, 1).to(images.device)
    return torch.where(mask, images.flip(-1), images)


def resample_boxes(images: torch.Tensor, left: np.ndarray, top: np.ndarray, crop_width: np.ndarray,
                   crop_height: np.ndarray, flipped: np.ndarray, output_size: tuple[int, int]) -> torch.Tensor:
    """Each image's box ``[left, left + w) x [top, top + h)`` scaled to ``output_size`` (bilinear),
    mirrored where ``flipped``: float ``[n, C, *output_size]`` from float ``images`` ``[n, C, H, W]``."""
    count, channels, height, width = images.shape
    # affine_grid maps output coordinates in [-1, 1] (pixel edges, align_corners=False) to the
    # input: the box [left, left + w) has half-width w / W and centre (2 left + w) / W - 1.
    theta = np.zeros((count, 2, 3), dtype=np.float32)
    theta[:, 0, 0] = np.where(flipped, -1.0, 1.0) * crop_width / width
    theta[:, 0, 2] = (2.0 * left + crop_width) / width - 1.0
    theta[:, 1, 1] = crop_height / height
    theta[:, 1, 2] = (2.0 * top + crop_height) / height - 1.0
    grid = F.affine_grid(torch.from_numpy(theta).to(images.device), [count, channels, *output_size],
                         align_corners=False)
    return F.grid_sample(images, grid, mode="bilinear", padding_mode="border", align_corners=False)
