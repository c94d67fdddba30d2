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


# -- CNTK's own reader test files (Tests/UnitTests/ReaderTests/Data/CNTKTextFormatReader), as CNTK reads them ----

# contains_blank_lines.txt, read by CNTK with the single input "features" (dim 1, dense)
CNTK_BLANK_LINES = "1 |features 1.0\n\n2 |features 2.0\n"
# ref_data_with_escape_sequences.txt: F0 sparse (dim 100) and F1 dense (dim 3), comments after "|#"
CNTK_ESCAPE_SEQUENCES = (
    "0|F0 3:1.5454 10:-1.07905e+008|F1 1.14268e-005 -0.000241299 0.991542\n"
    "0|F0 27:-4708.78 68:0.00225693\n"
    "0|# comments go here|F0 14:2.82767 39:-1.81625|F1 6.18595 102.251 4.29684\n"
    "1|F0 15:-1.43867e-007 20:0.00198758\n"
    "1|F0 51:0.0163487 85:-1.46579e-011\n"
    "1|F0 58:-1.54828 92:-3.96626 |# comments go here\t|F1 -0.00020997 0.624762 -2.38933\n"
    "2\t|# comments go here |F0 31:-0.0152079 34:13.2568\n"
    "2|F0 20:-8.39842e-005 63:87.6357|F1 3.73692e-012 -3.87597e-009 -0.00634454 |# comments go here\n"
    "2|F0 7:4.79005e-007 70:-0.609321 |# comments go here\n"
)
# the first two sequences of 3x5_MI_sparse.txt: three sparse inputs F0 (dim 2), F1 (dim 20), F2 (dim 200)
CNTK_3X5_MI_SPARSE = (
    "0|F0 1:2.37788|F1 0:-5.94894 10:-1.59957 16:-0.0685548|F2 16:6291.84 18:-13.6098 44:-3.18199e-007 76:-5.40684 "
    "97:-0.00473554 121:0.716951 149:0.163202 150:0.746402 165:-0.0585315 169:0.093585\n"
    "0|F0 1:0.554494|F1 6:-0.00297294 16:-0.00770002 18:0.551333|F2 15:-0.371498 32:1.14741e+007 79:-0.228289 "
    "86:-5.49982e-005 133:-7.3692e-005 137:-1.50713 142:-1.43751 149:-0.0746581 183:5.15402 195:0.00620653\n"
    "0|F0 1:-2.02578|F1 3:0.334267 13:3019.55 17:-0.314017|F2 23:0.0539055 88:-0.00664042 109:45.0852 "
    "115:-53.9932 153:-0.694674 160:-0.660334 164:-9.30563e-005 175:0.291683 193:0.00725713 199:614.158\n"
    "0|F0 0:0.264359|F1 5:-0.0221549 8:-0.310781 12:-14.9357|F2 0:-0.890797 26:26.7876 74:-1.73838 100:-4.71146 "
    "105:-0.00401721 113:-0.0180124 133:-51.502 148:0.652144 184:-32.3663 197:0.000153635\n"
    "0|F0 1:-0.452298|F1 1:-0.00159076 5:-0.248395 10:-0.475379|F2 11:-20.9888 63:191.08 114:-0.228938 "
    "131:-22.3441 135:0.766977 138:-1.23256 139:-0.890857 142:-2.25666 152:-13.4272 196:2.61959\n"
    "1|F0 1:-2956.88|F1 2:-3.15282 3:3.05513 7:-5.12223e-005|F2 0:0.673198 26:5.57403 64:3.48282 79:-0.0486728 "
    "80:2.43718 84:-0.016015 87:0.943675 110:2.46775e-013 111:46850.5 123:-3.76516\n"
    "1|F0 1:1.22095|F1 0:-0.00737828 4:-0.0144601 7:-0.543235|F2 14:1.54776e-009 27:-0.662915 35:0.536497 "
    "46:-0.34541 61:0.296044 88:9.98352 103:1.3163 134:-7.61135 164:-1.03857 185:-0.304898\n"
    "1|F0 1:-1.42519|F1 4:-2.33726e+009 10:-0.00143175 13:8.48106e-006|F2 4:-5.60599 15:-0.00796245 "
    "62:0.00715194 105:0.000809338 116:-7.11907 122:4.71727 124:-1.81108 126:0.0783529 154:-0.219359 173:0.0148204\n"
    "1|F0 1:-0.878025|F1 4:-50422.4 6:0.0177117 10:-3.18444|F2 56:1.07767 60:-0.00216281 73:17.799 "
    "86:0.000265889 100:0.000508151 114:-3.33513 144:-12.4163 179:-17.0704 186:-0.104639 199:123.917\n"
    "1|F0 0:568.322|F1 1:-0.669987 3:0.981722 15:8.27241e-008|F2 5:-106.585 12:0.789886 14:0.30409 "
    "43:-0.000205433 51:-0.807214 77:-0.265111 84:-0.000202472 104:3.97536e+008 124:0.836739 159:0.0436768\n"
)


