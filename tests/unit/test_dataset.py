"""DatasetDeserializer: any map-style torch Dataset as named streams, read with or without workers."""
from __future__ import annotations

import multiprocessing
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset, IterableDataset, TensorDataset

import dtrain.data._dataset_workers as workers_module
import dtrain.data.dataset as dataset_module
from dtrain.data import DataError, MinibatchSource, Sequences
from dtrain.data.dataset import DatasetDeserializer
from tests.helpers.mpi import process_ended

WORKERS = [{"num_workers": 2, "worker_type": "thread"}, {"num_workers": 2, "worker_type": "process"}]


class Tokens(Dataset):
    """Sample ``i``: a sequence of ``i % 5 + 1`` token ids (``text``), a vector, an image of 40 kB (so that
    worker processes send chunks of two or more through their shared-memory arenas) and a label."""

    def __init__(self, size: int = 23):
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict:
        return {"text": (torch.arange(index % 5 + 1) * 7 + index) % 50, "vector": np.full(3, index / 4),
                "image": np.random.default_rng(index).random((100, 100), dtype=np.float32), "label": index % 3}


class Failing(Dataset):
    """Like a TensorDataset of ``size`` samples, but ``__getitem__(bad)`` raises (or the worker exits); ``bad``
    may be a set of indices."""

    def __init__(self, bad: int | set, exit_code: int | None = None, size: int = 8):
        self.bad = {bad} if isinstance(bad, int) else set(bad)
        self.exit_code, self.size, self.creator = exit_code, size, os.getpid()

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int):
        if index in self.bad:
            if self.exit_code is not None and os.getpid() != self.creator:
                os._exit(self.exit_code)  # a worker process dies (a crash in native code, the OOM killer)
            raise FileNotFoundError(f"no file for\nsample {index}")
        return torch.full((2,), float(index)), index


class Counted(Dataset):
    """Sample ``i``: ``(an image of 40 kB keyed by i, i)``; counts the calls of ``__getitem__`` in every thread
    and (forked) worker process."""

    def __init__(self, size: int = 24):
        self.size, self.calls = size, multiprocessing.Value("i", 0)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int):
        with self.calls.get_lock():
            self.calls.value += 1
        return torch.from_numpy(np.random.default_rng(index).random((100, 100), dtype=np.float32)), index


class Listed(Dataset):
    """The samples of a list, as they are."""

    def __init__(self, samples: list):
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int):
        return self.samples[index]


def read_sweeps(source: MinibatchSource, minibatch_size: int, partitions: int, index: int) -> list:
    minibatches = []
    while (minibatch := source.next_minibatch(minibatch_size, partitions, index)) is not None:
        minibatches.append(minibatch)
    return minibatches


def assert_same_minibatches(got: list, expected: list) -> None:
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        assert set(a) == set(b) and np.array_equal(a.positions, b.positions)
        assert (a.num_samples, a.global_num_samples) == (b.num_samples, b.global_num_samples)
        for name in a:
            x, y = a[name], b[name]
            if isinstance(x, Sequences):
                assert torch.equal(x.lengths, y.lengths)
                x, y = x.data, y.data
            assert x.dtype == y.dtype and torch.equal(x, y), name


# -- what a MinibatchSource reads --------------------------------------------------------------------------

