"""Composite sources: deserializers joined by sequence key (CNTK's composite reader), read through a
MinibatchSource with partitions and restores, and the source's state_dict()/load_state_dict()."""
from __future__ import annotations

import io
import warnings

import numpy as np
import pytest
import torch
from PIL import Image

import dtrain
from dtrain.data import (ArrayDeserializer, CompositeDeserializer, CTFDeserializer, DataError, ImageAugmentation,
                         ImageFolderDeserializer, MinibatchSource, StreamArrays)
from dtrain.data.deserializer import deserializer_identity

NUM_IMAGES = 12
LABEL_STREAMS = {"label": {"dim": 3, "format": "sparse", "ids": True}, "key": {"dim": 1}}


def _images(tmp_path, with_ids: bool):
    """Solid 4x4 images, image ``i`` of value ``10 * key`` and map-file label 0: the key is its seqId (a
    shuffled column) or its line index."""
    keys = np.random.default_rng(5).permutation(np.arange(100, 100 + NUM_IMAGES)) if with_ids else np.arange(NUM_IMAGES)
    lines = []
    for line, key in enumerate(keys):
        name = f"img{line}.png"
        Image.fromarray(np.full((4, 4, 3), (int(key) % 25) * 10, dtype=np.uint8)).save(tmp_path / name)
        lines.append(f"{key}\t{name}\t0" if with_ids else f"{name}\t0")
    (tmp_path / "map.txt").write_text("\n".join(lines) + "\n")
    return keys


def _label_file(tmp_path, keys, extra=()):
    """A CTF file of one class per key, ``label = key % 3`` and the key itself, in a shuffled order."""
    order = np.random.default_rng(9).permutation(len(keys))
    lines = [f"{keys[i]} |label {int(keys[i]) % 3}:1 |key {int(keys[i])}" for i in order]
    lines += [f"{key} |label 0:1 |key {key}" for key in extra]
    (tmp_path / "labels.ctf").write_text("\n".join(lines) + "\n")
    return CTFDeserializer(tmp_path / "labels.ctf", LABEL_STREAMS)


@pytest.mark.parametrize("with_ids", [False, True])
def test_images_and_a_ctf_label_file_join_by_key_in_every_minibatch(tmp_path, with_ids):
    keys = _images(tmp_path, with_ids)
    labels = _label_file(tmp_path, keys, extra=[999, 1000])  # keys the primary lacks are not read
    composite = CompositeDeserializer([ImageFolderDeserializer(tmp_path / "map.txt", num_threads=1), labels],
                                      names=[{"features": "image"}, None])
    assert composite.join == "key" and composite.num_sequences == NUM_IMAGES
    assert list(composite.streams) == ["image", "label", "key"]
    assert composite.benefits_from_read_ahead  # the images are decoded
    source = MinibatchSource(composite, randomization_seed=4, max_sweeps=2)
    assert source.read_ahead
    seen = []
    while (minibatch := source.next_minibatch(5, 2, 1)) is not None:
        image = minibatch["image"]
        assert image.dtype == torch.float32 and image.shape[1:] == (3, 4, 4)
        key = minibatch["key"][:, 0].long()
        assert torch.equal(image[:, 0, 0, 0].long(), (key % 25) * 10), "each image with its own key's row"
        assert torch.equal(minibatch["label"], key % 3)
        seen += key.tolist()
    assert len(seen) > 0 and set(seen) <= set(int(k) for k in keys)
    source.close()


