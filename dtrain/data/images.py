"""Native image deserializer: a CNTK map file decoded with PIL into fixed-size uint8 batches.

CNTK's ImageDeserializer decodes each image at its own size and crops/scales it on its own;
minibatches here are tensors, so every image is decoded and resized (bilinear, PIL) to one
``image_size`` first — pick it at least as large as the crops the transform takes (e.g. 256x256
for 224x224 ImageNet crops). Crop geometry is defined in pixels of that decode size, for both
backends. ``image_deserializer`` / ``image_transform`` choose the native or the DALI backend.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from dtrain.data._checks import check_int
from dtrain.data.augmentation import ImageAugmentation
from dtrain.data.errors import DataError
from dtrain.data.map_file_images import MapFileImages, image_size_of

__all__ = ["BACKENDS", "ImageFolderDeserializer", "image_deserializer", "image_transform", "image_size_of"]

BACKENDS = ("native", "dali")


class ImageFolderDeserializer(MapFileImages):
    """Images listed in a CNTK map file, decoded with PIL to uint8 ``[n, 3, H, W]`` (RGB).

    Args:
        map_file: ``path<TAB>label`` map file (see ``dtrain.data.mapfile``).
        image_size: ``[height, width]`` every image is resized to (bilinear) so batches stack;
            None: the first image's size, and every image must have it.
        num_classes: number of classes; None: largest label + 1.
        check_files: check at construction that every listed file exists.
        num_threads: decoding threads per ``get`` (PIL releases the GIL while decoding);
            None: ``min(8, os.cpu_count())``.

    Raises:
        DataError: a bad map file, a missing file, a label >= ``num_classes``; when reading, an
            undecodable image or (``image_size=None``) an image of another size.
        TypeError / ValueError: an argument has the wrong type or value.
    """

    #: decoding is slow enough that a MinibatchSource reads the next minibatch in the background
    benefits_from_read_ahead = True

    def __init__(
        self,
        map_file: str | os.PathLike,
        image_size: Sequence[int] | None = None,
        num_classes: int | None = None,
        check_files: bool = True,
        num_threads: int | None = None,
    ) -> None:
        super().__init__(map_file, image_size, num_classes, check_files)
        self._resize = image_size is not None
        self.num_threads = check_int("num_threads", num_threads, 1) if num_threads is not None else min(8, os.cpu_count() or 1)
        self._pool: ThreadPoolExecutor | None = None
        self._mean_image: torch.Tensor | None = None

    def _decode(self, index: int, out: np.ndarray) -> None:
        path = self.map.image_paths[index]
        try:
            with Image.open(path) as image:
                image = image.convert("RGB")
                height, width = self.image_size
                if image.size != (width, height):
                    if not self._resize:
                        raise DataError(f"{self.map.where(index)}: image {path} is {image.size[1]}x{image.size[0]} "
                                        f"but the first image is {height}x{width}; pass image_size=[H, W]")
                    image = image.resize((width, height), Image.BILINEAR)
                out[...] = np.asarray(image).transpose(2, 0, 1)
        except FileNotFoundError:
            raise DataError(f"{self.map.where(index)}: image file {path} not found; fix the map file") from None
        except (OSError, UnidentifiedImageError) as error:
            raise DataError(f"{self.map.where(index)}: cannot decode image {path} ({error})") from error

    def get(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """uint8 images ``[len(indices), 3, H, W]`` and int64 labels of samples ``indices``."""
        indices = np.asarray(indices, dtype=np.int64)
        images = np.empty((len(indices), *self.feature_shape), dtype=np.uint8)
        if self.num_threads > 1 and len(indices) > 1:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.num_threads, thread_name_prefix="dtrain-decode")
            list(self._pool.map(self._decode, indices.tolist(), images))
        else:
            for index, out in zip(indices.tolist(), images):
                self._decode(index, out)
        return torch.from_numpy(images), torch.from_numpy(self.map.labels[indices])

    def mean_image(self) -> torch.Tensor:
        """float32 per-pixel mean ``[3, H, W]`` over all images (pixels 0..255); decodes every image once."""
        if self._mean_image is None:
            total = np.zeros(self.feature_shape, dtype=np.float64)
            for start in range(0, self.num_samples, 256):
                batch, _ = self.get(np.arange(start, min(start + 256, self.num_samples)))
                total += batch.numpy().sum(axis=0, dtype=np.float64)
            self._mean_image = torch.from_numpy((total / self.num_samples).astype(np.float32))
        return self._mean_image.clone()

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_pool"] = None  # thread pools do not pickle (DataLoader workers rebuild their own)
        return state


def _check_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}; set source.backend=native or dali")
    return backend


def image_deserializer(backend: str = "native", **options):
    """``ImageFolderDeserializer(**options)`` (native) or ``DaliImageDeserializer(**options)`` (dali).

    Raises:
        ValueError: an unknown backend.
    """
    if _check_backend(backend) == "dali":
        from dtrain.data.dali import DaliImageDeserializer

        return DaliImageDeserializer(**options)
    return ImageFolderDeserializer(**options)


def image_transform(backend: str = "native", dali_options: dict | None = None, **options):
    """``ImageAugmentation(**options)`` (native) or ``DaliImageAugmentation(**options, **dali_options)``.

    The two give the same crops, flips and labels for the same seed (see ``dtrain.data.dali``).

    Raises:
        ValueError: an unknown backend.
    """
    if _check_backend(backend) == "dali":
        from dtrain.data.dali import DaliImageAugmentation

        return DaliImageAugmentation(**options, **dict(dali_options or {}))
    return ImageAugmentation(**options)
