"""The offline ``digits`` data set (1,797 8x8 handwritten digits), shipped in ``digits.npz``.

The file holds the UCI "Optical Recognition of Handwritten Digits" test set as scikit-learn's
``load_digits()`` serves it (pixel counts 0..16, uint8), its labels, and the default test split;
``digits.README.md`` beside it gives the source and the licence (CC BY 4.0).
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import torch

from dtrain.data._checks import check_int

__all__ = ["Digits"]

_NUM_CLASSES = 10
_IMAGE_SHAPE = (1, 8, 8)
_MAX_PIXEL = 16.0  # pixel values are counts of set pixels in a 4x4 block: 0..16
_DATA_FILE = Path(__file__).with_name("digits.npz")
# The split stored in the file: scikit-learn's train_test_split(test_size=297, random_state=0,
# stratify=labels), the one dtrain has always used, kept so results stay comparable.
_STORED_SPLIT = (297, 0)


@functools.lru_cache(maxsize=1)
def _load_file() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """float32 images ``[1797, 1, 8, 8]`` in [0, 1], int64 labels, and the stored test indices."""
    with np.load(_DATA_FILE) as data:
        images = (data["images"].astype(np.float32) / np.float32(_MAX_PIXEL)).reshape(-1, *_IMAGE_SHAPE)
        labels = data["labels"].astype(np.int64)
        test_indices = np.sort(data["test_indices"].astype(np.int64))
    for array in (images, labels, test_indices):
        array.setflags(write=False)  # shared through the cache
    return images, labels, test_indices


def _stratified_test_indices(labels: np.ndarray, test_size: int, seed: int) -> np.ndarray:
    """``test_size`` indices drawn per class in proportion to its size (largest remainders get
    the rounding), at least one of each class in each split; a pure function of ``seed``."""
    classes, counts = np.unique(labels, return_counts=True)
    exact = counts * test_size / len(labels)
    per_class = np.clip(np.floor(exact).astype(np.int64), 1, counts - 1)
    order = np.argsort(-(exact - np.floor(exact)), kind="stable")
    while (short := test_size - int(per_class.sum())) != 0:  # hand out (or take back) the rounding
        step = 1 if short > 0 else -1
        for k in order if step > 0 else order[::-1]:
            if 1 <= per_class[k] + step <= counts[k] - 1:
                per_class[k] += step
                short -= step
                if short == 0:
                    break
    rng = np.random.default_rng(seed)
    chosen = [rng.permutation(np.flatnonzero(labels == c))[:n] for c, n in zip(classes, per_class)]
    return np.sort(np.concatenate(chosen))


@functools.lru_cache(maxsize=4)
def _split_indices(test_size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    _, labels, stored_test = _load_file()
    test = stored_test if (test_size, seed) == _STORED_SPLIT else _stratified_test_indices(labels, test_size, seed)
    train = np.setdiff1d(np.arange(len(labels)), test)  # sorted
    train.setflags(write=False)  # shared through the cache
    test.setflags(write=False)
    return train, test


class Digits:
    """The 8x8 digits split into train/test: float32 images ``[n, 1, 8, 8]`` in [0, 1].

    The split is stratified by class and a pure function of ``(test_size, seed)``; the two
    splits are disjoint and together hold all 1,797 images. The default ``(297, 0)`` is the split
    stored in the package (scikit-learn's ``train_test_split`` with ``random_state=0``); any
    other size or seed draws each class's share with numpy's ``default_rng(seed)``.

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
        images, labels, _ = _load_file()
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
        self.indices = train_indices if split == "train" else test_indices  # into the 1,797 images
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
        images, _, _ = _load_file()
        return torch.from_numpy(images[self._train_indices].mean(axis=0, dtype=np.float64).astype(np.float32))