def test_an_image_augmentation_applies_to_the_composites_features(tmp_path):
    keys = _images(tmp_path, with_ids=True)
    composite = CompositeDeserializer([ImageFolderDeserializer(tmp_path / "map.txt", num_threads=1),
                                       _label_file(tmp_path, keys)], names=[["features"], None])
    augmentation = ImageAugmentation(crop="randomside", side_ratio=0.5, output_size=[2, 2], flip=True)
    source = MinibatchSource(composite, randomization_seed=1, transform=augmentation, max_sweeps=1)
    count = 0
    while (minibatch := source.next_minibatch(5)) is not None:
        features, key = minibatch.features, minibatch["key"][:, 0].long()
        assert features.shape[1:] == (3, 2, 2)
        assert torch.equal(features[:, :, 0, 0].long(), ((key % 25) * 10)[:, None].expand(-1, 3))  # solid colours
        count += len(key)
    assert count == NUM_IMAGES


def _token_sequences(tmp_path):
    """Sequences under string keys (``s0``...): sequence ``k`` holds ``k % 4 + 1`` steps of the token ``k``; and a
    per-sequence label file, reversed, whose label of ``sk`` is ``k``."""
    lines = [f"s{k} |tok {k}:1" for k in range(10) for _ in range(k % 4 + 1)]
    (tmp_path / "seq.ctf").write_text("\n".join(lines) + "\n")
    (tmp_path / "cls.ctf").write_text("\n".join(f"s{k} |cls {k}:1" for k in reversed(range(10))) + "\n")
    sequences = CTFDeserializer(tmp_path / "seq.ctf", {"tok": {"dim": 10, "format": "sparse", "ids": True,
                                                                "sequence": True}})
    classes = CTFDeserializer(tmp_path / "cls.ctf", {"cls": {"dim": 10, "format": "sparse", "ids": True}})
    return sequences, classes


def test_ctf_sequences_joined_with_a_per_sequence_label_file(tmp_path):
    sequences, classes = _token_sequences(tmp_path)
    assert sequences.sequence_keys()[:2] == ["s0", "s1"] and classes.sequence_keys()[0] == "s9"
    composite = CompositeDeserializer([sequences, classes])
    assert composite.defining_stream == "tok" and composite.streams["tok"].is_sequence
    assert composite.sequence_lengths("tok").tolist() == [k % 4 + 1 for k in range(10)]
    source = MinibatchSource(composite, randomization_seed=2, max_sweeps=1)
    read = []
    while (minibatch := source.next_minibatch(6)) is not None:
        tokens, label = minibatch["tok"], minibatch["cls"]
        assert torch.equal(tokens.data[:, 0], label) and torch.equal(tokens.lengths, label % 4 + 1)
        read += label.tolist()
    assert sorted(read) == list(range(10))


def _keyed_arrays(size=40):
    """Two in-memory deserializers whose sequences match by explicit keys in different orders; ``y`` is ``x``'s twin."""
    generator = np.random.default_rng(1)
    primary_keys = generator.permutation(size) * 7
    order = generator.permutation(size)
    lengths = 1 + np.arange(size) % 3
    primary = StreamArrays({"x": [np.full(length, key, dtype=np.int64) for key, length in zip(primary_keys, lengths)]})
    secondary = StreamArrays({"y": primary_keys[order].astype(np.float32)})
    return CompositeDeserializer([primary, secondary], keys=[primary_keys.tolist(), primary_keys[order]])


def _sources(count, **options):
    """One source per partition, as every rank builds its own."""
    return [MinibatchSource(_keyed_arrays(), **options) for _ in range(count)]


def _global_stream(sources, minibatches):
    """The first steps of x of the next global minibatches in timeline order (partition ``k`` reads from
    ``sources[k]``; shares of sequences are dealt by steps, so their union is put back in position order); each
    share's y is its x."""
    out = []
    for _ in range(minibatches):
        shares = [source.next_minibatch(9, len(sources), index) for index, source in enumerate(sources)]
        x = torch.cat([share["x"].data[:, :1].flatten() for share in shares])
        assert torch.equal(x.float(), torch.cat([share["y"] for share in shares]))
        positions = torch.from_numpy(np.concatenate([share.positions for share in shares]))
        out.append(x[torch.argsort(positions)].tolist())
    return out


