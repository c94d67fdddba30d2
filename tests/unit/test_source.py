"""MinibatchSource: partitioned reading, limits, determinism and checkpoint/restore."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dtrain.data import ArrayDeserializer, DataError, ImageTransform, Minibatch, MinibatchSource


def make_deserializer(num_samples: int) -> ArrayDeserializer:
    """Sample i has features [i, -i] and label i % 3, so tests can tell which sample they got."""
    ids = np.arange(num_samples)
    features = np.stack([ids, -ids], axis=1).astype(np.int32)
    return ArrayDeserializer(features, ids % 3, num_classes=3)


def sample_ids(minibatch: Minibatch) -> list[int]:
    return minibatch.features[:, 0].to(torch.int64).tolist()


def read_in_lock_step(sources: list[MinibatchSource], minibatch_size: int, max_calls: int = 10_000):
    """Call next_minibatch on every partition's source in turn, like ranks do, until all return
    None (or max_calls). Returns one list of per-partition minibatches per call."""
    calls = []
    for _ in range(max_calls):
        per_partition = [
            source.next_minibatch(minibatch_size, len(sources), index)
            for index, source in enumerate(sources)
        ]
        if per_partition[0] is None:
            assert all(minibatch is None for minibatch in per_partition), "partitions disagree on the end"
            return calls
        assert all(minibatch is not None for minibatch in per_partition), "partitions disagree on the end"
        calls.append(per_partition)
    return calls


@pytest.mark.parametrize("num_samples", [5, 23, 64])
@pytest.mark.parametrize("seed", [0, 7])
@pytest.mark.parametrize("num_partitions", [1, 2, 3, 8])
@pytest.mark.parametrize("minibatch_size", [1, 6, 16])
def test_max_sweeps_reads_every_sample_exactly_once_per_sweep(num_samples, seed, num_partitions, minibatch_size):
    max_sweeps = 2
    sources = [
        MinibatchSource(make_deserializer(num_samples), randomization_seed=seed, max_sweeps=max_sweeps)
        for _ in range(num_partitions)
    ]
    calls = read_in_lock_step(sources, minibatch_size)
    ids_by_sweep = [[] for _ in range(max_sweeps)]
    for per_partition in calls:
        global_sizes = {minibatch.global_num_samples for minibatch in per_partition}
        assert len(global_sizes) == 1
        assert sum(minibatch.num_samples for minibatch in per_partition) == global_sizes.pop()
        local_sizes = [minibatch.num_samples for minibatch in per_partition]
        assert max(local_sizes) - min(local_sizes) <= 1
        for minibatch in per_partition:
            assert minibatch.features.dtype == torch.float32
            assert minibatch.features.shape == (minibatch.num_samples, 2)
            assert minibatch.labels.dtype == torch.int64
            assert minibatch.labels.tolist() == [i % 3 for i in sample_ids(minibatch)]
            for position, sample in zip(minibatch.positions, sample_ids(minibatch)):
                ids_by_sweep[position // num_samples].append(sample)
    for ids in ids_by_sweep:
        assert sorted(ids) == list(range(num_samples))
    # With max_sweeps the minibatches stop at the limit and flag each sweep's end.
    assert all(source.current_position == max_sweeps * num_samples for source in sources)
    # sweep_end flags exactly the global minibatches holding a sweep's last position.
    for per_partition in calls:
        positions = np.concatenate([minibatch.positions for minibatch in per_partition])
        holds_sweep_end = bool(np.any(positions % num_samples == num_samples - 1))
        assert [minibatch.sweep_end for minibatch in per_partition] == [holds_sweep_end] * num_partitions
    assert calls[-1][0].sweep_end


def test_randomized_sweeps_differ_and_unrandomized_reads_in_order():
    source = MinibatchSource(make_deserializer(20), randomize=True, randomization_seed=3)
    first, second = (sample_ids(source.next_minibatch(20)) for _ in range(2))
    assert sorted(first) == sorted(second) == list(range(20))
    assert first != second and first != list(range(20))
    in_order = MinibatchSource(make_deserializer(20), randomize=False)
    assert sample_ids(in_order.next_minibatch(15)) == list(range(15))
    spanning = in_order.next_minibatch(10)  # unlimited sweeps: may span the boundary
    assert sample_ids(spanning) == [15, 16, 17, 18, 19, 0, 1, 2, 3, 4]
    assert spanning.sweep_end and spanning.positions.tolist() == list(range(15, 25))


def test_same_seed_same_stream_and_other_seed_other_stream():
    def stream(seed):
        source = MinibatchSource(make_deserializer(30), randomization_seed=seed)
        return [sample_ids(source.next_minibatch(7)) for _ in range(10)]

    assert stream(4) == stream(4)
    assert stream(4) != stream(5)


def test_partitioned_stream_equals_single_partition_stream():
    single = MinibatchSource(make_deserializer(31), randomization_seed=2, max_samples=100)
    reference = [sample_ids(minibatch) for minibatch in iter(lambda: single.next_minibatch(12), None)]
    sources = [MinibatchSource(make_deserializer(31), randomization_seed=2, max_samples=100) for _ in range(3)]
    partitioned = [
        sum((sample_ids(minibatch) for minibatch in per_partition), [])
        for per_partition in read_in_lock_step(sources, 12)
    ]
    assert partitioned == reference


@pytest.mark.parametrize("max_samples, minibatch_size, expected_sizes", [
    (0, 4, []),
    (10, 4, [4, 4, 2]),
    (12, 4, [4, 4, 4]),
    (3, 8, [3]),
    (45, 20, [20, 20, 5]),  # over two sweeps of 23
])
def test_max_samples_stops_exactly(max_samples, minibatch_size, expected_sizes):
    sources = [MinibatchSource(make_deserializer(23), max_samples=max_samples) for _ in range(2)]
    calls = read_in_lock_step(sources, minibatch_size)
    assert [per_partition[0].global_num_samples for per_partition in calls] == expected_sizes
    assert sources[0].current_position == max_samples
    assert sources[0].next_minibatch(minibatch_size, 2, 0) is None  # stays exhausted


def test_small_minibatch_gives_empty_shares_but_same_number_of_calls():
    sources = [MinibatchSource(make_deserializer(5), max_sweeps=1) for _ in range(4)]
    calls = read_in_lock_step(sources, 2)
    assert len(calls) == 3  # sizes 2, 2, 1
    empty = [minibatch for per_partition in calls for minibatch in per_partition if minibatch.num_samples == 0]
    assert empty, "4 partitions of a 2-sample minibatch must leave some shares empty"
    for minibatch in empty:
        assert minibatch.features.shape == (0, 2) and minibatch.labels.shape == (0,)
        assert minibatch.positions.shape == (0,)


def test_max_sweeps_zero_reads_nothing():
    assert MinibatchSource(make_deserializer(5), max_sweeps=0).next_minibatch(4) is None


@pytest.mark.parametrize("num_partitions_after", [1, 2, 3])
def test_restore_reproduces_the_stream_on_any_partition_count(num_partitions_after):
    transform = ImageTransform(crop_side_ratio=0.75, flip=True)
    images = np.random.default_rng(0).integers(0, 256, size=(37, 3, 8, 8), dtype=np.uint8)
    deserializer = ArrayDeserializer(images, np.arange(37) % 4)

    def new_source():
        return MinibatchSource(deserializer, randomization_seed=11, max_samples=200, transform=transform)

    original = new_source()
    for _ in range(5):
        original.next_minibatch(9, 2, 0)
    state = original.get_checkpoint_state()
    assert state == {"position": 45, "seed": 11, "samples_per_sweep": 37, "randomize": True}
    assert all(type(value) in (int, bool) for value in state.values())
    expected = [original.next_minibatch(9) for _ in range(30)]
    expected = [minibatch for minibatch in expected if minibatch is not None]

    restored = [new_source() for _ in range(num_partitions_after)]
    for source in restored:
        source.restore_from_checkpoint(dict(state))
        assert source.current_position == 45
    calls = read_in_lock_step(restored, 9)
    assert len(calls) == len(expected)
    for per_partition, reference in zip(calls, expected):
        torch.testing.assert_close(
            torch.cat([minibatch.features for minibatch in per_partition]), reference.features, rtol=0, atol=0
        )
        assert torch.equal(torch.cat([minibatch.labels for minibatch in per_partition]), reference.labels)
        assert np.array_equal(np.concatenate([m.positions for m in per_partition]), reference.positions)


@pytest.mark.parametrize("change, message", [
    ({"seed": 12}, "seed 12 but this source has randomization_seed 11"),
    ({"samples_per_sweep": 36}, "samples_per_sweep 36"),
    ({"randomize": False}, "randomize=False"),
])
def test_restore_rejects_a_state_from_another_stream(change, message):
    source = MinibatchSource(make_deserializer(37), randomization_seed=11)
    state = source.get_checkpoint_state() | change
    with pytest.raises(ValueError, match=message):
        MinibatchSource(make_deserializer(37), randomization_seed=11).restore_from_checkpoint(state)


def test_restore_rejects_malformed_states():
    source = MinibatchSource(make_deserializer(5))
    with pytest.raises(ValueError, match="missing"):
        source.restore_from_checkpoint({"position": 3})
    with pytest.raises(ValueError, match="unknown"):
        source.restore_from_checkpoint(source.get_checkpoint_state() | {"epoch": 1})
    with pytest.raises(ValueError, match="position"):
        source.restore_from_checkpoint(source.get_checkpoint_state() | {"position": -1})
    with pytest.raises(TypeError):
        source.restore_from_checkpoint([("position", 3)])


def test_transform_gets_setup_and_is_applied_with_positions_and_seed():
    calls = []

    class RecordingTransform:
        def setup(self, deserializer):
            calls.append(("setup", deserializer.num_samples))

        def __call__(self, features, positions, seed):
            calls.append(("call", positions.tolist(), seed))
            return features.to(torch.float32) * 2

    source = MinibatchSource(make_deserializer(6), randomize=False, randomization_seed=5,
                             transform=RecordingTransform())
    minibatch = source.next_minibatch(4, 2, 1)
    assert calls == [("setup", 6), ("call", [2, 3], 5)]
    assert minibatch.features[:, 0].tolist() == [4.0, 6.0]


def test_transform_must_return_float32():
    source = MinibatchSource(make_deserializer(6), transform=lambda features, positions, seed: features)
    with pytest.raises(TypeError, match="float32"):
        source.next_minibatch(2)


@pytest.mark.parametrize("kwargs, error, message", [
    ({"max_samples": 10, "max_sweeps": 1}, ValueError, "max_samples .* max_sweeps .* mutually exclusive"),
    ({"max_samples": -1}, ValueError, "max_samples must be >= 0, got -1"),
    ({"max_sweeps": 1.5}, TypeError, "max_sweeps must be an int"),
    ({"randomization_seed": -3}, ValueError, "randomization_seed must be >= 0, got -3"),
    ({"randomize": 1}, TypeError, "randomize must be a bool"),
    ({"transform": "crop"}, TypeError, "transform must be callable"),
])
def test_constructor_validates_arguments(kwargs, error, message):
    with pytest.raises(error, match=message):
        MinibatchSource(make_deserializer(5), **kwargs)


def test_constructor_rejects_a_non_deserializer():
    with pytest.raises(TypeError, match="deserializer must have"):
        MinibatchSource(np.zeros((3, 2)))


@pytest.mark.parametrize("args, error, message", [
    ((0,), ValueError, "minibatch_size_in_samples must be >= 1, got 0"),
    ((4, 0), ValueError, "num_data_partitions must be >= 1, got 0"),
    ((4, 2, 2), ValueError, r"partition_index must be < num_data_partitions \(2\), got 2"),
    ((4, 2, -1), ValueError, "partition_index must be >= 0"),
    ((4.0,), TypeError, "minibatch_size_in_samples must be an int"),
])
def test_next_minibatch_validates_arguments(args, error, message):
    with pytest.raises(error, match=message):
        MinibatchSource(make_deserializer(5)).next_minibatch(*args)


def test_array_deserializer_validates_inputs():
    with pytest.raises(ValueError, match="same length"):
        ArrayDeserializer(np.zeros((4, 2)), np.zeros(3, dtype=np.int64))
    with pytest.raises(TypeError, match="labels must be integers"):
        ArrayDeserializer(np.zeros((4, 2)), np.zeros(4, dtype=bool))
    with pytest.raises(TypeError, match="num_classes=3 applies to integer class labels"):
        ArrayDeserializer(np.zeros((4, 2)), np.zeros(4), num_classes=3)  # float labels are regression targets
    with pytest.raises(ValueError, match=r"labels must lie in \[0, num_classes=2\)"):
        ArrayDeserializer(np.zeros((4, 2)), np.array([0, 1, 2, 1]), num_classes=2)
    with pytest.raises(ValueError, match="num_samples >= 1"):
        ArrayDeserializer(np.zeros((0, 2)), np.zeros(0, dtype=np.int64))
    with pytest.raises(TypeError, match="numpy array or torch tensor"):
        ArrayDeserializer([[0.0]], [0])
    deserializer = ArrayDeserializer(torch.arange(12.0).view(4, 3), torch.tensor([0, 1, 1, 0]))
    assert (deserializer.num_samples, deserializer.feature_shape, deserializer.num_classes) == (4, (3,), 2)
    torch.testing.assert_close(deserializer.mean_image(), torch.tensor([4.5, 5.5, 6.5]))


# -- read-ahead: the next minibatch is read in the background, and the stream does not change ---------


def _read_stream(source: MinibatchSource, plan) -> list[Minibatch | None]:
    """Reads ``plan``: (size, partitions, index) requests, ("checkpoint",), ("restore", k) back to checkpoint k."""
    out, saved = [], []
    for step in plan:
        if step[0] == "checkpoint":
            saved.append(source.get_checkpoint_state())
        elif step[0] == "restore":
            source.restore_from_checkpoint(saved[step[1]])
        else:
            out.append(source.next_minibatch(*step))
    return out


_PLAN = [(8, 1, 0), (8, 1, 0), ("checkpoint",), (8, 1, 0), (8, 2, 1), (8, 2, 1), (6, 2, 1), (6, 3, 0),
         ("restore", 0), (8, 1, 0), (8, 1, 0), ("checkpoint",), (8, 2, 0), (8, 2, 0), (8, 2, 0), (8, 2, 0),
         ("restore", 1), (8, 3, 2), (8, 3, 2), (8, 3, 2)]


def _assert_same_stream(with_read_ahead, without) -> None:
    assert len(with_read_ahead) == len(without)
    for a, b in zip(with_read_ahead, without):
        assert (a is None) == (b is None)
        if a is not None:
            assert torch.equal(a.features, b.features) and torch.equal(a.labels, b.labels)
            assert np.array_equal(a.positions, b.positions)
            assert (a.global_num_samples, a.sweep_end) == (b.global_num_samples, b.sweep_end)


def test_read_ahead_stream_equals_the_plain_stream_across_restore_and_repartitioning(tmp_path):
    from dtrain.testing.image_files import write_image_map_files

    from dtrain.data import ImageAugmentation, ImageFolderDeserializer

    map_file, _ = write_image_map_files(tmp_path, num_train=20, num_val=1, size=(24, 24), formats=("jpg",))

    def source(read_ahead):
        return MinibatchSource(ImageFolderDeserializer(map_file, num_threads=2), randomization_seed=5, max_sweeps=3,
                               read_ahead=read_ahead,
                               transform=ImageAugmentation(crop="randomarea", area_ratio=[0.3, 1.0], output_size=[16, 16],
                                                           flip=True, brightness=0.3))

    assert source(None).read_ahead  # on by default for decoded image files
    plan = _PLAN + [(16, 2, 1)] * 6  # and on to the end of the last sweep
    _assert_same_stream(_read_stream(source(True), plan), _read_stream(source(False), plan))


class _RecordingDeserializer(ArrayDeserializer):
    """Records which thread read which indices."""

    def __init__(self, num_samples: int):
        ids = np.arange(num_samples)
        super().__init__(np.stack([ids, -ids], axis=1).astype(np.int32), ids % 3, num_classes=3)
        self.reads: list[tuple[str, list[int]]] = []

    def get(self, indices):
        import threading

        self.reads.append((threading.current_thread().name, list(indices)))
        return super().get(indices)


def test_read_ahead_reads_the_next_request_in_the_background_and_discards_a_mismatch():
    deserializer = _RecordingDeserializer(40)
    source = MinibatchSource(deserializer, randomize=False, read_ahead=True)
    _assert_same_stream(_read_stream(source, _PLAN),
                        _read_stream(MinibatchSource(make_deserializer(40), randomize=False), _PLAN))
    threads = [name for name, _ in deserializer.reads]
    assert threads[0] == "MainThread" and threads[1].startswith("dtrain-read-ahead")
    assert sum(name.startswith("dtrain-read-ahead") for name in threads) >= 8
    assert len(threads) > len([step for step in _PLAN if len(step) == 3])  # discarded reads were redone
    source.close()
    assert not MinibatchSource(make_deserializer(10)).read_ahead  # in-memory arrays: off by default


def test_float_labels_keep_their_values_and_dtype_through_the_source():
    targets = np.array([0.25, -1.5, 3.0, 0.75], dtype=np.float32)
    deserializer = ArrayDeserializer(np.arange(8.0).reshape(4, 2), targets)
    assert deserializer.num_classes is None
    minibatch = MinibatchSource(deserializer, randomize=False).next_minibatch(4)
    assert minibatch.labels.dtype == torch.float32 and minibatch.labels.tolist() == targets.tolist()
    two_outputs = ArrayDeserializer(np.zeros((3, 2)), np.array([[0.5, 1.0], [0.25, 2.0], [1.5, 0.125]]))
    assert MinibatchSource(two_outputs, randomize=False).next_minibatch(2).labels.dtype == torch.float64
    classes = MinibatchSource(ArrayDeserializer(np.zeros((3, 2)), np.array([0, 2, 1], dtype=np.int32)))
    assert classes.next_minibatch(3).labels.dtype == torch.int64  # class indices: int64, as the losses want


class _GetOnly:
    """The same data with ``get`` alone, so the source builds index arrays instead of calling ``take``."""

    def __init__(self, deserializer: ArrayDeserializer):
        self.inner, self.num_samples = deserializer, deserializer.num_samples
        self.feature_shape, self.num_classes = deserializer.feature_shape, deserializer.num_classes

    def get(self, indices):
        return self.inner.get(indices)


@pytest.mark.parametrize("randomize", [True, False])
def test_reading_by_index_tensor_gives_the_stream_of_index_arrays(randomize):
    # minibatches of 7 over sweeps of 23 on 3 partitions: inside sweeps, across their ends, and empty shares
    kinds = [make_deserializer(23), _GetOnly(make_deserializer(23))]
    sources = [[MinibatchSource(kind, randomize=randomize, randomization_seed=5, max_sweeps=4)
                for _ in range(3)] for kind in kinds]
    by_tensor, by_array = (read_in_lock_step(partitions, 7) for partitions in sources)
    assert len(by_tensor) == len(by_array) == 14
    assert [[sample_ids(minibatch) for minibatch in call] for call in by_tensor] == \
        [[sample_ids(minibatch) for minibatch in call] for call in by_array]
    assert [[minibatch.labels.tolist() for minibatch in call] for call in by_tensor] == \
        [[minibatch.labels.tolist() for minibatch in call] for call in by_array]


@pytest.mark.parametrize("bad, named", [(float("nan"), "NaN"), (float("inf"), "an infinite value"),
                                        (-float("inf"), "an infinite value")])
def test_a_sample_holding_nan_or_inf_is_named_when_its_minibatch_is_read(bad, named):
    features = np.random.default_rng(0).normal(size=(40, 3)).astype(np.float32)
    features[23, 1] = bad
    source = MinibatchSource(ArrayDeserializer(features, np.arange(40) % 3, num_classes=3), randomization_seed=4)
    position = int(np.argsort(source._timeline.indices(0, 40))[23])  # where sample 23 comes in the first sweep
    with pytest.raises(DataError, match=rf"^stream 'features': sample 23 of ArrayDeserializer \(timeline position "
                                        rf"{position}\) holds {named}; expected finite numbers"):
        for _ in range(40):
            source.next_minibatch(5, 2, 1 if position % 5 >= 2 else 0)  # the partition that reads it


def test_finite_values_whose_sum_overflows_are_not_refused():
    features = np.full((8, 2), np.finfo(np.float32).max, dtype=np.float32)
    source = MinibatchSource(ArrayDeserializer(features, np.zeros(8, dtype=np.int64), num_classes=1), randomize=False)
    assert source.next_minibatch(8).features.shape == (8, 2)


def test_in_memory_arrays_are_checked_for_nan_once_and_float64_beyond_float32_is_still_named_when_read():
    finite = ArrayDeserializer(np.ones((8, 2), dtype=np.float32), np.arange(8) % 2, num_classes=2)
    assert finite.values_finite is True  # the source then skips the per-minibatch check
    with_nan = np.ones((8, 2), dtype=np.float32)
    with_nan[3, 0] = np.nan
    assert ArrayDeserializer(with_nan, np.arange(8) % 2, num_classes=2).values_finite is False
    huge = np.ones((8, 2), dtype=np.float64)
    huge[5, 1] = 1e39  # finite in float64, infinite as the float32 the source serves
    source = MinibatchSource(ArrayDeserializer(huge, np.arange(8) % 2, num_classes=2), randomize=False)
    with pytest.raises(DataError, match=r"sample 5 of ArrayDeserializer .* holds an infinite value"):
        source.next_minibatch(8)


def test_in_memory_streams_are_checked_once_and_a_sequence_holding_nan_is_named_when_read():
    from dtrain.data import StreamArrays

    steps = [np.ones((length, 2), dtype=np.float32) for length in (3, 1, 4, 2)]
    finite = StreamArrays({"x": steps, "y": np.arange(4) % 2}, num_classes={"y": 2})
    assert finite.values_finite is True  # the source then skips the per-minibatch check
    steps[2][3, 1] = np.nan  # the last step of sequence 2
    with_nan = StreamArrays({"x": steps, "y": np.arange(4) % 2}, num_classes={"y": 2})
    assert with_nan.values_finite is False
    source = MinibatchSource(with_nan, randomize=False, defining_stream="x")
    with pytest.raises(DataError, match=r"^stream 'x': sequence 2 of StreamArrays \(timeline position 2\) holds NaN; "
                                        r"expected finite numbers"):
        source.next_minibatch(10)
    sparse = StreamArrays({"x": torch.eye(4).to_sparse(), "y": np.arange(4) % 2})
    assert sparse.values_finite is None  # left to the per-minibatch check, which reads a sparse stream too


def test_memory_mapped_streams_are_not_read_whole_to_check_them_but_as_minibatches_are_read(tmp_path):
    from dtrain.data import StreamArrays

    mapped = np.lib.format.open_memmap(tmp_path / "x.npy", mode="w+", dtype=np.float32, shape=(8, 2))
    mapped[:] = 1
    mapped[6, 0] = np.inf
    streams = StreamArrays({"x": mapped, "y": np.arange(8) % 2}, num_classes={"y": 2})
    assert streams.values_finite is None
    with pytest.raises(DataError, match=r"^stream 'x': sample 6 of StreamArrays \(timeline position 6\) holds an "
                                        r"infinite value"):
        MinibatchSource(streams, randomize=False).next_minibatch(8)


def test_a_transform_making_nan_is_named_over_data_checked_once():
    """A transform's output (dtrain's augmentation, DALI's CPU pipeline) is checked as read, whatever the data."""
    data = ArrayDeserializer(np.ones((8, 2), dtype=np.float32), np.arange(8) % 2, num_classes=2)
    assert data.values_finite is True

    def transform(features, positions, seed):
        return features / torch.as_tensor(positions != 5, dtype=torch.float32)[:, None] * 0  # 0/0 at position 5

    source = MinibatchSource(data, randomize=False, transform=transform)
    with pytest.raises(DataError, match=r"^stream 'features': sample 5 of ArrayDeserializer \(timeline position 5\) "
                                        r"holds NaN"):
        source.next_minibatch(8)
