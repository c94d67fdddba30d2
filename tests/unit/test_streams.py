"""Named streams: Sequences (padding, masks, step slices), stream references, and the in-memory
stream deserializers StreamArrays and NpzStreams."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from dtrain.data import DataError, NpzStreams, Sequences, StreamArrays, StreamReference

SEQUENCES = [torch.tensor([5, 6, 7]), torch.tensor([8]), torch.tensor([9, 10, 11, 12, 13])]


def test_from_list_pads_with_zeros_and_masks_the_real_steps():
    batch = Sequences.from_list(SEQUENCES)
    assert batch.data.tolist() == [[5, 6, 7, 0, 0], [8, 0, 0, 0, 0], [9, 10, 11, 12, 13]]
    assert batch.lengths.tolist() == [3, 1, 5] and batch.lengths.device.type == "cpu"
    assert batch.mask.tolist() == [[True] * 3 + [False] * 2, [True] + [False] * 4, [True] * 5]
    assert batch.num_steps == 9 and batch.num_sequences == 3 and batch.padded_positions == 6
    assert [t.tolist() for t in batch.unpadded()] == [t.tolist() for t in SEQUENCES]


@pytest.mark.parametrize("start, stop", [(1, None), (0, -1), (0, 3), (2, -1), (1, 2), (4, None)])
def test_step_slices_cut_every_sequence_as_python_slicing_would(start, stop):
    sliced = Sequences.from_list(SEQUENCES).steps(start, stop)
    expected = [t[start:stop].tolist() for t in SEQUENCES]
    assert sliced.lengths.tolist() == [len(e) for e in expected]
    assert [t.tolist() for t in sliced.unpadded()] == expected
    assert bool((sliced.data[~sliced.mask] == 0).all())  # the old last steps are padding now, reset to 0


def test_sequences_refuse_lengths_that_do_not_fit():
    with pytest.raises(ValueError, match=r"lengths must lie in \[0, 2\]"):
        Sequences(torch.zeros(2, 2), torch.tensor([1, 3]))
    with pytest.raises(ValueError, match="must have shape \\[2\\]"):
        Sequences(torch.zeros(2, 2), torch.tensor([1]))
    with pytest.raises(ValueError, match="different shapes"):
        Sequences.from_list([torch.zeros(2, 3), torch.zeros(2, 4)])


@pytest.mark.parametrize("text, name, start, stop, part", [
    ("text", "text", 0, None, None), ("text[1:]", "text", 1, None, None), ("text[:-1]", "text", 0, -1, None),
    ("src.mask", "src", 0, None, "mask"), ("tgt[1:].lengths", "tgt", 1, None, "lengths"), ("S0", "S0", 0, None, None),
])
def test_references_parse(text, name, start, stop, part):
    reference = StreamReference.parse(text)
    assert (reference.name, reference.start, reference.stop, reference.part) == (name, start, stop, part)


@pytest.mark.parametrize("text, message", [
    ("text[-1:]", "starts at a fixed step"), ("text.weights", "expected a stream name"), ("", "expected a stream name"),
    (3, "expected a stream name"), ("a b", "expected a stream name"),
])
def test_bad_references_are_refused_in_one_line(text, message):
    with pytest.raises(ValueError, match=message) as error:
        StreamReference.parse(text, "session.target")
    assert "\n" not in str(error.value) and "session.target" in str(error.value)


def test_stream_arrays_serve_sequences_and_values_by_index():
    data = StreamArrays({"text": [np.array([1, 2, 3]), np.array([4]), np.array([5, 6])], "label": np.array([0, 1, 0])},
                        num_classes={"text": 7, "label": 2})
    assert data.num_sequences == 3 and data.sequence_lengths("text").tolist() == [3, 1, 2]
    assert data.streams["text"].is_sequence and not data.streams["label"].is_sequence
    assert data.streams["text"].num_classes == 7 and data.streams["text"].dtype == torch.int64
    read = data.read(np.array([2, 0]))
    assert read["label"].tolist() == [0, 0]
    assert read["text"].data.tolist() == [[5, 6, 0], [1, 2, 3]] and read["text"].lengths.tolist() == [2, 3]


@pytest.mark.parametrize("streams, num_classes, message", [
    ({"text": [np.array([1]), np.array([], dtype=np.int64)]}, None, "sequence 1 is empty"),
    ({"text": [np.array([1]), np.array([2])], "label": np.array([0, 1, 2])}, None, "different numbers of sequences"),
    ({"text": [np.array([1, 9])]}, {"text": 5}, r"ids in \[1, 9\], outside its vocabulary \[0, 5\)"),
    ({"x": [np.zeros((2, 3)), np.zeros((2, 4))]}, None, "different shapes"),
    ({"x": np.array(2.0)}, None, "single number"),
])
def test_stream_arrays_refuse_bad_data_in_one_line(streams, num_classes, message):
    with pytest.raises(DataError, match=message) as error:
        StreamArrays(streams, num_classes=num_classes)
    assert "\n" not in str(error.value)


def test_npz_streams_round_trip_flat_sequences_and_values(tmp_path):
    tokens = [np.array([3, 1, 2]), np.array([4]), np.array([5, 5])]
    path = tmp_path / "corpus.npz"
    np.savez(path, text=np.concatenate(tokens), text_lengths=[3, 1, 2], label=np.array([1, 0, 1]))
    data = NpzStreams(str(path), sequences=["text"], num_classes={"text": 6})
    read = data.read(np.arange(3))
    assert [t.tolist() for t in read["text"].unpadded()] == [t.tolist() for t in tokens]
    assert read["label"].tolist() == [1, 0, 1]


def test_npz_streams_say_to_declare_a_flat_sequence_stream_left_out_of_sequences(tmp_path):
    path = tmp_path / "corpus.npz"
    np.savez(path, text=np.arange(6), text_lengths=[3, 1, 2])
    with pytest.raises(DataError, match=r"^.*corpus.npz: 'text' holds 6 steps that text_lengths splits into 3 sequences, "
                                        r"a sequence stream stored flat; expected it declared as one: "
                                        r"sequences=\['text'\] \(sequences: \[text\] in a config\)$"):
        NpzStreams(str(path))
    # a stream that merely has a companion of one value per sequence is read as before
    np.savez(path, text=np.arange(3), text_lengths=[3, 1, 2])
    assert NpzStreams(str(path)).num_sequences == 3


def test_a_slice_of_a_stream_not_declared_as_sequences_says_how_to_declare_it():
    from dtrain.data import StreamInfo

    steps = StreamInfo("digits", (7,), torch.int64)  # sample 0 held 7 digits: steps, if it was a sequence stream
    with pytest.raises(ValueError, match=r"^session.target='digits\[1:\]': 'digits' is declared with one value of shape "
                                         r"\[7\] per sample, so it has no steps to slice and no lengths or mask; if its "
                                         r"first dimension is steps \(samples of different lengths\), declare it a "
                                         r"sequence stream \(sequences=\['digits'\] of DatasetDeserializer or NpzStreams"):
        StreamReference.parse("digits[1:]").check_against(steps, ["digits"], "session.target")
    label = StreamInfo("label", (), torch.int64)  # one number per sample: it cannot be steps
    with pytest.raises(ValueError, match=r"'label' is not a sequence stream \(one value per sample\), so it has no steps "
                                         r"to slice and no lengths or mask; name it as 'label'$"):
        StreamReference.parse("label[1:]").check_against(label, ["label"], "session.target")


def test_npz_streams_name_the_file_and_what_is_missing(tmp_path):
    path = tmp_path / "corpus.npz"
    np.savez(path, text=np.arange(5), text_lengths=[2, 2])
    with pytest.raises(DataError, match="adds up to 4 steps but 'text' has 5"):
        NpzStreams(str(path), sequences=["text"])
    np.savez(path, text=np.arange(5))
    with pytest.raises(DataError, match="needs the arrays 'text'.*'text_lengths'"):
        NpzStreams(str(path), sequences=["text"])
    with pytest.raises(DataError, match="no such file"):
        NpzStreams(str(tmp_path / "missing.npz"))
