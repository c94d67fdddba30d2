"""CNTK Text Format: dense/sparse inputs, sequence ids, comments, labels, sequences as CNTK reads them (CNTK's own
training-session data), and errors naming file:line."""
from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from dtrain.data import CTFDeserializer, DataError, MinibatchSource, StreamInfo

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


# -- sequences, as CNTK's reader reads them ---------------------------------------------------------

# CNTK's bindings/python/cntk/train/tests/training_session_test.py (ctf_data), fields separated by a TAB
CNTK_TRAINING_SESSION_DATA = (
    "0\t|S0 3:1 |# <s>\t|S1 3:1 |# <s>\n"
    "0\t|S0 4:1 |# A\t|S1 32:1 |# ~AH\n"
    "0\t|S0 5:1 |# B\t|S1 36:1 |# ~B\n"
    "0\t|S0 4:1 |# A\t|S1 31:1 |# ~AE\n"
    "0\t|S0 7:1 |# D\t|S1 38:1 |# ~D\n"
    "0\t|S0 12:1 |# I\t|S1 47:1 |# ~IY\n"
    "0\t|S0 1:1 |# </s>\t|S1 1:1 |# </s>\n"
    "2\t|S0 60:1 |# <s>\t|S1 3:1 |# <s>\n"
    "2\t|S0 61:1 |# A\t|S1 32:1 |# ~AH\n"
    "3\t|S0 60:1 |# <s>\t|S1 3:1 |# <s>\n"
    "3\t|S0 61:1 |# A\t|S1 32:1 |# ~AH\n"
    "4\t|S0 60:1 |# <s>\t|S1 3:1 |# <s>\n"
    "4\t|S0 61:1 |# A\t|S1 32:1 |# ~AH\n"
    "5\t|S0 60:1 |# <s>\t|S1 3:1 |# <s>\n"
    "5\t|S0 61:1 |# A\t|S1 32:1 |# ~AH\n"
    "6\t|S0 60:1 |# <s>\t|S1 3:1 |# <s>\n"
    "6\t|S0 61:1 |# A\t|S1 32:1 |# ~AH\n"
    "7\t|S0 60:1 |# <s>\t|S1 3:1 |# <s>\n"
    "7\t|S0 61:1 |# A\t|S1 32:1 |# ~AH\n"
    "8\t|S0 60:1 |# <s>\t|S1 3:1 |# <s>\n"
    "8\t|S0 61:1 |# A\t|S1 32:1 |# ~AH\n"
    "9\t|S0 60:1 |# <s>\t|S1 3:1 |# <s>\n"
    "9\t|S0 61:1 |# A\t|S1 32:1 |# ~AH\n"
    "10\t|S0 60:1 |# <s>\t|S1 3:1 |# <s>\n"
    "10\t|S0 61:1 |# A\t|S1 32:1 |# ~AH\n"
)

CNTK_STREAMS = {"features": {"field": "S0", "dim": 69, "format": "sparse", "sequence": True, "ids": True},
                "labels": {"field": "S1", "dim": 69, "format": "sparse", "sequence": True, "ids": True}}


def _read_all(sources, size):
    """Every minibatch until None, as lists of the partitions' minibatches: ``sources`` are the ranks'
    sources (built alike), read in lockstep, partition ``k`` from ``sources[k]``."""
    sources = sources if isinstance(sources, list) else [sources]
    minibatches = []
    while True:
        shares = [source.next_minibatch(size, len(sources), index) for index, source in enumerate(sources)]
        if shares[0] is None:
            assert all(share is None for share in shares)
            return minibatches
        minibatches.append(shares)


