"""``ImageAugmentation``: CNTK ImageDeserializer transforms (crop, scale, colour, mean) for decoded image batches.

Every random draw is a pure function of ``(seed, global position)`` through
``uniform_from_positions``, so a sample is augmented identically whatever the number of
partitions, the minibatch it lands in, the backend (native or DALI) and after a resume.

The work is split so the DALI backend can share it:
  * ``crop_geometry``: the crop box of every sample, in pixels of the decode size;
  * ``ImageAugmentation.resample``: crop + scale to ``output_size`` (bilinear) + horizontal flip,
    one ``affine_grid`` / ``grid_sample`` for the whole minibatch (native backend only; DALI
    does this step with ``fn.resize`` / ``fn.flip`` on the same boxes);
  * ``ImageAugmentation.photometric``: colour jitter, mean, std and scale, in torch, for both.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from dtrain.data._checks import check_bool, check_int
from dtrain.data.positional_random import STREAM_CROP_X, STREAM_CROP_Y, flip_mask, uniform_from_positions
from dtrain.data.resample import mirror_where, resample_boxes

__all__ = ["CROP_TYPES", "ImageAugmentation", "crop_geometry"]

CROP_TYPES = (None, "center", "randomside", "randomarea")

# Random streams of this module. The crop position and flip streams are shared with
# ImageTransform, so a fixed-ratio random side crop equals its crop; the others are independent.
_STREAM_SIDE_RATIO, _STREAM_AREA, _STREAM_ASPECT = 11, 12, 13
_STREAM_BRIGHTNESS, _STREAM_CONTRAST, _STREAM_SATURATION = 14, 15, 16
# ITU-R BT.601 luma weights (what PIL's "L" conversion and torchvision use).
_LUMA = (0.299, 0.587, 0.114)


def _ratio_range(name: str, value: float | Sequence[float], upper: float | None) -> tuple[float, float]:
    """A ratio or a ``[min, max]`` range as a (lo, hi) pair in (0, upper]."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        low = high = float(value)
    elif isinstance(value, Sequence) and len(value) == 2 and not isinstance(value, str):
        low, high = (float(v) for v in value)
    else:
        raise TypeError(f"{name} must be a number or a [min, max] pair, got {value!r}")
    if not (0.0 < low <= high and (upper is None or high <= upper)) or not math.isfinite(high):
        bound = f", max <= {upper}" if upper is not None else ""
        raise ValueError(f"{name} must satisfy 0 < min <= max{bound}, got {value!r}")
    return low, high


def _between(seed: int, positions: np.ndarray, stream: int, low: float, high: float) -> np.ndarray:
    if low == high:
        return np.full(len(positions), low)
    return low + uniform_from_positions(seed, positions, stream) * (high - low)


