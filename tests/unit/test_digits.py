"""Digits deserializer: scaling, a fixed disjoint stratified split, and the training mean."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sklearn.datasets import load_digits

from dtrain.data import Digits, ImageTransform, MinibatchSource


def test_splits_are_disjoint_complete_and_stratified():
    train, test = Digits("train"), Digits("test")
    assert (train.num_samples, test.num_samples) == (1500, 297)
    assert set(train.indices.tolist()).isdisjoint(test.indices.tolist())
    assert len(set(train.indices.tolist()) | set(test.indices.tolist())) == 1797
    _, test_labels = test.get(np.arange(test.num_samples))
    counts = np.bincount(test_labels.numpy(), minlength=10)
    assert counts.min() >= 28 and counts.max() <= 31  # ~29.7 per class


def test_split_is_deterministic_and_seeded():
    assert np.array_equal(Digits("test", seed=0).indices, Digits("test", seed=0).indices)
    assert not np.array_equal(Digits("test", seed=0).indices, Digits("test", seed=1).indices)
    assert Digits("test", test_size=100).num_samples == 100


def test_features_are_scaled_images_of_the_right_samples():
    reference = load_digits()
    test = Digits("test")
    features, labels = test.get(np.array([0, 5, 296]))
    assert features.dtype == torch.float32 and features.shape == (3, 1, 8, 8)
    assert labels.dtype == torch.int64
    original = test.indices[[0, 5, 296]]
    torch.testing.assert_close(features[:, 0], torch.from_numpy(reference.images[original] / 16).float())
    assert labels.tolist() == reference.target[original].tolist()
    assert 0.0 <= float(features.min()) and float(features.max()) <= 1.0


def test_mean_image_is_the_training_mean_for_both_splits():
    train = Digits("train")
    images, _ = train.get(np.arange(train.num_samples))
    expected = images.double().mean(dim=0).float()
    for split in ("train", "test"):
        mean = Digits(split).mean_image()
        assert mean.shape == (1, 8, 8) and mean.dtype == torch.float32
        torch.testing.assert_close(mean, expected)


def test_reads_through_a_source_with_augmentation():
    source = MinibatchSource(Digits("train"), max_sweeps=1,
                             transform=ImageTransform(crop_side_ratio=0.8, flip=True, mean="dataset"))
    total = 0
    while (minibatch := source.next_minibatch(256, 2, 1)) is not None:
        assert minibatch.features.shape[1:] == (1, 8, 8)
        total += minibatch.num_samples
    assert total == 750


@pytest.mark.parametrize("kwargs, error, message", [
    ({"split": "val"}, ValueError, "split must be 'train' or 'test', got 'val'"),
    ({"test_size": 5}, ValueError, "test_size must be >= 10, got 5"),
    ({"test_size": 1790}, ValueError, "test_size must be <= 1787"),
    ({"test_size": 0.2}, TypeError, "test_size must be an int"),
    ({"seed": -1}, ValueError, "seed must be >= 0"),
])
def test_constructor_validates_arguments(kwargs, error, message):
    with pytest.raises(error, match=message):
        Digits(**kwargs)
