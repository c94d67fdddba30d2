"""``MapFileImages``: what every map-file image deserializer holds (native and DALI backends).

The parsed CNTK map file, the decode size every image is resized to, the number of classes and
the feature shape. Both :mod:`dtrain.data.images` (PIL) and :mod:`dtrain.data.dali` build on it,
so neither imports the other for it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np
from PIL import Image, UnidentifiedImageError

from dtrain.data._checks import check_int
from dtrain.data.errors import DataError
from dtrain.data.mapfile import MapFile, read_map_file

__all__ = ["MapFileImages", "image_size_of"]


def _check_size(image_size: Sequence[int] | None) -> tuple[int, int] | None:
    if image_size is None:
        return None
    if isinstance(image_size, (str, bytes)) or len(image_size) != 2:
        raise ValueError(f"image_size must be [height, width] or None, got {image_size!r}")
    return check_int("image_size[0]", image_size[0], 1), check_int("image_size[1]", image_size[1], 1)


def image_size_of(map_file: MapFile, index: int = 0) -> tuple[int, int]:
    """``(height, width)`` of image ``index`` from its header (no full decode).

    Raises:
        DataError: the file is missing or not an image; the message names it and its map-file line.
    """
    path = map_file.image_paths[index]
    try:
        with Image.open(path) as image:
            width, height = image.size
    except (OSError, UnidentifiedImageError) as error:
        raise DataError(f"{map_file.where(index)}: cannot read image {path} ({error}); fix the map file") from error
    return height, width


def _num_classes(map_file: MapFile, num_classes: int | None) -> int:
    largest = int(map_file.labels.max())
    if num_classes is None:
        return largest + 1
    num_classes = check_int("num_classes", num_classes, 1)
    if largest >= num_classes:
        index = int(np.argmax(map_file.labels >= num_classes))
        raise DataError(f"{map_file.where(index)}: label {largest} >= num_classes ({num_classes}); "
                        f"raise num_classes or fix the label")
    return num_classes


class MapFileImages:
    """What every map-file image deserializer holds: the parsed map file, the decode size
    ``image_size`` (given, or the first image's), ``num_classes`` and ``feature_shape`` ``(3, H, W)``."""

    def __init__(self, map_file: str | os.PathLike, image_size: Sequence[int] | None = None,
                 num_classes: int | None = None, check_files: bool = True) -> None:
        self.map = read_map_file(map_file, check_files=check_files)
        self.image_size = _check_size(image_size) or image_size_of(self.map)
        self.num_classes = _num_classes(self.map, num_classes)
        self.feature_shape = (3, *self.image_size)

    @property
    def num_samples(self) -> int:
        """Images listed in the map file."""
        return self.map.num_samples

    def sequence_keys(self) -> np.ndarray:
        """int64 ``[num_samples]``: each image's key, CNTK's: the map file's ``seqId`` column where a line has
        one, else the image's 0-based index in the file (what a ``CompositeDeserializer`` joins by)."""
        keys = self.map.sequence_keys
        return np.arange(self.num_samples, dtype=np.int64) if keys is None else keys