@pytest.mark.parametrize("partitions", [1, 2, 3])
def test_a_tensor_dataset_is_read_exactly_once_per_sweep_on_every_partition_count(partitions):
    features = torch.randn(17, 4)
    labels = torch.arange(17) * 10
    sources = [MinibatchSource(TensorDataset(features, labels), randomization_seed=3, max_sweeps=2)
               for _ in range(partitions)]
    assert isinstance(sources[0].deserializer, DatasetDeserializer)
    assert not sources[0].read_ahead  # no workers: reads are cheap, no background thread
    seen = [[], []]
    for index, source in enumerate(sources):
        for minibatch in read_sweeps(source, 5, partitions, index):
            ids = (minibatch.labels // 10).tolist()
            assert minibatch.features.dtype == torch.float32 and minibatch.labels.dtype == torch.int64
            assert torch.equal(minibatch.features, features[ids])
            for position, sample in zip(minibatch.positions, ids):
                seen[position // 17].append(sample)
    assert [sorted(sweep) for sweep in seen] == [list(range(17))] * 2


def test_dict_samples_are_streams_by_key_and_values_convert():
    deserializer = DatasetDeserializer(Listed([{"x": np.array([0.5, 1.5]), "y": 1, "w": 0.25, "ok": True},
                                               {"x": np.array([2.5, 3.5]), "y": 0, "w": 1.0, "ok": False}]))
    assert {name: (info.shape, info.dtype) for name, info in deserializer.streams.items()} == {
        "x": ((2,), torch.float32), "y": ((), torch.int64), "w": ((), torch.float32), "ok": ((), torch.bool)}
    out = deserializer.read(np.array([1, 0]))
    assert out["x"].tolist() == [[2.5, 3.5], [0.5, 1.5]] and out["y"].tolist() == [0, 1]
    assert out["w"].tolist() == [1.0, 0.25] and out["ok"].tolist() == [False, True]
    assert deserializer.read(np.array([], dtype=np.int64))["x"].shape == (0, 2)


def test_tuples_are_named_by_names_and_a_single_value_is_features():
    triples = Listed([(torch.tensor([index, -index]), index % 2, np.int32(index)) for index in range(4)])
    deserializer = DatasetDeserializer(triples, names=["image", "label", "weight"])
    out = MinibatchSource(deserializer, randomize=False).next_minibatch(4)
    assert out["image"][:, 0].tolist() == [0, 1, 2, 3] and out["label"].tolist() == [0, 1, 0, 1]
    assert out["weight"].dtype == torch.int32
    renamed = DatasetDeserializer(TensorDataset(torch.zeros(3, 2), torch.ones(3)), names=["x", "target"])
    assert list(renamed.streams) == ["x", "target"]
    single = DatasetDeserializer(Listed([np.arange(3) + index for index in range(5)]))
    assert list(single.streams) == ["features"] and single.read(np.array([4]))["features"].tolist() == [[4, 5, 6]]


@pytest.mark.parametrize("given_lengths", [False, True])
def test_sequence_streams_are_padded_with_their_lengths_and_samples_are_steps(given_lengths):
    dataset = Tokens(23)
    lengths = {"text": np.arange(23) % 5 + 1} if given_lengths else None
    deserializer = DatasetDeserializer(dataset, sequences=["text"], lengths=lengths, num_classes={"text": 50})
    assert deserializer.streams["text"].is_sequence and deserializer.streams["text"].num_classes == 50
    assert deserializer.sequence_lengths("text").tolist() == (np.arange(23) % 5 + 1).tolist()
    source = MinibatchSource(deserializer, randomization_seed=1, max_sweeps=1)
    assert source.defining_stream == "text" and source.samples_per_sweep == int((np.arange(23) % 5 + 1).sum())
    steps, seen = 0, []
    for minibatch in read_sweeps(source, 8, 1, 0):
        text = minibatch["text"]
        assert minibatch.num_samples == text.num_steps <= 8 or text.num_sequences == 1
        for sequence, length, label in zip(text.unpadded(), text.lengths.tolist(), minibatch["label"].tolist()):
            index = int(sequence[0])  # (0 * 7 + index) % 50
            assert torch.equal(sequence, dataset[index]["text"]) and length == index % 5 + 1 and label == index % 3
            seen.append(index)
        assert (text.data[~text.mask] == 0).all()
        assert minibatch["vector"].dtype == torch.float32  # float64 arrays are served as float32
        steps += text.num_steps
    assert sorted(seen) == list(range(23)) and steps == source.samples_per_sweep


# -- workers --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("workers, chunking", [(WORKERS[0], None), (WORKERS[1], None), (WORKERS[1], (3, 2))],
                         ids=["threads", "processes", "processes-3-chunks-each-2-queued"])
def test_workers_give_the_identical_stream_across_a_checkpoint_and_restore(workers, chunking, monkeypatch):
    if chunking is not None:  # several chunks per worker and read, taken by whichever worker is free
        monkeypatch.setattr(dataset_module, "_TASKS_PER_WORKER", chunking[0])
        monkeypatch.setattr(workers_module, "_QUEUE_DEPTH", chunking[1])

    served = []  # per read with workers: whether it collected a prefetched read
    claim = DatasetDeserializer._claim
    monkeypatch.setattr(DatasetDeserializer, "_claim",
                        lambda self, *args: served.append(claim(self, *args)) or served[-1])

    def stream(options: dict, partitions: int = 2) -> tuple[list, dict]:
        deserializer = DatasetDeserializer(Tokens(29), sequences=["text"], num_classes={"label": 3}, **options)
        assert deserializer.benefits_from_read_ahead == bool(options)
        sources = [MinibatchSource(deserializer, randomization_seed=4) for _ in range(partitions)]
        first = [source.next_minibatch(size, partitions, index) for size in (9, 20, 9, 30, 9)
                 for index, source in enumerate(sources)]
        state = sources[0].get_checkpoint_state()
        restored = MinibatchSource(deserializer, randomization_seed=4)  # on one partition now
        restored.restore_from_checkpoint(state)
        after = [restored.next_minibatch(size) for size in (9, 25, 9, 9, 40, 9)]
        for source in [*sources, restored]:
            source.close()
        assert not deserializer._prefetched  # every prefetch was followed by its read, even those discarded
        deserializer.close()
        return first + after, state

    plain, plain_state = stream({})
    parallel, parallel_state = stream(workers)
    assert parallel_state == plain_state
    assert_same_minibatches(parallel, plain)
    assert any(claim is not None for claim in served)  # the read-ahead announced its reads (prefetch)


@pytest.mark.parametrize("workers", WORKERS, ids=["threads", "processes"])
def test_a_source_reading_ahead_has_its_reads_prefetched_and_the_stream_of_no_workers(workers, monkeypatch):
    served = []  # per read with workers: whether it collected a prefetched read
    claim = DatasetDeserializer._claim
    monkeypatch.setattr(DatasetDeserializer, "_claim",
                        lambda self, *args: served.append(claim(self, *args)) or served[-1])

    def stream(options: dict) -> list:
        deserializer = DatasetDeserializer(Tokens(29), sequences=["text"], **options)
        source = MinibatchSource(deserializer, randomization_seed=6, max_sweeps=2)
        assert source.read_ahead == bool(options)
        minibatches = [source.next_minibatch(12) for _ in range(5)]
        state = source.get_checkpoint_state()
        minibatches += [source.next_minibatch(12) for _ in range(3)]
        source.close()  # its two reads ahead are read (and dropped)
        assert not deserializer._prefetched  # every prefetch was followed by its read
        restored = MinibatchSource(deserializer, randomization_seed=6, max_sweeps=2)
        restored.restore_from_checkpoint(state)
        minibatches += read_sweeps(restored, 12, 1, 0)
        restored.close()
        deserializer.close()
        return minibatches

    plain = stream({})
    assert_same_minibatches(stream(workers), plain)
    assert len(plain) > 15 and len(served) == len(plain) + 2  # the two reads ahead of the first source's last
    assert sum(claim is None for claim in served) == 2  # the first read of each source; every other was prefetched
    assert len({tuple(minibatch["label"].tolist()) for minibatch in plain}) > 3  # the test reads varied data


@pytest.mark.parametrize("workers", [{}] + WORKERS, ids=["inline", "threads", "processes"])
def test_collate_fn_batches_the_streams_with_one_value_per_sample(workers):
    def collate(samples):  # a dict of two streams from tuple samples: uint8 images scaled to float32
        return {"image": torch.stack([image for image, _ in samples]).float() / 255,
                "label": torch.tensor([label for _, label in samples])}

    images = torch.randint(0, 256, (11, 3, 4, 4), dtype=torch.uint8)
    deserializer = DatasetDeserializer(TensorDataset(images, torch.arange(11)), collate_fn=collate, **workers)
    assert deserializer.streams["image"].dtype == torch.float32 and deserializer.streams["image"].shape == (3, 4, 4)
    order = np.array([7, 2, 9, 0, 4])
    out = deserializer.read(order)
    assert torch.equal(out["image"], images[order].float() / 255) and out["label"].tolist() == order.tolist()
    deserializer.close()


@pytest.mark.parametrize("chunking", [None, (3, 2)], ids=["one-chunk-each", "3-chunks-each-2-queued"])
def test_large_batches_come_from_worker_processes_through_shared_memory_arenas(chunking, monkeypatch):
    if chunking is not None:
        monkeypatch.setattr(dataset_module, "_TASKS_PER_WORKER", chunking[0])
        monkeypatch.setattr(workers_module, "_QUEUE_DEPTH", chunking[1])
    features = torch.randn(40, 20_000)  # 80 kB a sample: past what a worker sends inline
    rng = np.random.default_rng(0)
    with DatasetDeserializer(TensorDataset(features, torch.arange(40)), num_workers=2) as deserializer:
        orders = [rng.permutation(40)[:size] for size in (1, 8, 8, 3, 40, 16, 40, 1, 2)]
        reads = [deserializer.read(order)["features"] for order in orders]  # arenas made, reused and grown
        for order, read in zip(orders, reads):  # each read owns its tensors: later reads overwrote no arena in them
            assert torch.equal(read, features[order])
        arenas = [buffer for worker in deserializer._workers._arenas for _, buffer in worker]
        assert all(buffer is not None and buffer.is_shared() for buffer in arenas)
        processes = [process for process, _ in deserializer._workers._workers]
        assert len(processes) == 2 and all(process.is_alive() for process in processes)
    assert deserializer._workers is None and not any(process.is_alive() for process in processes)  # closed


def test_a_pickled_source_reads_on_with_its_own_workers():
    deserializer = DatasetDeserializer(Tokens(15), sequences=["text"], num_workers=2)
    source = MinibatchSource(deserializer, randomization_seed=2)
    assert source.read_ahead  # workers: the next minibatch is read in the background
    source.next_minibatch(6)
    copy = pickle.loads(pickle.dumps(source))
    assert copy.deserializer._workers is None
    assert_same_minibatches([copy.next_minibatch(6) for _ in range(4)], [source.next_minibatch(6) for _ in range(4)])
    plain = pickle.loads(pickle.dumps(MinibatchSource(TensorDataset(torch.arange(6.0), torch.arange(6)),
                                                      randomize=False)))
    assert plain.next_minibatch(6).features.tolist() == list(range(6))
    for each in (source, copy):
        each.close()
        each.deserializer.close()


def assert_same_reads(got: list, expected: list) -> None:
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        assert set(a) == set(b) and all(torch.equal(a[name], b[name]) for name in a)


@pytest.mark.parametrize("workers", WORKERS, ids=["threads", "processes"])
def test_prefetch_starts_the_workers_at_once_and_the_read_collects_their_work(workers):
    dataset = Counted(24)
    rng = np.random.default_rng(5)
    orders = [rng.permutation(24)[:size] for size in (8, 5, 12, 1)]
    plain = DatasetDeserializer(dataset)
    expected = [plain.read(order) for order in orders]
    calls = dataset.calls.value
    plain.prefetch(orders[0])  # without workers: nothing to start
    assert dataset.calls.value == calls and not plain._prefetched
    deserializer = DatasetDeserializer(dataset, **workers)
    dataset.calls.value = 0
    for order in orders[:3]:
        deserializer.prefetch(order)
    # processes: a worker holds two tasks (_QUEUE_DEPTH, one arena slot each), the third read waits for a slot
    started = 13 if workers["worker_type"] == "process" else 25
    deadline = time.monotonic() + 20
    while dataset.calls.value < started and time.monotonic() < deadline:
        time.sleep(0.005)
    time.sleep(0.05)
    assert dataset.calls.value == started  # prefetched reads are read before anyone reads them
    got = [deserializer.read(order) for order in orders[:3]]  # three prefetches, then three reads in order
    deserializer.prefetch(orders[3])
    got.append(deserializer.read(orders[3]))
    assert dataset.calls.value == 26  # each sample once: the reads collected the prefetched chunks, sent none again
    assert_same_reads(got, expected)
    assert not deserializer._prefetched
    deserializer.close()


@pytest.mark.parametrize("workers", WORKERS, ids=["threads", "processes"])
def test_a_read_of_other_indices_than_those_prefetched_drops_them_and_reads_right(workers):
    features = torch.randn(30, 20_000)  # 80 kB a sample: through the arenas, whose slots the dropped work holds
    with DatasetDeserializer(TensorDataset(features, torch.arange(30)), **workers) as deserializer:
        first, second, other = np.arange(10), np.arange(19, 9, -1), np.array([25, 3, 17])

        def read(order: np.ndarray) -> torch.Tensor:
            out = deserializer.read(order)
            assert torch.equal(out["features"], features[order]) and out["labels"].tolist() == order.tolist()

        deserializer.prefetch(first)
        deserializer.prefetch(second)
        read(second)  # served; the prefetched read before it is dropped
        assert not deserializer._prefetched
        deserializer.prefetch(first)
        deserializer.prefetch(second)
        read(other)  # none matches: both dropped
        assert not deserializer._prefetched
        for order in (first, second, other, first):
            read(order)
        deserializer.prefetch(first)
        deserializer.prefetch(np.array([30]))  # a read would refuse it: ignored
        deserializer.read(np.array([], dtype=np.int64))
        with pytest.raises(ValueError, match=r"indices must lie in \[0, 30\)"):
            deserializer.read(np.array([30]))
        assert len(deserializer._prefetched) == 1
        read(first)  # still served after an empty and a refused read


@pytest.mark.parametrize("workers", WORKERS, ids=["threads", "processes"])
def test_an_error_in_a_prefetched_chunk_is_raised_by_its_read(workers, monkeypatch):
    monkeypatch.setattr(dataset_module, "_TASKS_PER_WORKER", 2)  # four chunks a read: 0..2, 3..5, 6..8, 9..11
    deserializer = DatasetDeserializer(Failing(bad={4, 7, 10}, size=14), **workers)
    deserializer.prefetch(np.array([1, 2]))
    deserializer.prefetch(np.arange(12))  # prefetch raises nothing: the read does
    deserializer.prefetch(np.array([12, 13]))
    assert deserializer.read(np.array([1, 2]))["labels"].tolist() == [1, 2]
    with pytest.raises(DataError) as error:
        deserializer.read(np.arange(12))
    assert one_line(error) == "Failing[4] raised FileNotFoundError: no file for sample 4"  # the lowest chunk's
    assert deserializer.read(np.array([12, 13]))["labels"].tolist() == [12, 13]
    deserializer.close()


def test_a_worker_that_dies_with_reads_prefetched_fails_the_read_it_died_in_and_new_workers_read_on():
    deserializer = DatasetDeserializer(Failing(bad=6, exit_code=3, size=12), num_workers=2)
    deserializer.prefetch(np.arange(4))
    deserializer.prefetch(np.arange(8))
    deserializer.prefetch(np.array([9, 10]))  # waits for a free slot, then goes to both workers
    assert deserializer.read(np.arange(4))["labels"].tolist() == list(range(4))
    with pytest.raises(DataError, match=r"Failing worker process .* exited with code 3 while reading "
                                        r"Failing\[4\.\.7\]") as error:
        deserializer.read(np.arange(8))
    one_line(error)
    assert deserializer.read(np.array([9, 10]))["labels"].tolist() == [9, 10]  # on fresh workers
    deserializer.prefetch(np.arange(8))  # worker 1 dies on it, holding the second chunk of the next read too
    assert deserializer.read(np.array([0, 1]))["labels"].tolist() == [0, 1]  # read again on fresh workers
    assert deserializer.read(np.array([11]))["labels"].tolist() == [11]
    deserializer.close()


@pytest.mark.parametrize("workers", WORKERS, ids=["threads", "processes"])
def test_close_and_pickling_with_reads_prefetched_neither_hang_nor_leak(workers):
    features = torch.randn(16, 20_000)
    deserializer = DatasetDeserializer(TensorDataset(features, torch.arange(16)), **workers)
    deserializer.prefetch(np.arange(8))
    deserializer.prefetch(np.arange(8, 16))
    copy = pickle.loads(pickle.dumps(deserializer))
    assert copy._workers is None and not copy._prefetched
    assert torch.equal(copy.read(np.arange(8, 16))["features"], features[8:])
    pool = deserializer._workers
    deserializer.close()
    assert deserializer._workers is None and not deserializer._prefetched
    if workers["worker_type"] == "process":
        assert not any(process.is_alive() for process, _ in pool._workers)
    else:
        assert pool._executor._shutdown
    assert torch.equal(deserializer.read(np.arange(8, 16))["features"], features[8:])  # new workers
    for each in (deserializer, copy):
        each.close()


def test_process_workers_end_at_interpreter_exit_without_close():
    code = textwrap.dedent("""
        import numpy as np, torch
        from torch.utils.data import TensorDataset
        from dtrain.data.dataset import DatasetDeserializer
        deserializer = DatasetDeserializer(TensorDataset(torch.arange(10.0)), names=["features"], num_workers=2)
        print(deserializer.read(np.arange(10))["features"].sum().item())
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert done.returncode == 0 and done.stdout.strip() == "45.0", done.stderr



@pytest.mark.parametrize("method", ["fork"] + [pytest.param(method, marks=pytest.mark.slow)  # where fork is missing
                                                for method in ("spawn", "forkserver")])
def test_process_workers_read_under_every_start_method_and_end_when_their_parent_is_killed(method, tmp_path):
    """A spawned or forkserver worker unpickles the dataset and the plan and starts from the worker main's module
    path; it idles past the watchdog's period (its parent is the forkserver's, not the reader) and reads on through
    its arenas. SIGKILL of the reading process (no close, no exit handlers) ends every worker within seconds, while
    a process it forked later lives on holding the workers' pipes open."""
    code = textwrap.dedent(f"""
        import multiprocessing, os, signal, time
        import numpy as np, torch
        from torch.utils.data import TensorDataset
        import dtrain.data._dataset_workers as workers
        from dtrain.data.dataset import DatasetDeserializer
        workers._start_context = lambda: multiprocessing.get_context({method!r})
        features = torch.randn(16, 20_000)  # 80 kB a sample: through the arenas
        deserializer = DatasetDeserializer(TensorDataset(features, torch.arange(16)), num_workers=2)
        for _ in range(3):  # each worker's two arenas are sized by a task's need, then made and reused
            assert torch.equal(deserializer.read(np.arange(8))["features"], features[:8])
        time.sleep(workers._WATCHDOG_SECONDS + 0.5)
        assert torch.equal(deserializer.read(np.arange(8, 16))["features"], features[8:])
        assert all(buffer is not None for arenas in deserializer._workers._arenas for _, buffer in arenas)
        if (forked := os.fork()) == 0:
            time.sleep(60)
            os._exit(0)
        print(forked, *(process.pid for process, _ in deserializer._workers._workers), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    with open(tmp_path / "stderr", "w") as stderr:  # its output stays open in the forked process: not waited for
        reader = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=stderr, text=True,
                                  cwd=Path(__file__).resolve().parents[2])
        printed = reader.stdout.readline()
        reader.stdout.close()
        assert reader.wait(timeout=120) == -signal.SIGKILL, (tmp_path / "stderr").read_text()
    forked, *pids = [int(pid) for pid in printed.split()]
    try:
        assert len(pids) == 2 and not process_ended(forked)
        deadline = time.monotonic() + workers_module._WATCHDOG_SECONDS + 10
        while not all(map(process_ended, pids)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert all(map(process_ended, pids)), [pid for pid in pids if not process_ended(pid)]
    finally:
        os.kill(forked, signal.SIGKILL)


# -- errors -----------------------------------------------------------------------------------------------

def one_line(error: pytest.ExceptionInfo) -> str:
    message = str(error.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("workers", [{}] + WORKERS, ids=["inline", "threads", "processes"])
def test_a_getitem_error_is_one_data_error_line_with_or_without_workers(workers):
    deserializer = DatasetDeserializer(Failing(bad=5), **workers)
    with pytest.raises(DataError) as error:
        deserializer.read(np.array([1, 2, 3, 5, 6, 7]))
    assert one_line(error) == "Failing[5] raised FileNotFoundError: no file for sample 5"
    assert deserializer.read(np.array([6, 7]))["labels"].tolist() == [6, 7]  # the workers read on
    deserializer.close()


def test_a_worker_process_that_dies_is_a_data_error_and_the_next_read_starts_new_workers():
    deserializer = DatasetDeserializer(Failing(bad=6, exit_code=3), num_workers=2)
    with pytest.raises(DataError, match=r"Failing worker process .* exited with code 3 while reading "
                                        r"Failing\[4\.\.7\]") as error:
        deserializer.read(np.arange(8))
    one_line(error)
    assert deserializer.read(np.arange(6))["labels"].tolist() == list(range(6))
    deserializer.close()


def test_samples_that_do_not_fit_the_streams_are_data_errors_naming_stream_and_index():
    with pytest.raises(DataError) as error:
        DatasetDeserializer(Listed([(1, 2, 3)]))
    assert "names=[...]" in one_line(error) and "tuple of 3 values" in one_line(error)
    shapes = DatasetDeserializer(Listed([(np.zeros(3), 0), (np.zeros(4), 1)]))
    with pytest.raises(DataError) as error:
        shapes.read(np.array([0, 1]))
    assert one_line(error) == ("stream 'features': Listed[1] has shape [4] but sample 0 has [3]; a stream with one "
                               "value per sample needs one shape (give variable-length streams in sequences=[...])")
    structure = DatasetDeserializer(Listed([(0.5, 1), {"features": 0.5, "labels": 1}]))
    with pytest.raises(DataError, match=r"Listed\[1\] is a dict .* but sample 0 was a tuple of 2 values"):
        structure.read(np.array([1]))
    with pytest.raises(DataError, match=r"stream 'labels': Listed\[1\] is a str; expected a tensor"):
        DatasetDeserializer(Listed([(0.5, 1), (0.5, "cat")])).read(np.array([0, 1]))
    with pytest.raises(DataError, match=r"stream 'labels': Listed\[1\] holds float32 values but sample 0 holds int64"):
        DatasetDeserializer(Listed([(0.5, 1), (0.5, 1.5)])).read(np.array([0, 1]))
    with pytest.raises(DataError) as error:
        DatasetDeserializer(Listed([(0.5, 1), (0.5, 4)]), num_classes={"labels": 3}).read(np.array([0, 1]))
    assert one_line(error) == ("stream 'labels': Listed[1] holds the id 4, outside its vocabulary [0, 3) "
                               "(num_classes=3)")
    with pytest.raises(DataError, match="has no samples"):
        DatasetDeserializer(Listed([]))
    with pytest.raises(DataError, match=r"_Raising\[0\] raised IndexError: gone"):
        DatasetDeserializer(_Raising())


class _Raising(Listed):
    def __init__(self):
        super().__init__([None])

    def __getitem__(self, index):
        raise IndexError("gone")


def test_sequence_errors_name_the_stream_and_index():
    empty = [{"text": np.arange(3)}, {"text": np.arange(0)}]
    with pytest.raises(DataError) as error:  # found by the scan at construction
        DatasetDeserializer(Listed(empty), sequences=["text"])
    assert one_line(error) == ("stream 'text': Listed[1] is an empty sequence; every sequence needs at least one "
                               "step")
    with pytest.raises(DataError, match=r"stream 'text': lengths\['text'\]\[1\] is 0"):
        DatasetDeserializer(Listed(empty), sequences=["text"], lengths={"text": [3, 0]})
    given = DatasetDeserializer(Listed(empty), sequences=["text"], lengths={"text": [3, 2]})
    with pytest.raises(DataError, match=r"stream 'text': Listed\[1\] is an empty sequence"):
        given.read(np.array([1]))
    wrong = DatasetDeserializer(Listed([{"text": np.arange(3)}, {"text": np.arange(2)}]), sequences=["text"],
                                lengths={"text": [3, 5]})
    with pytest.raises(DataError, match=r"stream 'text': Listed\[1\] has 2 steps, but its length was given .* as 5"):
        wrong.read(np.array([0, 1]))
    with pytest.raises(DataError, match=r"stream 'text': Listed\[1\] holds the id 7, outside its vocabulary \[0, 5\)"):
        DatasetDeserializer(Listed([{"text": np.arange(3)}, {"text": np.array([1, 7])}]), sequences="text",
                            num_classes={"text": 5}).read(np.array([0, 1]))


def test_a_collate_fn_that_breaks_the_rules_is_a_data_error():
    dataset = TensorDataset(torch.zeros(6, 2), torch.arange(6))
    dropping = DatasetDeserializer(dataset, collate_fn=lambda samples: (torch.zeros(1, 2), torch.zeros(1)))
    with pytest.raises(DataError) as error:
        dropping.read(np.arange(3))
    assert one_line(error) == ("stream 'features': collate_fn over TensorDataset[0..2] (3 samples) returned shape "
                               "[1, 2]; expected [3, 2] (one row per sample, each like collate_fn([sample 0]))")
    with pytest.raises(DataError, match=r"collate_fn over TensorDataset\[0\] raised ZeroDivisionError"):
        DatasetDeserializer(dataset, collate_fn=lambda samples: 1 / 0)


def test_arguments_are_checked():
    dataset = TensorDataset(torch.zeros(4, 2), torch.arange(4))
    with pytest.raises(ValueError, match="names=.* names 3 streams but TensorDataset\\[0\\] is a tuple of 2"):
        DatasetDeserializer(dataset, names=["a", "b", "c"])
    with pytest.raises(ValueError, match="sequences names \\['text'\\], which are not streams"):
        DatasetDeserializer(dataset, sequences=["text"])
    with pytest.raises(ValueError, match="num_classes names \\['label'\\]"):
        DatasetDeserializer(dataset, num_classes={"label": 3})
    with pytest.raises(DataError, match="stream 'features' has num_classes=3 but TensorDataset\\[0\\] holds float32"):
        DatasetDeserializer(dataset, num_classes={"features": 3})
    with pytest.raises(ValueError, match="worker_type must be one of 'process', 'thread'"):
        DatasetDeserializer(dataset, num_workers=2, worker_type="fiber")
    with pytest.raises(ValueError, match="lengths\\['text'\\] must be an integer array of 2 lengths"):
        DatasetDeserializer(Listed([{"text": np.arange(3)}] * 2), sequences=["text"], lengths={"text": [3]})
    with pytest.raises(ValueError, match="dict, whose keys name its streams"):
        DatasetDeserializer(Listed([{"x": 1}]), names=["y"])


class _Stream(IterableDataset):
    def __iter__(self):
        return iter(range(3))


def test_an_iterable_dataset_or_an_object_without_an_index_is_refused():
    for value in (_Stream(), object()):
        with pytest.raises(TypeError) as error:
            DatasetDeserializer(value)
        assert "exactly once per sweep" in one_line(error) and "map-style Dataset" in one_line(error)
    with pytest.raises(TypeError) as error:
        MinibatchSource(_Stream())
    assert one_line(error).startswith("_Stream is an IterableDataset") and \
        "pass the shard files themselves (dtrain.data.ParquetShards for Parquet" in one_line(error)


def test_a_data_loader_is_refused_saying_to_pass_its_dataset():
    from torch.utils.data import DataLoader

    def pairs(samples):
        return torch.utils.data.default_collate(samples)

    loader = DataLoader(TensorDataset(torch.randn(8, 3), torch.arange(8) % 2), batch_size=4, num_workers=0)
    for value, given in ((loader, "a DataLoader"), (iter(loader), "(an iterator over a DataLoader)")):
        for make in (MinibatchSource, DatasetDeserializer):
            with pytest.raises(TypeError) as error:
                make(value)
            assert given in one_line(error) and \
                one_line(error).endswith("pass dtrain.data.DatasetDeserializer(loader.dataset) instead")
    assert MinibatchSource(loader.dataset).samples_per_sweep == 8  # what the line says to pass is read
    with pytest.raises(TypeError) as error:
        MinibatchSource(DataLoader(loader.dataset, batch_size=4, num_workers=3, collate_fn=pairs))
    assert one_line(error).endswith("the loader's sampler, batch_size and shuffle would not apply); pass "
                                    "dtrain.data.DatasetDeserializer(loader.dataset, num_workers=3, collate_fn="
                                    "test_a_data_loader_is_refused_saying_to_pass_its_dataset.<locals>.pairs) instead")
    with pytest.raises(TypeError) as error:
        MinibatchSource(DataLoader(_Stream(), batch_size=4))
    assert one_line(error).endswith("pass the shard files its _Stream reads (dtrain.data.ParquetShards, "
                                    "dtrain.data.TarShards) or a map-style Dataset (its IterableDataset has no index "
                                    "to read by) instead")
