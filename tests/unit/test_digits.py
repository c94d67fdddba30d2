"""Digits deserializer: the shipped file, scaling, a fixed disjoint stratified split, and the training mean."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
import torch

import dtrain.data
from dtrain.data import Digits, ImageTransform, MinibatchSource

DATA_FILE = Path(dtrain.data.__file__).with_name("digits.npz")

# SHA-256 of the float32 features and int64 labels Digits(split) returned when it read scikit-learn's
# load_digits() and split it with train_test_split(test_size=297, random_state=0, stratify=labels):
# the shipped file must give exactly the same arrays.
EXPECTED = {
    "train": ("0b250ec018fd03c444e6f0f7fe203cbc407a512a786bcbc05e740c7f2d8b56a8",
              "ae9487dae07cd06be7ef9c8789bb03513daa6259d6b60b622a433e724430593f"),
    "test": ("8efb856720bed5cde3abd29464851a3d12c51b0d63caeb5230a6110f91643d49",
             "29075d0e34b610e09823619befb34ca6423bcf49523804688fee992db8b92b19"),
}
EXPECTED_MEAN = "d8ef58b727fab8f3006f7e52ec074a85c2469a2a1c72171f8b4af93fae1c24bf"


def _sha256(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.numpy().tobytes()).hexdigest()


@pytest.mark.parametrize("split", ["train", "test"])
def test_default_split_returns_exactly_the_arrays_scikit_learn_gave(split):
    digits = Digits(split)
    features, labels = digits.get(np.arange(digits.num_samples))
    assert (features.dtype, labels.dtype) == (torch.float32, torch.int64)
    assert (_sha256(features), _sha256(labels)) == EXPECTED[split]
    assert _sha256(digits.mean_image()) == EXPECTED_MEAN


def test_the_data_ships_as_a_small_file_with_its_licence_note():
    assert DATA_FILE.stat().st_size < 100_000
    note = DATA_FILE.with_name("digits.README.md").read_text()
    assert "CC BY 4.0" in note and "archive.ics.uci.edu" in note


def test_other_seeds_and_sizes_are_stratified_and_keep_every_class():
    for test_size, seed in ((100, 0), (297, 1), (10, 3), (1787, 2)):
        train, test = Digits("train", test_size, seed), Digits("test", test_size, seed)
        assert test.num_samples == test_size and train.num_samples == 1797 - test_size
        assert set(train.indices.tolist()).isdisjoint(test.indices.tolist())
        for split in (train, test):
            _, labels = split.get(np.arange(split.num_samples))
            assert set(labels.tolist()) == set(range(10))


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
    with np.load(DATA_FILE) as reference:
        images, targets = reference["images"], reference["labels"]
    test = Digits("test")
    features, labels = test.get(np.array([0, 5, 296]))
    assert features.dtype == torch.float32 and features.shape == (3, 1, 8, 8)
    assert labels.dtype == torch.int64
    original = test.indices[[0, 5, 296]]
    torch.testing.assert_close(features[:, 0], torch.from_numpy(images[original] / 16).float())
    assert labels.tolist() == targets[original].tolist()
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