def test_cntk_single_stream_file_is_read_as_its_one_named_stream(tmp_path):
    path = _write(tmp_path, CNTK_BLANK_LINES)
    data = CTFDeserializer(path, {"features": {"dim": 1}})  # no labels: CNTK's config declares one input
    assert set(data.streams) == {"features"} and data.num_sequences == 2 and data.defining_stream is None
    assert data.streams["features"] == StreamInfo("features", (1,), torch.float32, False, None)
    assert data.read(np.array([1, 0]))["features"].tolist() == [[2.0], [1.0]]
    minibatch = MinibatchSource(data, randomize=False, max_sweeps=1).next_minibatch(5)
    assert minibatch.global_num_samples == 2 and minibatch.features.tolist() == [[1.0], [2.0]]
    # a single stream of another name, and a sequence stream of its own (CNTK's 1x10 files: F0 on every line)
    assert CTFDeserializer(path, {"x": {"field": "features", "dim": 1}}).read(np.array([0]))["x"].tolist() == [[1.0]]
    sequences = CTFDeserializer(_write(tmp_path, "0|F0 1 2\n0|F0 3 4\n1|F0 5 6\n", "1x.ctf"),
                                {"features": {"field": "F0", "dim": 2, "sequence": True}})
    assert sequences.sequence_lengths("features").tolist() == [2, 1]
    assert sequences.read(np.array([0]))["features"].data.tolist() == [[[1, 2], [3, 4]]]


def test_cntk_files_with_comments_tabs_and_inputs_on_some_lines_read_as_cntk_reads_them(tmp_path):
    streams = {"features": {"field": "F0", "dim": 100, "format": "sparse", "sequence": True},
               "labels": {"field": "F1", "dim": 3, "sequence": True}}
    data = CTFDeserializer(_write(tmp_path, CNTK_ESCAPE_SEQUENCES), streams)
    assert data.num_sequences == 3
    assert data.sequence_lengths("features").tolist() == [3, 3, 3]
    assert data.sequence_lengths("labels").tolist() == [2, 1, 1]  # F1 is on 2, 1 and 1 lines of its sequence
    batch = data.read(np.arange(3))
    assert batch["features"].data[0, 0, 3].item() == pytest.approx(1.5454)
    assert batch["features"].data[0, 0, 10].item() == pytest.approx(-1.07905e8)
    assert batch["features"].data[2, 0].nonzero().flatten().tolist() == [31, 34]
    assert batch["labels"].data[0, 1].tolist() == pytest.approx([6.18595, 102.251, 4.29684])
    assert batch["labels"].data[1, 0].tolist() == pytest.approx([-0.00020997, 0.624762, -2.38933])

    multi = {f"features{k + 1}": {"field": f"F{k}", "dim": dim, "format": "sparse", "sequence": True}
             for k, dim in enumerate((2, 20, 200))}
    data = CTFDeserializer(_write(tmp_path, CNTK_3X5_MI_SPARSE, "mi.ctf"), multi)
    assert data.num_sequences == 2 and data.defining_stream == "features1"
    assert all(data.sequence_lengths(name).tolist() == [5, 5] for name in multi)
    batch = data.read(np.array([1]))
    assert batch["features3"].data[0, 0, 111].item() == pytest.approx(46850.5)
    assert batch["features1"].data[0, :, 1].tolist() == pytest.approx([-2956.88, 1.22095, -1.42519, -0.878025, 0])


@pytest.mark.parametrize("text, streams, fragment", [
    # duplicate_inputs.txt and missing_trailing_newline.txt: CNTK fails them too (with maxErrors = 0)
    ("1 |F1 1.0 |F2 2.0 |F2 3.0\n", {"f1": {"field": "F1", "dim": 1}, "f2": {"field": "F2", "dim": 1}},
     "data.ctf:1: input 'F2' appears twice in one line"),
    ("1|features 1.0\n1|features 2.0|features 3.0", {"features": {"dim": 1, "sequence": True}},
     "data.ctf:2: input 'features' appears twice in one line"),
])
def test_cntk_files_cntk_refuses_are_refused(tmp_path, text, streams, fragment):
    with pytest.raises(DataError, match=fragment):
        CTFDeserializer(_write(tmp_path, text), streams)