def test_cntk_training_session_data_reads_21_samples_for_max_samples_20(tmp_path):
    path = _write(tmp_path, CNTK_TRAINING_SESSION_DATA)
    data = CTFDeserializer(path, CNTK_STREAMS)
    assert data.num_sequences == 10 and data.defining_stream == "features"
    assert data.streams["features"].dtype == torch.int64 and data.streams["features"].shape == ()
    assert data.streams["labels"].is_sequence and data.streams["labels"].num_classes == 69
    assert data.sequence_lengths("features").tolist() == [7] + [2] * 9

    source = MinibatchSource(CTFDeserializer(path, CNTK_STREAMS), randomize=False, max_samples=20)
    sizes = [shares[0].global_num_samples for shares in _read_all(source, 4)]
    # the 7-step first sequence whole, then two 2-step sequences per minibatch, then one for a budget of 1
    assert sizes == [7, 4, 4, 4, 2] and sum(sizes) == 21

    source = MinibatchSource(CTFDeserializer(path, CNTK_STREAMS), randomize=False, max_sweeps=1)
    minibatches = [shares[0] for shares in _read_all(source, 4)]
    assert sum(mb.global_num_samples for mb in minibatches) == 25
    assert sum(mb.global_num_sequences for mb in minibatches) == 10
    expected = {field: [int(entry.split(":")[0]) for entry in
                        re.findall(rf"\|{field} (\d+:1)", CNTK_TRAINING_SESSION_DATA)]
                for field in ("S0", "S1")}
    for name, field in (("features", "S0"), ("labels", "S1")):
        read = torch.cat([step for mb in minibatches for step in mb[name].unpadded()]).tolist()
        assert read == expected[field]
    assert minibatches[0]["labels"].unpadded()[0].tolist() == [3, 32, 36, 31, 38, 47, 1]


SEQ2SEQ = {"graphemes": {"dim": 10, "format": "sparse", "sequence": True, "ids": True, "field": "g"},
           "phonemes": {"dim": 12, "format": "sparse", "sequence": True, "ids": True, "field": "p"}}


def test_multi_line_sequences_whose_streams_differ_in_length(tmp_path):
    path = _write(tmp_path, (
        "w1 |g 2:1 |p 5:1 |# first line of w1\n"
        "w1 |g 3:1 |p 6:1\n"
        "w1 |g 1:1\n"
        "w2 |# only a comment here |p 7:1\n"
        "w2 |p 11:1 |g 4:1\n"
        "\n"
        "w2 |ignored 1 2 3 |p 9:1\n"
        "|g 9:1 |p 0:1\n"                  # a line without an id is a sequence of its own
        "|g 8:1 |p 1:1\n"
    ))
    data = CTFDeserializer(path, SEQ2SEQ)
    assert data.num_sequences == 4 and set(data.streams) == {"graphemes", "phonemes"}
    assert data.sequence_lengths("graphemes").tolist() == [3, 1, 1, 1]
    assert data.sequence_lengths("phonemes").tolist() == [2, 3, 1, 1]
    batch = data.read(np.array([1, 0]))
    assert batch["graphemes"].lengths.tolist() == [1, 3]
    assert batch["graphemes"].data.tolist() == [[4, 0, 0], [2, 3, 1]]  # padded with 0
    assert [s.tolist() for s in batch["phonemes"].unpadded()] == [[7, 11, 9], [5, 6]]
    # samples are steps of the defining stream: the first sequence stream unless told
    assert MinibatchSource(data, randomize=False).samples_per_sweep == 6
    other = CTFDeserializer(path, SEQ2SEQ, defining_stream="phonemes")
    assert other.defining_stream == "phonemes" and MinibatchSource(other, randomize=False).samples_per_sweep == 7


