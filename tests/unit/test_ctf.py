"""CNTK Text Format: dense/sparse inputs, sequence ids, comments, labels, and errors naming file:line."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from dtrain.data import CTFDeserializer, DataError, MinibatchSource

STREAMS = {"features": {"dim": 4, "format": "dense"}, "labels": {"dim": 3, "format": "dense"}}


def _write(tmp_path, text, name="data.ctf"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_dense_sparse_ids_comments_and_multi_line_sequences(tmp_path):
    path = _write(tmp_path, (
        "0 |features 1 2 3 4 |labels 0 1 0 |# first\n"
        "\n"
        "1 |# comment first |labels 1 0 0\n"
        "1 |features 5 6 7 8\n"          # same sequence id: the features of sequence 1
        "|features 0 0 0 1 |labels 0 0 1\n"
    ))
    data = CTFDeserializer(path, STREAMS)
    assert data.num_samples == 3 and data.num_classes == 3 and data.feature_shape == (4,)
    features, labels = data.get(np.array([2, 0, 1]))
    assert features.dtype == torch.float32
    assert features.tolist() == [[0, 0, 0, 1], [1, 2, 3, 4], [5, 6, 7, 8]]
    assert labels.tolist() == [2, 1, 0]
    # the per-element mean ImageTransform(mean="dataset") subtracts
    assert torch.allclose(data.mean_image(), torch.tensor([6, 8, 10, 13]) / 3)


def test_sparse_inputs_and_sparse_labels_become_dense_and_class_indices(tmp_path):
    streams = {"x": {"dim": 6, "format": "sparse", "shape": [2, 3]}, "y": {"dim": 10, "format": "sparse"}}
    path = _write(tmp_path, "|x 0:1.5 5:2 |y 7:1\n|x |y 0:1\n|ignored 1 2 |x 3:-1 |y 9:1\n")
    data = CTFDeserializer(path, streams, features="x", labels="y")
    features, labels = data.get(np.arange(3))
    assert features.shape == (3, 2, 3)
    assert features[0].flatten().tolist() == [1.5, 0, 0, 0, 0, 2] and features[1].abs().sum() == 0
    assert labels.tolist() == [7, 0, 9]
    source = MinibatchSource(data, randomize=False, max_sweeps=1)
    assert source.next_minibatch(3).labels.tolist() == [7, 0, 9]


@pytest.mark.parametrize("text, fragment", [
    ("|features 1 2 3 |labels 1 0 0\n", "data.ctf:1: input 'features' has 3 values; expected dim=4"),
    ("|features 1 2 3 4 |labels 1 0 0\n|features 1 2 3 4 |features 1 2 3 4 |labels 1 0 0\n", "data.ctf:2: input 'features' appears twice"),
    ("7 |features 1 2 3 4 |labels 1 0 0\n7 |features 1 2 3 4\n", "data.ctf:2: input 'features' already has a value in this sequence \\(line 1\\)"),
    ("|features 1 2 3 4\n", "data.ctf:1: sequence None has no value for input\\(s\\) \\['labels'\\]"),
    ("|features 1 2 x 4 |labels 1 0 0\n", "data.ctf:1: .*not a number"),
    ("|features 1 2 3 4 |labels 1 1 0\n", "data.ctf:1: labels 'labels' must be one-hot"),
    ("features 1 2 3 4\n", "data.ctf:1: no '\\|name' input"),
])
def test_malformed_lines_name_file_and_line(tmp_path, text, fragment):
    with pytest.raises(DataError, match=fragment):
        CTFDeserializer(_write(tmp_path, text), STREAMS)


def test_sparse_errors_and_bad_stream_specs(tmp_path):
    streams = {"features": {"dim": 4, "format": "sparse"}, "labels": {"dim": 3, "format": "dense"}}
    with pytest.raises(DataError, match="data.ctf:1: sparse input 'features' index 4 is outside"):
        CTFDeserializer(_write(tmp_path, "|features 4:1 |labels 1 0 0\n"), streams)
    with pytest.raises(DataError, match="expected 'index:value'"):
        CTFDeserializer(_write(tmp_path, "|features 2 |labels 1 0 0\n"), streams)
    with pytest.raises(DataError, match="not found"):
        CTFDeserializer(tmp_path / "missing.ctf", STREAMS)
    with pytest.raises(ValueError, match="'dense' or 'sparse'"):
        CTFDeserializer(_write(tmp_path, ""), {"features": {"dim": 1, "format": "csv"}, "labels": {"dim": 1}})
    with pytest.raises(ValueError, match="labels='y' is not in streams"):
        CTFDeserializer(_write(tmp_path, ""), STREAMS, labels="y")
