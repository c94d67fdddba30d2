"""The small classification data set most training tests use (in memory, no files)."""
from __future__ import annotations

import numpy as np

from dtrain.data import ArrayDeserializer


def four_class_data(num_samples: int = 120, seed: int = 0) -> ArrayDeserializer:
    """``num_samples`` samples of 6 standard-normal float32 features drawn from ``seed``, in 4 classes.

    The label is ``[x0 + x1 > 0] + 2 * [x2 > 0.5]``: learnable by a small MLP, so a few hundred
    samples of training move the parameters measurably (tests compare models after training).
    """
    generator = np.random.default_rng(seed)
    features = generator.normal(size=(num_samples, 6)).astype(np.float32)
    labels = (features[:, 0] + features[:, 1] > 0).astype(np.int64) + 2 * (features[:, 2] > 0.5)
    return ArrayDeserializer(features, labels, num_classes=4)
