"""Native image backend: PIL decoding of map files, CNTK-style crops, jitter and normalisation."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from dtrain.testing.image_files import image_pixels, write_image_map_files
from dtrain.data.transform import crop_boxes
from dtrain.data import (DataError, ImageAugmentation, ImageFolderDeserializer, ImageTransform, MinibatchSource,
                         crop_geometry)


@pytest.fixture
def image_set(tmp_path):
    return write_image_map_files(tmp_path, num_train=12, num_val=4, size=(40, 48))


def test_decodes_png_exactly_jpeg_closely_and_labels(image_set):
    train_map, _ = image_set
    data = ImageFolderDeserializer(train_map)
    assert data.feature_shape == (3, 40, 48) and data.num_samples == 12 and data.num_classes == 3
    images, labels = data.get(np.array([1, 0, 5]))
    assert images.dtype == torch.uint8 and images.shape == (3, 3, 40, 48)
    assert labels.tolist() == [1, 0, 2]
    assert np.array_equal(images[0].numpy(), image_pixels(1, (40, 48)).transpose(2, 0, 1))   # PNG: lossless
    jpeg_error = np.abs(images[1].numpy().astype(int) - image_pixels(0, (40, 48)).transpose(2, 0, 1))
    assert jpeg_error.mean() < 8   # JPEG at quality 95 with chroma subsampling


def test_resizes_to_image_size_and_refuses_mixed_sizes_without_it(tmp_path, image_set):
    train_map, _ = image_set
    assert ImageFolderDeserializer(train_map, image_size=[20, 30]).get(np.arange(4))[0].shape == (4, 3, 20, 30)
    write_image_map_files(tmp_path / "other", num_train=1, num_val=1, size=(10, 10))
    lines = train_map.read_text() + f"{tmp_path / 'other' / 'images' / 'train_0.jpg'}\t0\n"
    (tmp_path / "mixed.txt").write_text(lines)
    data = ImageFolderDeserializer(tmp_path / "mixed.txt")
    with pytest.raises(DataError, match=r"mixed.txt:13: image .* is 10x10 but the first image is 40x48; pass image_size"):
        data.get(np.array([12]))


def test_labels_beyond_num_classes_and_undecodable_files(tmp_path, image_set):
    train_map, _ = image_set
    with pytest.raises(DataError, match=r"train_map.txt:3: label 2 >= num_classes \(2\)"):
        ImageFolderDeserializer(train_map, num_classes=2)
    (tmp_path / "images" / "bad.jpg").write_bytes(b"not an image")
    (tmp_path / "bad_map.txt").write_text("images/train_0.jpg\t0\nimages/bad.jpg\t1\n")
    data = ImageFolderDeserializer(tmp_path / "bad_map.txt")
    with pytest.raises(DataError, match=r"bad_map.txt:2: cannot decode image .*bad.jpg"):
        data.get(np.array([0, 1]))


def test_fixed_random_side_crop_equals_image_transform():
    images = torch.randint(0, 256, (6, 3, 30, 36), dtype=torch.uint8)
    positions = np.arange(100, 106)
    ours = ImageAugmentation(crop="randomside", side_ratio=0.8, flip=True)(images, positions, 7)
    reference = ImageTransform(crop_side_ratio=0.8, flip=True)(images, positions, 7)
    assert torch.allclose(ours, reference, atol=1e-4)


@pytest.mark.parametrize("crop, options", [
    ("randomside", {"side_ratio": [0.5, 0.9]}),
    ("randomarea", {"area_ratio": [0.08, 1.0], "aspect_ratio": [0.75, 1.333]}),
    ("center", {"side_ratio": 0.875}),
    (None, {}),
])
def test_crop_geometry_stays_inside_and_is_position_keyed(crop, options):
    positions = np.arange(0, 500)
    kwargs = {key: tuple(np.broadcast_to(value, 2).tolist()) for key, value in options.items()}
    left, top, width, height = crop_geometry(3, positions, 60, 80, crop, **kwargs)
    assert (left >= 0).all() and (top >= 0).all() and (left + width <= 80).all() and (top + height <= 60).all()
    assert (width >= 1).all() and (height >= 1).all()
    again = crop_geometry(3, positions[250:], 60, 80, crop, **kwargs)
    assert all(np.array_equal(a[250:], b) for a, b in zip((left, top, width, height), again))
    if crop in ("randomside", "randomarea"):
        assert len(set(zip(left.tolist(), width.tolist()))) > 50   # really random


@pytest.mark.parametrize("height, width", [(32, 32), (30, 40), (60, 80), (7, 5)])
@pytest.mark.parametrize("ratio", [0.8, 0.5, 0.875, 1.0, 0.3])
def test_randomside_with_a_fixed_ratio_is_exactly_the_cifar_transform_crop(height, width, ratio):
    positions = np.arange(0, 2000)
    left, top, crop_width, crop_height = crop_geometry(5, positions, height, width, "randomside", side_ratio=(ratio, ratio))
    want_left, want_top, side = crop_boxes(5, positions, height, width, ratio)
    assert np.array_equal(left, want_left) and np.array_equal(top, want_top)
    assert (crop_width == side).all() and (crop_height == side).all()


def test_scale_jitter_and_normalisation():
    images = torch.full((4, 3, 20, 20), 100, dtype=torch.uint8)
    images[:, 0] = 200
    mean, std = [10.0, 20.0, 30.0], [2.0, 4.0, 5.0]
    out = ImageAugmentation(output_size=[8, 10], mean=mean, std=std)(images, np.arange(4), 0)
    assert out.shape == (4, 3, 8, 10) and out.dtype == torch.float32
    assert torch.allclose(out[:, 0], torch.tensor(95.0)) and torch.allclose(out[:, 2], torch.tensor(14.0))
    jitter = ImageAugmentation(brightness=0.4, contrast=0.4, saturation=0.4)
    first = jitter(images, np.arange(4), 0)
    assert not torch.allclose(first[0], first[1])                     # different factors per image
    assert torch.equal(first[2:], jitter(images[2:], np.arange(2, 4), 0))  # keyed by position only
    assert first.min() >= 0 and first.max() <= 255


def test_native_backend_through_minibatch_source_partitions_agree(image_set):
    train_map, _ = image_set
    data = ImageFolderDeserializer(train_map)
    transform = ImageAugmentation(crop="randomarea", area_ratio=[0.3, 1.0], aspect_ratio=[0.75, 1.33],
                                  output_size=[24, 24], flip=True, brightness=0.2, mean=[128.0] * 3, std=[64.0] * 3)
    whole = MinibatchSource(data, randomization_seed=5, max_sweeps=1, transform=transform).next_minibatch(12)
    parts = [MinibatchSource(data, randomization_seed=5, max_sweeps=1, transform=transform).next_minibatch(12, 3, k)
             for k in range(3)]
    assert torch.allclose(torch.cat([p.features for p in parts]), whole.features)
    assert torch.equal(torch.cat([p.labels for p in parts]), whole.labels)
    assert whole.features.shape == (12, 3, 24, 24)


@pytest.mark.parametrize("kwargs, error", [
    ({"crop": "random"}, ValueError), ({"side_ratio": 1.5}, ValueError), ({"brightness": 1.0}, ValueError),
    ({"mean": [1, 2]}, ValueError), ({"std": [1, 0, 1]}, ValueError), ({"output_size": [3]}, ValueError),
])
def test_bad_options_are_refused(kwargs, error):
    with pytest.raises(error):
        ImageAugmentation(**kwargs)