def test_dense_and_sparse_vectors_in_sequences_beside_a_class_per_sequence(tmp_path):
    streams = {"x": {"dim": 2, "sequence": True},
               "s": {"dim": 4, "format": "sparse", "sequence": True, "shape": [2, 2]},
               "y": {"dim": 3, "format": "sparse", "ids": True},        # the class of the sequence
               "w": {"dim": 1}}                                         # a float per sequence
    path = _write(tmp_path, (
        "a |x 1 2 |s 0:0.5 3:2 |y 2:1 |w 0.25\n"
        "a |x 3 4 |s |# an empty sparse value is a step of zeros\n"
        "b |y 0:1 |x -1 -2 |s 1:-1 |w 1\n"
    ))
    data = CTFDeserializer(path, streams)
    assert data.streams["x"] == StreamInfo("x", (2,), torch.float32, True, None)
    assert data.streams["s"].shape == (2, 2) and data.streams["s"].dtype == torch.float32
    assert not data.streams["y"].is_sequence and data.streams["y"].dtype == torch.int64
    assert data.streams["y"].num_classes == 3 and data.defining_stream == "x"
    batch = data.read(np.array([0, 1]))
    assert batch["x"].lengths.tolist() == [2, 1]
    assert batch["x"].data.tolist() == [[[1, 2], [3, 4]], [[-1, -2], [0, 0]]]
    assert batch["s"].data[0].tolist() == [[[0.5, 0], [0, 2]], [[0, 0], [0, 0]]]
    assert batch["s"].data[1, 0].tolist() == [[0, -1], [0, 0]]
    assert batch["y"].tolist() == [2, 0] and batch["w"].tolist() == [[0.25], [1.0]]
    minibatch = MinibatchSource(data, randomize=False, max_sweeps=1).next_minibatch(10)
    assert minibatch.global_num_samples == 3 and minibatch["y"].tolist() == [2, 0]
    # the two-stream interface belongs to data without sequences
    assert not hasattr(data, "num_samples")
    with pytest.raises(TypeError, match="CTFDeserializer.get is for data without sequences"):
        data.get(np.array([0]))


@pytest.mark.parametrize("text, fragment", [
    ("5 |g 1:1\n", "data.ctf:1: sequence '5' \\(line 1\\) has no value for 'p' \\(stream 'phonemes'\\); every "
                   "sequence needs at least one step"),
    ("1 |g 1:1 |p 1:1\n2 |g 1:1\n2 |g 2:1\n", "data.ctf:2: sequence '2' \\(lines 2-3\\) has no value for 'p'"),
    ("|p 1:1 |# no graphemes\n",
     "data.ctf:1: sequence None \\(line 1\\) has no value for 'g' \\(stream 'graphemes'\\)"),
    ("|g 1:1 2:1 |p 1:1\n", "data.ctf:1: ids input 'g' \\(stream 'graphemes'\\) has 2 entries; expected exactly one"),
    ("|g |p 1:1\n", "data.ctf:1: ids input 'g' .* has 0 entries"),
    ("|g 1:1 |p 1:1\n|g 3:0.5 |p 1:1\n", "data.ctf:2: ids input 'g' .* has '3:0.5'; expected 'index:1'"),
    ("|g 10:1 |p 1:1\n", "data.ctf:1: sparse input 'g' \\(stream 'graphemes'\\) index 10 is outside \\[0, 10\\)"),
    ("|g 1 |p 1:1\n", "data.ctf:1: sparse input 'g' .* has '1'; expected 'index:value'"),
    ("|g 1:1 |g 2:1 |p 1:1\n", "data.ctf:1: input 'g' appears twice"),
    ("", "has no samples"),
])
def test_sequence_errors_name_file_line_and_stream(tmp_path, text, fragment):
    with pytest.raises(DataError, match=fragment):
        CTFDeserializer(_write(tmp_path, text), SEQ2SEQ)


def test_a_non_sequence_stream_twice_in_a_sequence_is_an_error(tmp_path):
    streams = {"text": {"dim": 5, "format": "sparse", "sequence": True, "ids": True},
               "label": {"dim": 2, "format": "sparse", "ids": True}}
    path = _write(tmp_path, "7 |text 1:1 |label 1:1\n7 |text 2:1 |label 1:1\n")
    with pytest.raises(DataError, match="data.ctf:2: input 'label' already has a value in this sequence \\(line 1\\); "
                                        "it is not a sequence stream"):
        CTFDeserializer(path, streams)
    dense = {"text": {"dim": 2, "sequence": True}, "label": {"dim": 2, "format": "sparse", "ids": True}}
    with pytest.raises(DataError, match="data.ctf:1: input 'text' has 3 values; expected dim=2"):
        CTFDeserializer(_write(tmp_path, "|text 1 2 3 |label 1:1\n"), dense)


