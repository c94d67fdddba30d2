"""ImageTransform: crop/flip geometry, counter-based randomness and partition invariance."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dtrain.data import ArrayDeserializer, ImageTransform, MinibatchSource
from dtrain.data.positional_random import flip_mask, uniform_from_positions
from dtrain.data.transform import crop_boxes


def ramp_images(num_images: int, height: int, width: int) -> torch.Tensor:
    """Images whose pixel (y, x) holds 100*y + x in every channel (linear, so bilinear is exact)."""
    ys = torch.arange(height, dtype=torch.float32).view(height, 1)
    xs = torch.arange(width, dtype=torch.float32).view(1, width)
    return (100 * ys + xs).expand(num_images, 3, height, width).clone()


def random_images(num_images: int, height: int = 12, width: int = 12, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (num_images, 3, height, width), generator=generator, dtype=torch.uint8)


def test_uniform_from_positions_is_deterministic_uniform_and_seed_dependent():
    positions = np.arange(20_000)
    values = uniform_from_positions(3, positions, stream=1)
    assert values.dtype == np.float64 and values.shape == positions.shape
    assert values.min() >= 0.0 and values.max() < 1.0
    np.testing.assert_array_equal(values, uniform_from_positions(3, positions, 1))
    histogram, _ = np.histogram(values, bins=10, range=(0, 1))
    assert histogram.min() > 1_800 and histogram.max() < 2_200  # ~2000 each
    other_seed = uniform_from_positions(4, positions, 1)
    other_stream = uniform_from_positions(3, positions, 2)
    assert abs(np.corrcoef(values, other_seed)[0, 1]) < 0.05
    assert abs(np.corrcoef(values, other_stream)[0, 1]) < 0.05
    # Neighbouring positions are not correlated either.
    assert abs(np.corrcoef(values[:-1], values[1:])[0, 1]) < 0.05
    # A value depends on its own position only, not on the other positions asked for.
    np.testing.assert_array_equal(uniform_from_positions(3, positions[[7, 3]], 1), values[[7, 3]])


def test_crop_boxes_cover_every_offset_inside_the_image():
    left, top, side = crop_boxes(0, np.arange(5_000), height=32, width=32, side_ratio=0.8)
    assert side == 25  # floor(0.8 * 32), as CNTK's randomside crop
    assert set(left.tolist()) == set(range(8)) and set(top.tolist()) == set(range(8))
    _, _, side_non_square = crop_boxes(0, np.arange(3), height=30, width=40, side_ratio=0.8)
    assert side_non_square == 24


def test_flip_mask_flips_about_half():
    assert 0.45 < flip_mask(1, np.arange(10_000)).mean() < 0.55


def test_no_crop_no_flip_only_converts_to_float():
    images = random_images(4)
    out = ImageTransform()(images, np.arange(4), seed=0)
    assert out.dtype == torch.float32
    assert torch.equal(out, images.to(torch.float32))


def test_crop_ratio_one_without_flip_is_identity():
    images = random_images(6)
    out = ImageTransform(crop_side_ratio=1.0)(images, np.arange(6), seed=0)
    torch.testing.assert_close(out, images.to(torch.float32), rtol=0, atol=1e-3)


def test_flip_mirrors_exactly_the_flagged_images():
    images = random_images(32)
    positions = np.arange(100, 132)
    out = ImageTransform(flip=True)(images, positions, seed=5)
    flagged = flip_mask(5, positions)
    assert 0 < flagged.sum() < 32
    for index in range(32):
        expected = images[index].flip(-1) if flagged[index] else images[index]
        assert torch.equal(out[index], expected.to(torch.float32))


@pytest.mark.parametrize("side_ratio", [0.5, 0.8])
def test_crop_scales_the_chosen_square_back_with_bilinear_interpolation(side_ratio):
    num_images, height, width = 40, 10, 10
    positions = np.arange(num_images) * 7 + 3
    out = ImageTransform(crop_side_ratio=side_ratio)(ramp_images(num_images, height, width), positions, seed=2)
    left, top, side = crop_boxes(2, positions, height, width, side_ratio)
    # Output pixel centre j samples source coordinate left + (j + 0.5) * side / W - 0.5 (half-pixel
    # centres), clamped to the image; a linear ramp makes bilinear interpolation exact.
    steps_y = (torch.arange(height, dtype=torch.float64) + 0.5) * side / height - 0.5
    steps_x = (torch.arange(width, dtype=torch.float64) + 0.5) * side / width - 0.5
    for index in range(num_images):
        source_y = (top[index] + steps_y).clamp(0, height - 1).view(height, 1)
        source_x = (left[index] + steps_x).clamp(0, width - 1).view(1, width)
        expected = (100 * source_y + source_x).to(torch.float32).expand(3, height, width)
        torch.testing.assert_close(out[index], expected, rtol=0, atol=2e-3)
    assert len(set(left.tolist())) > 1 and len(set(top.tolist())) > 1  # crops really move


def test_flip_with_crop_mirrors_the_same_crop():
    images = random_images(24, seed=1)
    positions = np.arange(24)
    cropped = ImageTransform(crop_side_ratio=0.8)(images, positions, seed=9)
    cropped_flipped = ImageTransform(crop_side_ratio=0.8, flip=True)(images, positions, seed=9)
    flagged = flip_mask(9, positions)
    assert 0 < flagged.sum() < 24
    for index in range(24):
        expected = cropped[index].flip(-1) if flagged[index] else cropped[index]
        torch.testing.assert_close(cropped_flipped[index], expected, rtol=0, atol=1e-3)


def test_output_for_a_sample_does_not_depend_on_its_minibatch():
    images = random_images(10, seed=2)
    positions = np.arange(500, 510)
    transform = ImageTransform(crop_side_ratio=0.8, flip=True)
    whole = transform(images, positions, seed=1)
    torch.testing.assert_close(transform(images[3:7], positions[3:7], seed=1), whole[3:7], rtol=0, atol=0)
    empty = transform(images[:0], positions[:0], seed=1)
    assert empty.shape == (0, 3, 12, 12) and empty.dtype == torch.float32
    assert not torch.allclose(transform(images, positions, seed=2), whole)


def test_augmentation_is_identical_with_one_or_three_partitions():
    images = random_images(29, height=8, width=8, seed=3).numpy()
    deserializer = ArrayDeserializer(images, np.arange(29) % 5)
    transform = ImageTransform(crop_side_ratio=0.8, flip=True, mean="dataset", scale=1 / 256)

    def outputs_by_position(num_partitions: int) -> dict[int, torch.Tensor]:
        sources = [MinibatchSource(deserializer, randomization_seed=4, max_samples=70, transform=transform)
                   for _ in range(num_partitions)]
        by_position = {}
        while True:
            minibatches = [source.next_minibatch(10, num_partitions, index) for index, source in enumerate(sources)]
            if minibatches[0] is None:
                return by_position
            for minibatch in minibatches:
                by_position.update(zip(minibatch.positions.tolist(), minibatch.features))

    single, partitioned = outputs_by_position(1), outputs_by_position(3)
    assert sorted(single) == sorted(partitioned) == list(range(70))
    for position in range(70):
        assert torch.equal(single[position], partitioned[position]), position


def test_mean_subtraction_and_scale_use_the_deserializer_mean():
    images = random_images(8, height=4, width=4, seed=4).numpy()
    training_mean = np.full((3, 4, 4), 100.0, dtype=np.float32)
    deserializer = ArrayDeserializer(images, np.zeros(8, dtype=np.int64), training_mean=training_mean)
    source = MinibatchSource(deserializer, randomize=False, transform=ImageTransform(mean="dataset", scale=0.5))
    minibatch = source.next_minibatch(8)
    expected = (torch.from_numpy(images).to(torch.float32) - 100.0) * 0.5
    torch.testing.assert_close(minibatch.features, expected, rtol=0, atol=0)


def test_mean_dataset_requires_setup_and_a_mean_image():
    with pytest.raises(RuntimeError, match="not set up"):
        ImageTransform(mean="dataset")(random_images(2), np.arange(2), seed=0)

    class NoMean:
        num_samples, feature_shape, num_classes = 2, (3, 12, 12), 2

        def get(self, indices):
            raise AssertionError("not read")

    with pytest.raises(TypeError, match="mean_image"):
        ImageTransform(mean="dataset").setup(NoMean())


@pytest.mark.parametrize("kwargs, error, message", [
    ({"crop_side_ratio": 0.0}, ValueError, r"crop_side_ratio must be in \(0, 1\], got 0.0"),
    ({"crop_side_ratio": 1.2}, ValueError, "crop_side_ratio must be in"),
    ({"crop_side_ratio": "0.8"}, TypeError, "crop_side_ratio must be a float"),
    ({"flip": "yes"}, TypeError, "flip must be a bool"),
    ({"mean": "imagenet"}, ValueError, "mean must be None or 'dataset', got 'imagenet'"),
    ({"scale": 0}, ValueError, "scale must be a finite number > 0"),
])
def test_constructor_validates_arguments(kwargs, error, message):
    with pytest.raises(error, match=message):
        ImageTransform(**kwargs)


def test_call_rejects_non_images_and_mismatched_positions():
    with pytest.raises(ValueError, match=r"images \[n, C, H, W\]"):
        ImageTransform()(torch.zeros(2, 12), np.arange(2), seed=0)
    with pytest.raises(ValueError, match=r"positions must have shape \(2,\)"):
        ImageTransform()(torch.zeros(2, 1, 4, 4), np.arange(3), seed=0)