def test_a_numeric_label_column_is_a_float_target_as_cntk_reads_it(tmp_path):
    path = _write(tmp_path, "|features 1 2 |labels 3\n|features 0 -1 |labels -0.25\n|labels 7.5 |features 4 4\n")
    data = CTFDeserializer(path, {"features": {"dim": 2}, "labels": {"dim": 1}})
    assert data.num_samples == 3 and data.num_classes is None
    features, labels = data.get(np.array([2, 0, 1]))
    assert labels.dtype == torch.float32 and labels.tolist() == [[7.5], [3.0], [-0.25]]
    assert features.tolist() == [[4, 4], [1, 2], [0, -1]]
    # it trains as a regression target (CNTK's squared_error against a one-number label): y = a / 2 - b / 4
    import io

    import dtrain
    from dtrain.session import MeanAbsoluteError, MSELoss
    points = np.random.default_rng(0).normal(size=(60, 2))
    lines = "".join(f"|features {a:.6f} {b:.6f} |labels {a / 2 - b / 4:.6f}\n" for a, b in points)
    regression = CTFDeserializer(_write(tmp_path, lines, "regression.ctf"), {"features": {"dim": 2},
                                                                             "labels": {"dim": 1}})
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    result = dtrain.training_session(
        model, MSELoss(), dtrain.LocalLearner(torch.optim.SGD(model.parameters(), lr=0.1)),
        MinibatchSource(regression, randomization_seed=1), 10, max_samples=1200, metric=MeanAbsoluteError(),
        run_dir=tmp_path / "run", tensorboard=False, stream=io.StringIO(),
        test_config=dtrain.TestConfig(MinibatchSource(regression, randomize=False, max_sweeps=1), 60)).train()
    assert result.test.error < 0.02
    # a loss or metric of class ids is refused before training, naming what to use
    for options, fragment in (({"loss": torch.nn.CrossEntropyLoss(), "metric": MeanAbsoluteError()},
                               "loss CrossEntropyLoss takes class ids, but the target 'labels' holds one torch.float32 "
                               "number per sample"),
                              ({"loss": MSELoss()}, "metric classification_errors takes class ids.*loss=mse and "
                                                    "metric=mean_abs_error")):
        loss = options.pop("loss")
        with pytest.raises(ValueError, match=fragment):
            dtrain.training_session(model, loss, dtrain.LocalLearner(torch.optim.SGD(model.parameters(), lr=0.1)),
                                    MinibatchSource(regression), 10, max_samples=20, run_dir=tmp_path / "refused",
                                    tensorboard=False, stream=io.StringIO(), **options)
        assert not (tmp_path / "refused").exists()
    # a one-hot label (dim >= 2) is still a class id; labels=None reads every stream by its name
    named = CTFDeserializer(path, {"features": {"dim": 2}, "labels": {"dim": 1}}, labels=None)
    assert named.read(np.array([0]))["labels"].tolist() == [[3.0]]
    with pytest.raises(ValueError, match="features='x' / labels=None pick the two streams of data without sequences; "
                                         "with labels=None every stream is served by its own name"):
        CTFDeserializer(path, {"x": {"field": "features", "dim": 2}}, features="x", labels=None)
    with pytest.raises(DataError, match="two.ctf:1: labels 'labels' must be one-hot.*labels=None"):
        CTFDeserializer(_write(tmp_path, "|features 1 2 |labels 0.5 0.5\n", "two.ctf"),
                        {"features": {"dim": 2}, "labels": {"dim": 2}})


# -- sparse inputs kept sparse (layout: sparse) ---------------------------------------------------------

SPARSE_TEXT = "|x 0:1.5 5:2 |y 1:1\n|x |y 0:1\n|x 3:-1 |y 2:1\n|x 5:0.5 1:4 |y 1:1\n"


def test_a_sparse_input_is_kept_sparse_with_layout_sparse(tmp_path):
    path = _write(tmp_path, SPARSE_TEXT)
    dense_spec = {"x": {"dim": 6, "format": "sparse"}, "y": {"dim": 3, "format": "sparse", "ids": True}}
    sparse_spec = {"x": {"dim": 6, "format": "sparse", "layout": "sparse"}, "y": dense_spec["y"]}
    dense = CTFDeserializer(path, dense_spec, features="x", labels="y")
    sparse = CTFDeserializer(path, sparse_spec, features="x", labels="y")
    features, labels = sparse.get(np.array([3, 0, 1]))
    assert features.is_sparse and features.dtype == torch.float32 and features.shape == (3, 6)
    assert features.to_dense().tolist() == dense.get(np.array([3, 0, 1]))[0].tolist()
    assert features.to_dense()[0].tolist() == [0, 4, 0, 0, 0, 0.5] and labels.tolist() == [1, 1, 0]
    assert torch.equal(sparse.mean_image(), dense.mean_image())
    minibatch = MinibatchSource(sparse, randomize=False, max_sweeps=1).next_minibatch(4)
    assert minibatch.features.is_sparse and minibatch.features._nnz() == 5
    assert minibatch.select(1, 3, 2).features.to_dense().tolist() == dense.get(np.array([1, 2]))[0].tolist()
    # read by name: the sparse stream beside the others
    named = CTFDeserializer(path, sparse_spec, labels=None)
    batch = named.read(np.array([2, 3]))
    assert batch["x"].is_sparse and batch["x"].to_dense().tolist() == [[0, 0, 0, -1, 0, 0], [0, 4, 0, 0, 0, 0.5]]
    assert named.streams["x"] == StreamInfo("x", (6,), torch.float32, False, None)