def test_sequence_mode_arguments_and_specs_are_checked(tmp_path):
    path = _write(tmp_path, "|g 1:1 |p 1:1\n")
    with pytest.raises(ValueError, match="features='graphemes' / labels='labels' pick the two streams of data "
                                         "without sequences.*leave them out"):
        CTFDeserializer(path, SEQ2SEQ, features="graphemes")
    with pytest.raises(ValueError, match="defining_stream='text'"):
        CTFDeserializer(path, SEQ2SEQ, defining_stream="text")
    with pytest.raises(ValueError, match="unknown keys \\['length'\\]; "
                                         "expected dim, format, shape, sequence, field, ids"):
        CTFDeserializer(path, {"g": {"dim": 10, "sequence": True, "length": 3}})
    with pytest.raises(ValueError, match="ids: true.*add format: sparse"):
        CTFDeserializer(path, {"g": {"dim": 10, "sequence": True, "ids": True}})
    with pytest.raises(ValueError, match="streams 'g' and 'b' both read the input 'g'"):
        CTFDeserializer(path, {"g": {"dim": 10, "sequence": True}, "b": {"dim": 10, "field": "g"}})
    with pytest.raises(TypeError, match="\\['sequence'\\] must be a bool"):
        CTFDeserializer(path, {"g": {"dim": 10, "sequence": "yes"}})
    # without sequence streams, defining_stream has nothing to count
    with pytest.raises(ValueError, match="defining_stream='features'.*no stream here has sequence: true"):
        CTFDeserializer(_write(tmp_path, "|features 1 2 3 4 |labels 1 0 0\n"), STREAMS, defining_stream="features")


def test_without_sequence_streams_a_multi_line_sequence_says_how_to_read_it(tmp_path):
    path = _write(tmp_path, "7 |features 1 2 3 4 |labels 1 0 0\n7 |features 1 2 3 4\n")
    with pytest.raises(DataError, match="data.ctf:2: .*declare the inputs that are sequences with sequence: true in "
                                        "their stream spec"):
        CTFDeserializer(path, STREAMS)
    # field and ids work without sequences too: the file's input S1 as class ids
    streams = {"features": {"dim": 2, "field": "S0"},
               "labels": {"dim": 3, "format": "sparse", "ids": True, "field": "S1"}}
    data = CTFDeserializer(_write(tmp_path, "|S0 1 2 |S1 2:1\n|S1 0:1 |S0 3 4\n"), streams)
    features, labels = data.get(np.arange(2))
    assert features.tolist() == [[1, 2], [3, 4]] and labels.tolist() == [2, 0] and data.num_classes == 3


@pytest.mark.parametrize("partitions", [2, 3])
def test_partitions_read_every_sequence_exactly_once_per_sweep(tmp_path, partitions):
    # sequence k: 1 + (3k mod 5) steps of the id k (grapheme) and k mod 4 + 1 phonemes
    lines, expected = [], {}
    for k in range(23):
        length = 1 + (3 * k) % 5
        expected[k] = length
        for step in range(max(length, k % 4 + 1)):
            grapheme = f"|g {k}:1 " if step < length else ""
            phoneme = f"|p {step}:1" if step < k % 4 + 1 else ""
            lines.append(f"s{k} {grapheme}{phoneme}\n")
    streams = {"graphemes": {**SEQ2SEQ["graphemes"], "dim": 23}, "phonemes": SEQ2SEQ["phonemes"]}
    path = _write(tmp_path, "".join(lines))
    data = CTFDeserializer(path, streams)
    assert data.sequence_lengths("graphemes").tolist() == list(expected.values())
    sources = [MinibatchSource(CTFDeserializer(path, streams), randomize=True, randomization_seed=3, max_sweeps=1)
               for _ in range(partitions)]
    seen = []
    for shares in _read_all(sources, 7):
        assert sum(share.num_samples for share in shares) == shares[0].global_num_samples
        for share in shares:
            for graphemes, phonemes in zip(share["graphemes"].unpadded(), share["phonemes"].unpadded()):
                k = int(graphemes[0])
                assert graphemes.tolist() == [k] * expected[k]
                assert phonemes.tolist() == list(range(k % 4 + 1))
                seen.append(k)
    assert sorted(seen) == list(range(23)) and seen != sorted(seen)  # each once, shuffled