def crop_geometry(
    seed: int,
    positions: np.ndarray,
    height: int,
    width: int,
    crop: str | None,
    side_ratio: tuple[float, float] = (1.0, 1.0),
    area_ratio: tuple[float, float] = (1.0, 1.0),
    aspect_ratio: tuple[float, float] = (1.0, 1.0),
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Crop boxes ``(left, top, crop_width, crop_height)`` in pixels, int64 arrays ``[n]``.

    * ``None``: the whole image.
    * ``"center"``: a centred square of side ``floor(side_ratio_min * min(H, W))``.
    * ``"randomside"``: a square of side ``floor(r * min(H, W))``, ``r`` uniform in
      ``side_ratio`` (CNTK's ``jitterType=uniRatio``), at a uniform position; with a fixed ratio
      this is exactly ``transform.crop_boxes``.
    * ``"randomarea"``: area ``a * H * W`` with ``a`` uniform in ``area_ratio`` and aspect ratio
      ``w / h`` uniform in ``aspect_ratio`` (CNTK draws both uniformly), clamped to the image,
      at a uniform position.
    """
    positions = np.asarray(positions, dtype=np.int64)
    count = len(positions)
    if crop is None:
        zeros = np.zeros(count, dtype=np.int64)
        return zeros, zeros.copy(), np.full(count, width, np.int64), np.full(count, height, np.int64)
    if crop == "center":
        side = max(1, min(math.floor(side_ratio[0] * min(height, width) + 1e-9), min(height, width)))
        left = np.full(count, (width - side) // 2, np.int64)
        top = np.full(count, (height - side) // 2, np.int64)
        return left, top, np.full(count, side, np.int64), np.full(count, side, np.int64)
    if crop == "randomside":
        ratio = _between(seed, positions, _STREAM_SIDE_RATIO, *side_ratio)
        sides = np.clip(np.floor(ratio * min(height, width) + 1e-9), 1, min(height, width)).astype(np.int64)
        crop_width = crop_height = sides
    elif crop == "randomarea":
        area = _between(seed, positions, _STREAM_AREA, *area_ratio) * height * width
        aspect = _between(seed, positions, _STREAM_ASPECT, *aspect_ratio)
        crop_width = np.clip(np.round(np.sqrt(area * aspect)), 1, width).astype(np.int64)
        crop_height = np.clip(np.round(np.sqrt(area / aspect)), 1, height).astype(np.int64)
    else:
        raise ValueError(f"crop must be one of {CROP_TYPES}, got {crop!r}")
    u_left = uniform_from_positions(seed, positions, STREAM_CROP_X)
    u_top = uniform_from_positions(seed, positions, STREAM_CROP_Y)
    left = np.floor(u_left * (width - crop_width + 1)).astype(np.int64)
    top = np.floor(u_top * (height - crop_height + 1)).astype(np.int64)
    return left, top, crop_width, crop_height


class ImageAugmentation:
    """CNTK-style image transforms on a minibatch ``[n, 3, H, W]`` (uint8 or float, pixels 0..255).

    Order (CNTK's): crop → scale to ``output_size`` (bilinear, no antialiasing) → horizontal
    flip → colour jitter (brightness, contrast, saturation; each clamped to [0, 255]) →
    ``(x - mean) / std * scale``. Output: float32 ``[n, 3, *output_size]``.

    Args:
        crop: None (whole image), ``"center"``, ``"randomside"`` or ``"randomarea"``.
        side_ratio: crop side as a fraction of ``min(H, W)``, a number or ``[min, max]`` in (0, 1].
        area_ratio: ``randomarea`` crop area as a fraction of ``H * W``, a number or ``[min, max]``.
        aspect_ratio: ``randomarea`` crop ``width / height``, a number or ``[min, max]`` (> 0).
        output_size: ``[height, width]`` in pixels after scaling; None keeps the input size.
        flip: mirror about half the images horizontally (position-keyed).
        brightness / contrast / saturation: jitter radius ``r`` in [0, 1): a factor uniform in
            ``[1 - r, 1 + r]`` per image multiplies the pixels / the deviation from the image's
            mean grey level / the deviation from each pixel's grey level.
        mean: None, ``"dataset"`` (the deserializer's ``mean_image()``, needs no scaling), or a
            per-channel ``[R, G, B]`` mean in pixel units.
        std: None or a per-channel ``[R, G, B]`` divisor in pixel units.
        scale: factor applied last (e.g. 1/256).

    Raises:
        TypeError / ValueError: an option has the wrong type or is out of range.
    """

    def __init__(
        self,
        crop: str | None = None,
        side_ratio: float | Sequence[float] = 1.0,
        area_ratio: float | Sequence[float] = 1.0,
        aspect_ratio: float | Sequence[float] = 1.0,
        output_size: Sequence[int] | None = None,
        flip: bool = False,
        brightness: float = 0.0,
        contrast: float = 0.0,
        saturation: float = 0.0,
        mean: str | Sequence[float] | None = None,
        std: Sequence[float] | None = None,
        scale: float = 1.0,
    ) -> None:
        if crop not in CROP_TYPES:
            raise ValueError(f"crop must be one of {CROP_TYPES}, got {crop!r}")
        self.crop = crop
        self.side_ratio = _ratio_range("side_ratio", side_ratio, 1.0)
        self.area_ratio = _ratio_range("area_ratio", area_ratio, 1.0)
        self.aspect_ratio = _ratio_range("aspect_ratio", aspect_ratio, None)
        if output_size is not None:
            if len(output_size) != 2:
                raise ValueError(f"output_size must be [height, width], got {list(output_size)!r}")
            output_size = (check_int("output_size[0]", output_size[0], 1), check_int("output_size[1]", output_size[1], 1))
        self.output_size = output_size
        self.flip = check_bool("flip", flip)
        self.jitter = {}
        for name, radius in (("brightness", brightness), ("contrast", contrast), ("saturation", saturation)):
            if isinstance(radius, bool) or not isinstance(radius, (int, float)) or not 0.0 <= radius < 1.0:
                raise ValueError(f"{name} must be a jitter radius in [0, 1), got {radius!r}")
            self.jitter[name] = float(radius)
        self.mean = self._channels("mean", mean) if mean != "dataset" else "dataset"
        self.std = self._channels("std", std)
        if self.std is not None and bool((self.std <= 0).any()):
            raise ValueError(f"std must be positive per channel, got {list(std)}")
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"scale must be a finite number > 0, got {scale!r}")
        self.scale = float(scale)
        self._mean_image: torch.Tensor | None = None
        self._input_size: tuple[int, int] | None = None

    @staticmethod
    def _channels(name: str, values: Sequence[float] | None) -> torch.Tensor | None:
        if values is None:
            return None
        if isinstance(values, str) or len(values) != 3:
            raise ValueError(f"{name} must be None or 3 per-channel values [R, G, B], got {values!r}")
        return torch.tensor([float(v) for v in values], dtype=torch.float32).view(1, 3, 1, 1)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(crop={self.crop!r}, output_size={self.output_size}, flip={self.flip}, "
                f"jitter={self.jitter}, mean={'dataset' if self.mean == 'dataset' else self.mean is not None}, "
                f"std={self.std is not None}, scale={self.scale})")

    def setup(self, deserializer: object) -> None:
        """Remember the input size and fetch ``mean_image()`` when ``mean="dataset"``.

        Raises:
            TypeError: ``mean="dataset"`` and the deserializer has no ``mean_image()``.
            ValueError: the mean image is not ``[3, *output_size]``.
        """
        feature_shape = tuple(getattr(deserializer, "feature_shape", ()))
        if len(feature_shape) == 3:
            self._input_size = (int(feature_shape[1]), int(feature_shape[2]))
        if self.mean != "dataset":
            return
        if not hasattr(deserializer, "mean_image"):
            raise TypeError(f"{type(self).__name__}(mean='dataset') needs a deserializer with mean_image(); "
                            f"{type(deserializer).__name__} has none; give a per-channel mean instead")
        mean_image = torch.as_tensor(deserializer.mean_image()).to(torch.float32)
        expected = (3, *(self.output_size or self._input_size or mean_image.shape[1:]))
        if tuple(mean_image.shape) != expected:
            raise ValueError(f"mean_image() has shape {tuple(mean_image.shape)} but outputs are {expected}; "
                             f"use a per-channel mean when output_size differs from the image size")
        self._mean_image = mean_image

    def geometry(self, positions: np.ndarray, seed: int, height: int, width: int):
        """``(left, top, crop_width, crop_height, flipped)`` per position (see ``crop_geometry``)."""
        boxes = crop_geometry(seed, positions, height, width, self.crop,
                              self.side_ratio, self.area_ratio, self.aspect_ratio)
        flipped = flip_mask(seed, positions) if self.flip else np.zeros(len(positions), dtype=bool)
        return (*boxes, flipped)

    def __call__(self, features: torch.Tensor, positions: np.ndarray, seed: int) -> torch.Tensor:
        """Transform decoded images ``[n, 3, H, W]`` at global ``positions`` ``[n]``.

        Raises:
            ValueError: features are not ``[n, 3, H, W]`` or ``positions`` has the wrong length.
        """
        if features.ndim != 4 or features.shape[1] != 3:
            raise ValueError(f"features must be RGB images [n, 3, H, W], got shape {tuple(features.shape)}")
        positions = np.asarray(positions)
        if positions.shape != (features.shape[0],):
            raise ValueError(f"positions must have shape ({features.shape[0]},), got {positions.shape}")
        return self.photometric(self.resample(features, positions, seed), positions, seed)

    def resample(self, features: torch.Tensor, positions: np.ndarray, seed: int) -> torch.Tensor:
        """Crop, scale to ``output_size`` and flip: float32 ``[n, 3, *output_size]``, pixels 0..255."""
        images = features.to(torch.float32)
        count, channels, height, width = images.shape
        out_height, out_width = self.output_size or (height, width)
        if count == 0:
            return images.new_zeros((0, channels, out_height, out_width))
        left, top, crop_width, crop_height, flipped = self.geometry(positions, seed, height, width)
        identity = (self.crop is None and (out_height, out_width) == (height, width))
        if identity:
            return mirror_where(images, flipped) if flipped.any() else images
        return resample_boxes(images, left, top, crop_width, crop_height, flipped, (out_height, out_width))

    def photometric(self, images: torch.Tensor, positions: np.ndarray, seed: int) -> torch.Tensor:
        """Colour jitter, then ``(x - mean) / std * scale`` on float32 ``[n, 3, h, w]`` (pixels 0..255).

        Raises:
            RuntimeError: ``mean="dataset"`` and ``setup`` was never called.
        """
        images = images.to(torch.float32)
        if images.shape[0] == 0:
            return images
        device = images.device

        def factors(stream: int, radius: float) -> torch.Tensor:
            values = _between(seed, positions, stream, 1.0 - radius, 1.0 + radius)
            return torch.from_numpy(values.astype(np.float32)).view(-1, 1, 1, 1).to(device)

        if self.jitter["contrast"] or self.jitter["saturation"]:
            luma = torch.tensor(_LUMA, dtype=torch.float32, device=device).view(1, 3, 1, 1)
        if self.jitter["brightness"]:
            images = (images * factors(_STREAM_BRIGHTNESS, self.jitter["brightness"])).clamp(0, 255)
        if self.jitter["contrast"]:
            grey = (images * luma).sum(1, keepdim=True).mean((2, 3), keepdim=True)
            images = (grey + factors(_STREAM_CONTRAST, self.jitter["contrast"]) * (images - grey)).clamp(0, 255)
        if self.jitter["saturation"]:
            grey = (images * luma).sum(1, keepdim=True)
            images = (grey + factors(_STREAM_SATURATION, self.jitter["saturation"]) * (images - grey)).clamp(0, 255)
        if self.mean == "dataset":
            if self._mean_image is None:
                raise RuntimeError(f"{type(self).__name__}(mean='dataset') was not set up; call "
                                   f"setup(deserializer) first (MinibatchSource does this)")
            images = images - self._mean_image.to(device)
        elif self.mean is not None:
            images = images - self.mean.to(device)
        if self.std is not None:
            images = images / self.std.to(device)
        if self.scale != 1.0:
            images = images * self.scale
        return images
