"""scikit-learn's offline ``digits`` data set (1,797 8x8 handwritten digits) as a deserializer."""

from __future__ import annotations

import functools

import numpy as np
import torch

from dtrain.data._checks import check_int

__all__ = ["Digits"]

_NUM_CLASSES = 10
_IMAGE_SHAPE = (1, 8, 8)
_MAX_PIXEL = 16.0  # load_digits() pixel values are counts 0..16


@functools.lru_cache(maxsize=1)
def _load_all() -> tuple[np.ndarray, np.ndarray]:
    # Imported here: scikit-learn is only needed when this data set is used.
    from sklearn.datasets import load_digits

    bunch = load_digits()
    images = (bunch.images / _MAX_PIXEL).astype(np.float32).reshape(-1, *_IMAGE_SHAPE)
    labels = bunch.target.astype(np.int64)
    images.setflags(write=False)  # shared through the cache
    labels.setflags(write=False)
    return images, labels


@functools.lru_cache(maxsize=4)
def _split_indices(test_size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    from sklearn.model_selection import train_test_split

    _, labels = _load_all()
    train, test = train_test_split(
        np.arange(len(labels)), test_size=test_size, random_state=seed, stratify=labels
    )
    train, test = np.sort(train), np.sort(test)
    train.setflags(write=False)  # shared through the cache
    test.setflags(write=False)
    return train, test


class Digits:
    """scikit-learn ``load_digits()`` split into train/test: float32 images ``[n, 1, 8, 8]`` in [0, 1].

    The split is stratified by class and a pure function of ``(test_size, seed)``; the two
    splits are disjoint and together hold all 1,797 images.

    Args:
        split: ``"train"`` or ``"test"``.
        test_size: number of test images, 10..1787 (each split needs every class).
        seed: seed of the split.

    Raises:
        TypeError / ValueError: an argument has the wrong type or is out of range.
    """

    feature_shape = _IMAGE_SHAPE
    num_classes = _NUM_CLASSES

    def __init__(self, split: str = "train", test_size: int = 297, seed: int = 0) -> None:
        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        images, labels = _load_all()
        test_size = check_int("test_size", test_size, _NUM_CLASSES)
        if test_size > len(labels) - _NUM_CLASSES:
            raise ValueError(
                f"test_size must be <= {len(labels) - _NUM_CLASSES} so the training split keeps "
                f"every class, got {test_size}"
            )
        self.split = split
        self.test_size = test_size
        self.seed = check_int("seed", seed, 0)
        train_indices, test_indices = _split_indices(test_size, self.seed)
        self.indices = train_indices if split == "train" else test_indices  # into load_digits()
        self._images = torch.from_numpy(images[self.indices])
        self._labels = torch.from_numpy(labels[self.indices])
        self._train_indices = train_indices

    @property
    def num_samples(self) -> int:
        """Images in this split."""
        return int(self._labels.shape[0])

    def get(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 images ``[len(indices), 1, 8, 8]`` in [0, 1] and int64 labels of ``indices``."""
        index_tensor = torch.from_numpy(np.asarray(indices, dtype=np.int64))
        return self._images[index_tensor], self._labels[index_tensor]

    def mean_image(self) -> torch.Tensor:
        """float32 per-pixel mean ``[1, 8, 8]`` over the TRAINING split (same for both splits)."""
        images, _ = _load_all()
        return torch.from_numpy(images[self._train_indices].mean(axis=0, dtype=np.float64).astype(np.float32))