def test_a_linear_model_on_the_sparse_stream_trains_exactly_as_on_the_dense_one(tmp_path):
    import io

    import dtrain
    path = _write(tmp_path, SPARSE_TEXT * 5)
    models = []
    for layout in ("dense", "sparse"):
        for micro in (None, 3):
            torch.manual_seed(0)
            model = torch.nn.Linear(6, 3)
            streams = {"x": {"dim": 6, "format": "sparse", "layout": layout},
                       "y": {"dim": 3, "format": "sparse", "ids": True}}
            source = MinibatchSource(CTFDeserializer(path, streams, features="x", labels="y"), randomization_seed=2)
            dtrain.training_session(model, torch.nn.CrossEntropyLoss(), dtrain.LocalLearner(
                torch.optim.SGD(model.parameters(), lr=0.1)), source, 8, max_samples=40, micro_batch_size=micro,
                run_dir=tmp_path / f"{layout}{micro}", tensorboard=False, stream=io.StringIO()).train()
            models.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert all(torch.allclose(models[0], other, atol=1e-6) for other in models[1:])
    torch.manual_seed(0)
    initial = torch.cat([p.detach().flatten() for p in torch.nn.Linear(6, 3).parameters()])
    assert (models[0] - initial).abs().max() > 0.05  # it trained


@pytest.mark.parametrize("spec, fragment", [
    ({"dim": 6, "layout": "sparse"}, "layout: sparse, which keeps the 'index:value' entries.*add format: sparse"),
    ({"dim": 6, "format": "sparse", "layout": "csr"}, "\\['layout'\\] must be 'dense'.*or 'sparse'.*got 'csr'"),
    ({"dim": 6, "format": "sparse", "layout": "sparse", "ids": True}, "ids: true.*and layout: sparse; use one"),
    ({"dim": 6, "format": "sparse", "layout": "sparse", "sequence": True}, "sequence: true; a sparse tensor holds one"),
    ({"dim": 6, "format": "sparse", "layout": "sparse", "shape": [2, 3]}, "leave out shape \\[2, 3\\]"),
])
def test_layout_sparse_is_refused_where_it_cannot_hold(tmp_path, spec, fragment):
    with pytest.raises(ValueError, match=fragment):
        CTFDeserializer(_write(tmp_path, SPARSE_TEXT), {"x": spec, "y": {"dim": 3, "format": "sparse"}},
                        features="x", labels="y")


def test_sparse_labels_stay_class_ids_and_a_repeated_index_is_refused(tmp_path):
    with pytest.raises(ValueError, match="streams\\['y'\\] has layout: sparse, but labels are served as class ids"):
        CTFDeserializer(_write(tmp_path, SPARSE_TEXT), {"x": {"dim": 6, "format": "sparse"},
                                                        "y": {"dim": 3, "format": "sparse", "layout": "sparse"}},
                        features="x", labels="y")
    for layout in ("dense", "sparse"):
        with pytest.raises(DataError, match="data.ctf:2: sparse input 'x' has index 5 twice"):
            CTFDeserializer(_write(tmp_path, "|x 1:1 |y 0:1\n|x 5:1 2:1 5:3 |y 0:1\n"),
                            {"x": {"dim": 6, "format": "sparse", "layout": layout}, "y": {"dim": 3, "format": "sparse"}},
                            features="x", labels="y")


@pytest.mark.parametrize("value, named", [("nan", "NaN"), ("inf", "an infinite value")])
def test_nan_or_inf_in_a_sparse_input_is_named_by_its_sample(tmp_path, value, named):
    """Kept sparse, the stream is checked in its stored values as a dense one is (not a crash, nor a divergence)."""
    path = _write(tmp_path, SPARSE_TEXT.replace("3:-1", f"3:{value}"))
    spec = {"x": {"dim": 6, "format": "sparse", "layout": "sparse"}, "y": {"dim": 3, "format": "sparse", "ids": True}}
    for deserializer, stream in ((CTFDeserializer(path, spec, features="x", labels="y"), "features"),
                                 (CTFDeserializer(path, spec, labels=None), "x")):
        source = MinibatchSource(deserializer, randomize=False, max_sweeps=1)
        with pytest.raises(DataError, match=rf"^stream '{stream}': sample 2 of CTFDeserializer \(timeline position 2\) "
                                            rf"holds {named}; expected finite numbers"):
            source.next_minibatch(4)
