"""Deserializer over in-memory arrays (numpy or torch)."""

from __future__ import annotations

import numpy as np
import torch

from dtrain.data._checks import check_int, finite_once

__all__ = ["ArrayDeserializer"]


def _as_tensor(name: str, array: object) -> torch.Tensor:
    if isinstance(array, torch.Tensor):
        return array.detach().cpu()
    if isinstance(array, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(array))  # shares memory, no copy
    raise TypeError(f"{name} must be a numpy array or torch tensor, got {type(array).__name__}")


class ArrayDeserializer:
    """Serve samples from in-memory arrays: ``features[i]`` with label ``labels[i]``.

    Args:
        features: numpy array or tensor ``[num_samples, *feature_shape]`` (any dtype; the
            transform or the source converts to float32).
        labels: integer array or tensor ``[num_samples]`` of class indices (served as int64), or a
            floating-point one ``[num_samples, ...]`` of regression targets (served in its dtype).
        num_classes: number of classes; default ``max(labels) + 1``; ``None`` for float targets.
        training_mean: per-sample-shaped mean ``mean_image()`` returns, e.g. the training set's
            mean when these arrays are a test split; default the mean of ``features``.

    Raises:
        TypeError: an argument has the wrong type (e.g. bool labels, or ``num_classes`` with float targets).
        ValueError: empty arrays, different lengths, labels outside ``[0, num_classes)``, or a
            ``training_mean`` whose shape is not ``feature_shape``.
    """

    def __init__(
        self,
        features: np.ndarray | torch.Tensor,
        labels: np.ndarray | torch.Tensor,
        num_classes: int | None = None,
        training_mean: np.ndarray | torch.Tensor | None = None,
    ) -> None:
        self._features = _as_tensor("features", features)
        labels_tensor = _as_tensor("labels", labels)
        if self._features.ndim < 1 or self._features.shape[0] == 0:
            raise ValueError(
                f"features must have shape [num_samples >= 1, ...], got {tuple(self._features.shape)}"
            )
        label_dtype = labels_tensor.dtype
        if label_dtype.is_complex or label_dtype == torch.bool:
            raise TypeError(f"labels must be integers (classes) or floats (regression targets), got dtype {label_dtype}")
        regression = label_dtype.is_floating_point
        if labels_tensor.ndim != 1 and not (regression and labels_tensor.ndim >= 1):
            raise ValueError(f"labels must be 1-D [num_samples], got shape {tuple(labels_tensor.shape)}")
        if labels_tensor.shape[0] != self._features.shape[0]:
            raise ValueError(
                f"features and labels must have the same length, got {self._features.shape[0]} "
                f"and {labels_tensor.shape[0]}"
            )
        self._training_mean = None
        if regression:  # targets keep their values and dtype: 0.25 stays 0.25
            if num_classes is not None:
                raise TypeError(f"num_classes={num_classes!r} applies to integer class labels; these are "
                                f"{label_dtype} regression targets, leave it None")
            self._labels = labels_tensor
            self.num_classes = None
        else:
            self._set_class_labels(labels_tensor, num_classes)
        # checked once here, so the source need not check every minibatch it reads (a few µs each)
        self.values_finite = None if isinstance(features, np.memmap) else finite_once(self._features, self._labels)
        if training_mean is not None:
            self._training_mean = _as_tensor("training_mean", training_mean).to(torch.float32)
            if tuple(self._training_mean.shape) != self.feature_shape:
                raise ValueError(
                    f"training_mean must have shape {self.feature_shape} (feature_shape), got "
                    f"{tuple(self._training_mean.shape)}"
                )

    def _set_class_labels(self, labels_tensor: torch.Tensor, num_classes: int | None) -> None:
        self._labels = labels_tensor.to(torch.int64)
        smallest, largest = int(self._labels.min()), int(self._labels.max())
        if num_classes is None:
            num_classes = largest + 1
        self.num_classes = check_int("num_classes", num_classes, 1)
        if smallest < 0 or largest >= self.num_classes:
            raise ValueError(
                f"labels must lie in [0, num_classes={self.num_classes}), got range [{smallest}, {largest}]"
            )

    @property
    def num_samples(self) -> int:
        """Number of samples (one sweep)."""
        return int(self._features.shape[0])

    @property
    def feature_shape(self) -> tuple[int, ...]:
        """Shape of one sample's features."""
        return tuple(self._features.shape[1:])

    def get(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Features ``[len(indices), *feature_shape]`` (stored dtype) and the labels of ``indices``
        (int64 classes, or the float targets in their dtype)."""
        return self.take(torch.from_numpy(np.asarray(indices, dtype=np.int64)))

    def take(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`get` for an int64 index tensor: the source hands it a slice of its cached sweep order
        (one call instead of building an array and converting it, per minibatch)."""
        return self._features[index], self._labels[index]

    def mean_image(self) -> torch.Tensor:
        """float32 per-element mean ``[*feature_shape]``: ``training_mean`` if given, else of ``features``."""
        if self._training_mean is not None:
            return self._training_mean.clone()
        return self._features.to(torch.float64).mean(dim=0).to(torch.float32)