@pytest.mark.parametrize("partitions, restored_at", [(2, 3), (2, 1)])
def test_exactly_once_per_sweep_across_partitions_and_a_restore_at_another_count(partitions, restored_at):
    sources = _sources(partitions, randomization_seed=11, max_sweeps=1)
    shares = [[] for _ in range(partitions)]
    while True:
        read = [source.next_minibatch(9, partitions, index) for index, source in enumerate(sources)]
        if read[0] is None:
            assert all(minibatch is None for minibatch in read)
            break
        for index, minibatch in enumerate(read):
            assert torch.equal(minibatch["x"].data[:, :1].flatten().float(), minibatch["y"])
            shares[index] += minibatch["y"].long().tolist()
    assert shares[0] and shares[1]
    every = sum(shares, [])
    assert sorted(every) == [7 * key for key in range(40)]  # every sequence once in the sweep

    first = _sources(partitions, randomization_seed=11)
    _global_stream(first, 3)
    state = first[0].state_dict()
    assert all(source.state_dict() == state for source in first)  # the position is global: one state for all ranks
    expected = _global_stream(first, 4)
    again = _sources(restored_at, randomization_seed=11)
    for source in again:
        source.load_state_dict(state)
    assert _global_stream(again, 4) == expected


def test_state_dict_is_the_checkpoint_state_and_resumes_the_same_minibatches(tmp_path):
    from torch.distributed.checkpoint.stateful import Stateful

    [first] = _sources(1, randomization_seed=3, length_bucketing=4)
    assert isinstance(first, Stateful)
    _global_stream([first], 2)
    state = first.state_dict()
    assert state == first.get_checkpoint_state() and state["position"] > 0
    expected = _global_stream([first], 3)
    for restore in ("load_state_dict", "restore_from_checkpoint"):
        resumed = _sources(1, randomization_seed=3, length_bucketing=4)
        getattr(resumed[0], restore)(state)
        assert _global_stream(resumed, 3) == expected
    with pytest.raises(ValueError, match="seed 3 but this source has randomization_seed 4"):
        _sources(1, randomization_seed=4, length_bucketing=4)[0].load_state_dict(state)

    # torch.distributed.checkpoint carries it as a Stateful (one process, no process group)
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming the intent is to save in a single process"
        dcp.save({"source": first}, checkpoint_id=tmp_path / "dcp")
        resumed = _sources(1, randomization_seed=3, length_bucketing=4)
        dcp.load({"source": resumed[0]}, checkpoint_id=tmp_path / "dcp")
    assert resumed[0].state_dict() == first.state_dict()
    assert _global_stream(resumed, 2) == _global_stream([first], 2)


def test_two_stream_deserializers_join_by_index_and_train_in_a_session(tmp_path):
    generator = np.random.default_rng(0)
    x = generator.normal(size=(64, 4)).astype(np.float32)
    features = ArrayDeserializer(x, (x[:, 0] > 0).astype(np.int64))  # its labels are left out below
    targets = StreamArrays({"target": (x[:, :1] * 2).astype(np.float32)})
    composite = CompositeDeserializer([features, targets], names=[["features"], None])
    assert composite.join == "index" and list(composite.streams) == ["features", "target"]
    assert composite.values_finite is True  # both checked once when made
    identity = composite.checkpoint_identity()
    assert identity["parts"][0] == deserializer_identity(features, {}) and identity["names"][0] == {"features": "features"}
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    session = dtrain.training_session(model, dtrain.session.MSELoss(), dtrain.LocalLearner(torch.optim.SGD(model.parameters(),
                                                                                                        lr=0.1)),
                                      MinibatchSource(composite, randomization_seed=1), 16, max_samples=640,
                                      target="target", metric=dtrain.session.MeanAbsoluteError(), run_dir=tmp_path, tensorboard=False, stream=io.StringIO())
    session.train()
    assert abs(model.weight[0, 0].item() - 2) < 0.2


