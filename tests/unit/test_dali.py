"""DALI backend: same labels and crop geometry as the native backend for a fixed seed.

Skipped when nvidia-dali is not installed (pip install nvidia-dali-cuda120); GPU cases need CUDA.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("nvidia.dali")

from dtrain.testing.image_files import write_image_map_files  # noqa: E402
from dtrain.data import (DataError, ImageAugmentation, ImageFolderDeserializer, MinibatchSource,  # noqa: E402
                         image_deserializer, image_transform)
from dtrain.data.dali import DaliImageAugmentation, DaliImageDeserializer  # noqa: E402

OPTIONS = {"crop": "randomarea", "area_ratio": [0.2, 1.0], "aspect_ratio": [0.75, 1.33], "output_size": [24, 28],
           "flip": True, "brightness": 0.3, "saturation": 0.3}


@pytest.fixture
def png_set(tmp_path):
    # PNG: lossless, so both backends decode identical pixels and only resampling can differ.
    return write_image_map_files(tmp_path, num_train=10, num_val=3, size=(40, 48), formats=("png",))[0]


def _pair(map_file, device="cpu", **options):
    native = MinibatchSource(ImageFolderDeserializer(map_file), randomization_seed=3, max_sweeps=2,
                             transform=ImageAugmentation(**options))
    dali = MinibatchSource(DaliImageDeserializer(map_file), randomization_seed=3, max_sweeps=2,
                           transform=DaliImageAugmentation(**options, device=device, max_batch_size=4))
    return native, dali


@pytest.mark.parametrize("options", [OPTIONS, {"crop": "randomside", "side_ratio": [0.5, 0.9], "flip": True},
                                     {"crop": "center", "side_ratio": 0.8, "output_size": [16, 16]}])
def test_cpu_pipeline_matches_native_labels_geometry_and_pixels(png_set, options):
    native, dali = _pair(png_set, **options)
    for global_size, partitions in ((7, 2), (9, 3), (4, 1)):   # local batches of 2..7, split at max_batch_size 4
        states = native.get_checkpoint_state(), dali.get_checkpoint_state()
        for k in range(partitions):   # every partition's share of the same global minibatch
            native.restore_from_checkpoint(states[0])
            dali.restore_from_checkpoint(states[1])
            a = native.next_minibatch(global_size, partitions, k)
            b = dali.next_minibatch(global_size, partitions, k)
            assert torch.equal(a.labels, b.labels) and np.array_equal(a.positions, b.positions)
            assert a.features.shape == b.features.shape and b.features.dtype == torch.float32
            assert (a.features - b.features).abs().max() < 1.0    # same crops and flips
    assert native.next_minibatch(1) is None and dali.next_minibatch(1) is None


def test_checkpoint_position_is_dtrains(png_set):
    _, dali = _pair(png_set, **OPTIONS)
    dali.next_minibatch(6)
    state = dali.get_checkpoint_state()
    expected = dali.next_minibatch(6)
    _, resumed = _pair(png_set, **OPTIONS)
    resumed.restore_from_checkpoint(state)
    assert torch.allclose(resumed.next_minibatch(6).features, expected.features)


def test_backend_factories_and_errors(png_set, tmp_path):
    assert isinstance(image_deserializer("dali", map_file=png_set), DaliImageDeserializer)
    assert isinstance(image_transform("dali", crop="center", dali_options={"device": "cpu"}), DaliImageAugmentation)
    with pytest.raises(ValueError, match="backend must be one of"):
        image_deserializer("opencv", map_file=png_set)
    with pytest.raises(TypeError, match="reads a DaliImageDeserializer"):
        MinibatchSource(ImageFolderDeserializer(png_set), transform=DaliImageAugmentation(device="cpu"))
    (tmp_path / "images" / "bad.png").write_bytes(b"garbage")
    (tmp_path / "bad_map.txt").write_text("images/train_0.png\t0\nimages/bad.png\t1\n")
    source = MinibatchSource(DaliImageDeserializer(tmp_path / "bad_map.txt", image_size=[40, 48]), randomize=False,
                             transform=DaliImageAugmentation(device="cpu"))
    with pytest.raises(DataError, match=r"bad_map.txt:2: cannot decode image .*bad.png"):
        source.next_minibatch(2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_pipeline_matches_native(png_set):
    native, dali = _pair(png_set, device="gpu", **OPTIONS)
    a, b = native.next_minibatch(8), dali.next_minibatch(8)
    assert b.features.is_cuda and torch.equal(a.labels, b.labels)
    assert (a.features - b.features.cpu()).abs().max() < 1.0
