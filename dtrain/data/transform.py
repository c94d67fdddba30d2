"""``ImageTransform``: the CIFAR-10 style crop/flip/mean transform, random per (seed, global position).

CNTK's ConvNet_CIFAR10_DataAug (``docs/semantics.md#cifar-10-example``) trains with a random side crop
(side ratio 0.8), scales the crop back to 32x32 with bilinear interpolation and subtracts the
training mean image; tests only scale and subtract the mean. Here the random numbers for a
sample come from a counter-based hash of (seed, position), so a sample is augmented the same way
whatever the number of partitions or the minibatch it lands in, and on resume.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from dtrain.data._checks import check_bool, check_int
from dtrain.data.positional_random import STREAM_CROP_X, STREAM_CROP_Y, flip_mask, uniform_from_positions
from dtrain.data.resample import mirror_where, resample_boxes

__all__ = ["ImageTransform", "crop_boxes"]


def crop_boxes(
    seed: int, positions: np.ndarray, height: int, width: int, side_ratio: float
) -> tuple[np.ndarray, np.ndarray, int]:
    """Random square crops, CNTK ``randomside`` style: side ``floor(side_ratio * min(H, W))``.

    Returns:
        ``(left, top, side)``: int64 arrays of the crop's top-left pixel per position, uniform
        over ``[0, width - side]`` and ``[0, height - side]``, and the crop side in pixels.
    """
    height = check_int("height", height, 1)
    width = check_int("width", width, 1)
    # The epsilon keeps e.g. 0.8 * 30 = 23.999999999999996 from flooring to 23.
    side = max(1, min(math.floor(side_ratio * min(height, width) + 1e-9), min(height, width)))
    u_left = uniform_from_positions(seed, positions, STREAM_CROP_X)
    u_top = uniform_from_positions(seed, positions, STREAM_CROP_Y)
    left = np.floor(u_left * (width - side + 1)).astype(np.int64)
    top = np.floor(u_top * (height - side + 1)).astype(np.int64)
    return left, top, side


class ImageTransform:
    """Crop, flip, mean-subtract and scale a minibatch of images ``[n, C, H, W]``, vectorised.

    The output is ``(augment(features.float()) - mean) * scale`` in float32, where ``augment``:
      * with ``crop_side_ratio``: takes a square of side ``floor(ratio * min(H, W))`` pixels at a
        random position and scales it back to ``H x W`` with bilinear interpolation (one
        ``affine_grid`` + ``grid_sample`` for the whole minibatch; source coordinates are clamped
        to the image border);
      * with ``flip``: mirrors about half the images horizontally.
    Both draws are pure functions of ``(seed, position)`` (see ``crop_boxes`` and ``flip_mask``).
    With ``crop_side_ratio=None`` and ``flip=False`` this is the test-time transform.

    Args:
        crop_side_ratio: crop side as a fraction of ``min(H, W)``, in (0, 1]; None for no crop.
        flip: randomly mirror images horizontally.
        mean: None, or ``"dataset"`` to subtract the deserializer's ``mean_image()`` (the
            per-pixel training mean, fetched once in ``setup``).
        scale: factor applied after mean subtraction (e.g. 1/256 for CNTK's CIFAR-10 input).

    Raises:
        TypeError / ValueError: an argument has the wrong type or is out of range.
    """

    def __init__(
        self,
        crop_side_ratio: float | None = None,
        flip: bool = False,
        mean: str | None = None,
        scale: float = 1.0,
    ) -> None:
        if crop_side_ratio is not None:
            if isinstance(crop_side_ratio, bool) or not isinstance(crop_side_ratio, (int, float)):
                raise TypeError(f"crop_side_ratio must be a float or None, got {crop_side_ratio!r}")
            if not 0.0 < crop_side_ratio <= 1.0:
                raise ValueError(f"crop_side_ratio must be in (0, 1], got {crop_side_ratio}")
            crop_side_ratio = float(crop_side_ratio)
        if mean not in (None, "dataset"):
            raise ValueError(f"mean must be None or 'dataset', got {mean!r}")
        if isinstance(scale, bool) or not isinstance(scale, (int, float)):
            raise TypeError(f"scale must be a float, got {scale!r}")
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"scale must be a finite number > 0, got {scale}")
        self.crop_side_ratio = crop_side_ratio
        self.flip = check_bool("flip", flip)
        self.mean = mean
        self.scale = float(scale)
        self._mean_image: torch.Tensor | None = None  # set by setup() when mean == "dataset"

    def __repr__(self) -> str:
        return (
            f"ImageTransform(crop_side_ratio={self.crop_side_ratio}, flip={self.flip}, "
            f"mean={self.mean!r}, scale={self.scale})"
        )

    def setup(self, deserializer: object) -> None:
        """Fetch the deserializer's training mean image when ``mean="dataset"``.

        Raises:
            TypeError: ``mean="dataset"`` but the deserializer has no ``mean_image()``.
            ValueError: the mean image's shape is not the deserializer's ``feature_shape``.
        """
        if self.mean != "dataset":
            return
        if not hasattr(deserializer, "mean_image"):
            raise TypeError(
                f"ImageTransform(mean='dataset') needs a deserializer with mean_image(); "
                f"{type(deserializer).__name__} has none"
            )
        mean_image = torch.as_tensor(deserializer.mean_image()).to(torch.float32)
        feature_shape = tuple(getattr(deserializer, "feature_shape", mean_image.shape))
        if tuple(mean_image.shape) != feature_shape or mean_image.ndim != 3:
            raise ValueError(
                f"mean_image() must have shape feature_shape (C, H, W) = {feature_shape}, got "
                f"{tuple(mean_image.shape)}"
            )
        self._mean_image = mean_image

    def __call__(self, features: torch.Tensor, positions: np.ndarray, seed: int) -> torch.Tensor:
        """Transform images ``[n, C, H, W]`` at global timeline ``positions`` ``[n]``.

        Returns:
            float32 tensor ``[n, C, H, W]``.

        Raises:
            ValueError: features are not 4-D, ``positions`` has the wrong length, or the mean
                image's shape does not match.
            RuntimeError: ``mean="dataset"`` and ``setup`` was never called.
        """
        if features.ndim != 4:
            raise ValueError(f"features must be images [n, C, H, W], got shape {tuple(features.shape)}")
        positions = np.asarray(positions)
        num_images, _, height, width = features.shape
        if positions.shape != (num_images,):
            raise ValueError(f"positions must have shape ({num_images},), got {positions.shape}")
        images = features.to(torch.float32)
        if num_images and self.crop_side_ratio is not None:
            images = self._crop_and_flip(images, positions, seed)
        elif num_images and self.flip:
            images = mirror_where(images, flip_mask(seed, positions))
        if self.mean == "dataset":
            if self._mean_image is None:
                raise RuntimeError(
                    "ImageTransform(mean='dataset') was not set up; call setup(deserializer) "
                    "first (MinibatchSource does this)"
                )
            if tuple(self._mean_image.shape) != tuple(images.shape[1:]):
                raise ValueError(
                    f"mean image has shape {tuple(self._mean_image.shape)} but images are "
                    f"{tuple(images.shape[1:])}"
                )
            images = images - self._mean_image
        if self.scale != 1.0:
            images = images * self.scale
        return images

    def _crop_and_flip(self, images: torch.Tensor, positions: np.ndarray, seed: int) -> torch.Tensor:
        num_images, _, height, width = images.shape
        left, top, side = crop_boxes(seed, positions, height, width, self.crop_side_ratio)
        flipped = flip_mask(seed, positions) if self.flip else np.zeros(num_images, dtype=bool)
        sides = np.full(num_images, side)
        return resample_boxes(images, left, top, sides, sides, flipped, (height, width))