def test_prefetch_is_passed_on_at_each_deserializers_own_sequences():
    class Hinted(StreamArrays):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.hints = []

        def prefetch(self, indices):
            self.hints.append(np.asarray(indices).tolist())

    primary = StreamArrays({"x": np.arange(5, dtype=np.float32)})
    secondary = Hinted({"y": np.arange(5, dtype=np.float32)})
    composite = CompositeDeserializer([primary, secondary], keys=[[1, 2, 3, 4, 5], [5, 4, 3, 2, 1]])
    composite.prefetch(np.array([0, 4]))
    assert secondary.hints == [[4, 0]]
    assert not hasattr(CompositeDeserializer([primary, primary], names=[["x"], {"x": "z"}]), "prefetch")


def _arrays(size, name="x"):
    return StreamArrays({name: np.arange(size, dtype=np.float32)})


@pytest.mark.parametrize("make, error, message", [
    (lambda: CompositeDeserializer([_arrays(3), _arrays(3, "y")], keys=[[1, 2, 3], [3, 1, 4]]), DataError,
     r"key 2 \(sequence 1 of deserializer 0 \(StreamArrays\), the primary\) is not in deserializer 1 \(StreamArrays\)"),
    (lambda: CompositeDeserializer([_arrays(3), _arrays(3, "y")], keys=[["a", "b", "c"], ["c", "a", "c"]]), DataError,
     r"deserializer 1 \(StreamArrays\) has key 'c' twice \(sequences 0 and 2\)"),
    (lambda: CompositeDeserializer([_arrays(3), _arrays(3)]), ValueError,
     r"stream 'x' is served by deserializer 0 \(StreamArrays\) and deserializer 1 \(StreamArrays\)"),
    (lambda: CompositeDeserializer([_arrays(3), _arrays(4, "y")]), ValueError,
     r"different sizes \(deserializer 0 \(StreamArrays\) 3, deserializer 1 \(StreamArrays\) 4 sequences\).*has no "
     r"sequence_keys\(\)"),
    (lambda: CompositeDeserializer([]), ValueError, r"non-empty list of deserializers.*got \[\]"),
    (lambda: CompositeDeserializer([_arrays(3), _arrays(3, "y")], keys="key"), ValueError,
     r"deserializer 0 \(StreamArrays\) has no sequence_keys\(\)"),
    (lambda: CompositeDeserializer([_arrays(3), _arrays(3, "y")], keys=[[1, 2], None]), ValueError,
     r"deserializer 0 \(StreamArrays\) has 3 sequences but 2 keys"),
    (lambda: CompositeDeserializer([_arrays(3), _arrays(3, "y")], names=[{"z": "w"}, None]), ValueError,
     r"names\[0\] names stream 'z', which deserializer 0 \(StreamArrays\) does not have"),
    (lambda: CompositeDeserializer([_arrays(3), _arrays(3, "y")], keys=[[1.5, 2, 3], None]), TypeError,
     r"must be str or int keys, got float64"),
])
def test_bad_composites_are_refused_in_one_line(make, error, message):
    with pytest.raises(error, match=message) as caught:
        make()
    assert "\n" not in str(caught.value)


def test_a_missing_key_of_a_ctf_file_is_named_with_its_file_and_count(tmp_path):
    keys = _images(tmp_path, with_ids=False)
    labels = _label_file(tmp_path, keys[:-2])
    with pytest.raises(DataError, match=r"^key 10 \(sequence 10 of deserializer 0 \(ImageFolderDeserializer \S+map.txt\), "
                                        r"the primary\) is not in deserializer 1 \(CTFDeserializer \S+labels.ctf\) "
                                        r"\(2 keys missing"):
        CompositeDeserializer([ImageFolderDeserializer(tmp_path / "map.txt", num_threads=1), labels],
                              names=[["features"], None])
