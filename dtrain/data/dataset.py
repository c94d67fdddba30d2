"""Any map-style ``torch.utils.data.Dataset`` as a stream deserializer (``docs/data.md``).

``MinibatchSource(TensorDataset(x, y))`` trains on the streams ``features`` and ``labels``: the source
asks :class:`DatasetDeserializer` for the samples of each partition's share by index, so every rank
reads each sample exactly once per sweep, sweeps are shuffled by the source's seed, and a checkpoint
resumes mid-sweep, none of which an ``IterableDataset`` allows.

A slow ``__getitem__`` (decoding files) reads in parallel, like ``DataLoader(num_workers=k)``: each
read is split into ``k`` contiguous chunks, one per worker, each worker collates its chunk, and the
chunks are put back together in index order, so the stream is bit-identical with and without workers.
A worker process writes its large tensors into a shared-memory arena of its own, made once and reused
read after read; the reading process copies them out of it into the minibatch (one copy, no files or
file descriptors passed per read). A source that reads ahead announces its next reads
(:meth:`DatasetDeserializer.prefetch`), so the workers start on them at once instead of waiting, between
two reads, for the reading thread to take in the last one, as ``DataLoader`` keeps batches queued at
its workers.
"""
from __future__ import annotations

import builtins
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence as SequenceType
from concurrent.futures import ThreadPoolExecutor, wait

import numpy as np
import torch

from dtrain.data._checks import check_id_dtype, check_int
from dtrain.data._checks import check_not_a_data_loader
from dtrain.data.errors import DataError
from dtrain.data.streams import PADDING_VALUE, Sequences, StreamInfo, StreamReference

__all__ = ["DatasetDeserializer", "WORKER_TYPES"]

#: the kinds of parallel reading (``worker_type``)
WORKER_TYPES = ("process", "thread")
#: the stream names of a sample that is a pair, when ``names`` is not given
PAIR_NAMES = ("features", "labels")
#: a worker sends a tensor smaller than this inline (pickled bytes) instead of through shared memory
_INLINE_BYTES = 64 * 1024
#: how often an idle worker process checks that the process that started it is still alive (seconds)
_WATCHDOG_SECONDS = 2.0
#: Python numbers as tensors
_NUMBER_DTYPES = {bool: torch.bool, int: torch.int64, float: torch.float32}


class DatasetDeserializer:
    """A map-style torch ``Dataset`` (``__getitem__`` and ``__len__``) as named streams.

    What a sample may be:

    * a tuple or list: a pair is the streams ``features`` and ``labels`` (``TensorDataset(x, y)``);
      any other length needs ``names=[...]``, one name per element (``names`` may also rename a pair);
    * a dict: its keys are the stream names;
    * a single tensor, array or number: the stream ``features`` (or ``names=[name]``).

    Values may be tensors (their dtype is kept), numpy arrays (float64 is served as float32, like
    ``StreamArrays``), lists of numbers (as numpy arrays) or Python numbers (int -> int64,
    float -> float32, bool -> bool). The streams' shapes and dtypes come from sample 0, read at
    construction; every other sample must match them (a dtype that converts without loss, e.g.
    int32 into an int64 stream, is converted).

    Sequence streams (``sequences=[...]``) hold a variable number of steps per sample (the first
    dimension of the value); they are served as :class:`~dtrain.data.streams.Sequences` (padded with 0,
    lengths on the CPU). The source plans minibatches by steps before it reads, so their lengths must be
    known up front: give ``lengths={name: int array}`` or, when a stream's lengths are not given, the
    constructor reads **every sample once** (with the workers, when there are any) to measure them.
    A sample read later must still have that many steps.

    Args:
        dataset: the map-style dataset; ``dataset[i]`` for ``0 <= i < len(dataset)`` is called with a
            Python int.
        names: stream names for the elements of a tuple sample (or for a single value); None: a pair
            is ``features, labels``, a single value ``features``. Not allowed for dict samples.
        sequences: the names of the variable-length (sequence) streams (one name may be a plain string).
        lengths: ``{name: int array [len(dataset)]}``: the steps of every sample of a sequence stream,
            each >= 1; streams left out are measured by one scan at construction.
        num_classes: ``{name: count}`` for integer streams holding class ids or token ids; every read
            checks that they lie in ``[0, count)``.
        collate_fn: as in ``DataLoader``: ``collate_fn(list of samples) -> batch``, used instead of the
            default stacking for the streams with one value per sample. The batch has the sample's
            structure (a tuple/list of as many values, a dict with the same keys, or a single tensor;
            the same naming rules) and holds, per such stream, a tensor or array ``[len(samples), ...]``
            whose row ``i`` comes from sample ``i`` alone (with workers it is called once per chunk).
            Its values for sequence streams are ignored: dtrain pads those itself. The streams'
            shapes and dtypes come from ``collate_fn([sample 0])``.
        num_workers: parallel readers (0: read in the calling thread). With workers a
            ``MinibatchSource`` reads the next two minibatches in the background by default and
            announces each to :meth:`prefetch` when it queues it, so the workers hold the next read's
            chunks while the current one is taken in (they never wait between reads).
        worker_type: ``"process"``: persistent worker processes (forked where the platform can; the
            dataset reaches each worker once, when it starts; a worker collates its chunk into shared
            memory, and holds the chunks of two reads: the one being taken in and the next), for a
            ``__getitem__`` that holds the GIL (PIL, Python code);
            ``"thread"``: a thread pool, for a ``__getitem__`` that releases the GIL (file reads, decoders
            in native code).
        defining_stream: the stream (or step slice, ``text[1:]``) whose steps count samples, when the
            source is not told; None: the source's rule (the only sequence stream).

    Attributes:
        streams: name -> :class:`~dtrain.data.streams.StreamInfo`.
        num_sequences: ``len(dataset)``.
        benefits_from_read_ahead: True with workers (the source then reads ahead by default).
        read_ahead_minibatches: 2 with workers (the source keeps two reads in flight), else 1.

    Raises:
        TypeError: ``dataset`` is an ``IterableDataset`` or has no ``__getitem__``/``__len__``; an
            argument of the wrong type.
        ValueError: an argument that names no stream, or of the wrong shape or value.
        DataError: the dataset is empty; sample 0 (or, in the scan, any sample) cannot be read or does
            not fit the rules above (one line naming the stream and the index).

    The object pickles (a copy starts its own workers when it first reads); :meth:`close` ends the
    workers, and so does garbage collection or the interpreter's exit. Randomness inside
    ``__getitem__`` should be keyed by the index for the stream to be the same with and without
    workers and after a restore; dtrain's own augmentation (``transform=``) is.
    """

    def __init__(self, dataset: torch.utils.data.Dataset, names: SequenceType[str] | None = None,
                 sequences: Iterable[str] | str = (), lengths: Mapping[str, object] | None = None,
                 num_classes: Mapping[str, int] | None = None, collate_fn: Callable | None = None,
                 num_workers: int = 0, worker_type: str = "process", defining_stream: str | None = None) -> None:
        _check_map_style(dataset)
        self.dataset = dataset
        self.num_workers = check_int("num_workers", num_workers, 0)
        if worker_type not in WORKER_TYPES:
            raise ValueError(f"worker_type must be one of {', '.join(map(repr, WORKER_TYPES))}, got {worker_type!r}")
        self.worker_type = worker_type
        if collate_fn is not None and not callable(collate_fn):
            raise TypeError(f"collate_fn must be callable as collate_fn(list of samples) -> batch, got "
                            f"{type(collate_fn).__name__}")
        type_name = type(dataset).__name__
        self.num_sequences = check_int(f"len({type_name})", len(dataset), 0)
        if self.num_sequences == 0:
            raise DataError(f"{type_name} has no samples (len 0); a data set needs at least one")
        names = _checked_names(names)
        sequence_names = [sequences] if isinstance(sequences, str) else list(sequences)
        self._plan = _Plan(type_name, collate_fn)
        self._plan.describe(dataset, names, sequence_names, dict(num_classes or {}))
        self.streams: dict[str, StreamInfo] = dict(self._plan.infos)
        self.defining_stream = None
        if defining_stream is not None:
            reference = StreamReference.parse(defining_stream, "defining_stream")
            if reference.name not in self.streams:
                raise ValueError(f"defining_stream={defining_stream!r} is not a stream; the streams are "
                                 f"{', '.join(map(repr, self.streams))}")
            self.defining_stream = defining_stream
        # _read_lock: one read (or close) at a time; _lock: the workers and the prefetched reads, held briefly,
        # so that prefetch (the caller's thread) never waits for a read in progress (the read-ahead thread)
        self._read_lock = threading.Lock()
        self._lock = threading.Lock()
        self._workers: _ThreadWorkers | _ProcessWorkers | None = None
        # the reads announced by prefetch and not yet read, oldest first: (indices, workers, job, merger)
        self._prefetched: deque[tuple] = deque()
        try:
            self._lengths = self._sequence_lengths(dict(lengths or {}))
        except BaseException:
            self.close()  # the workers of a failed scan
            raise

    # -- the StreamDeserializer protocol ---------------------------------------------------------------
    @property
    def benefits_from_read_ahead(self) -> bool:
        """Whether reads are worth doing in the background: True with workers."""
        return self.num_workers > 0

    @property
    def read_ahead_minibatches(self) -> int:
        """How many minibatches a source reads ahead: two with workers, so that they start on the one after
        next while the next is handed over, as ``DataLoader`` keeps batches in flight."""
        return 2 if self.num_workers > 0 else 1

    def sequence_lengths(self, name: str) -> np.ndarray:
        """int64 ``[num_sequences]``: the steps of every sample of the sequence stream ``name``.

        Raises:
            KeyError: ``name`` is not a sequence stream.
        """
        if name not in self._lengths:
            raise KeyError(f"{name!r} is not a sequence stream of this {type(self).__name__}; its sequence streams "
                           f"are {sorted(self._lengths)}")
        return self._lengths[name]

    def read(self, indices: np.ndarray) -> dict[str, torch.Tensor | Sequences]:
        """The samples ``indices`` (in this order), collated: a tensor ``[n, *shape]`` per stream with one
        value per sample, a :class:`Sequences` per sequence stream.

        With workers the indices are split into contiguous chunks, one task of a worker each (sent by
        :meth:`prefetch` when that announced this read: the read then collects them); the result is the
        same as without.

        Raises:
            DataError: ``dataset[i]`` raised (``"{Dataset}[{i}] raised {Error}: {message}"``), a sample
                does not fit the streams (shape, dtype, structure, an empty or resized sequence, an id
                outside ``num_classes``), or a worker process died.
            ValueError: ``indices`` is not a 1-d array of indices in ``[0, num_sequences)``.
        """
        indices = self._checked_indices(indices)
        if not len(indices):
            return self._plan.empty()
        if self.num_workers == 0:
            chunks = self._chunks(indices)
            merger = _Merger(self.streams, chunks)
            self._run("read_chunk", chunks, (), merger.add)
        else:
            merger = self._collect(lambda workers: self._claim(workers, indices) or self._start_read(workers, indices))
        return self._finish(merger.result(), indices)

    def prefetch(self, indices: np.ndarray) -> None:
        """Starts the workers on a coming ``read(indices)`` now, so that they do not idle between reads while
        the reading thread takes in the last one; that read collects their work (the same result).

        Each prefetch is to be followed by one read of the same indices, in the order of the prefetches,
        possibly in another thread while a read runs; a read of other indices drops the prefetched work
        before it. Without workers, or for indices a read would refuse, it does nothing (the read raises).
        """
        if self.num_workers == 0:
            return
        try:
            indices = np.array(self._checked_indices(indices), dtype=np.int64)  # a copy: sent later, maybe
        except ValueError:
            return
        if not len(indices):
            return
        with self._lock:
            try:
                workers = self._started()
                job, merger = self._start_read(workers, indices)
            except Exception:  # noqa: BLE001 - e.g. no worker process could start: the read tries again and says so
                return
            self._prefetched.append((indices, workers, job, merger))

    def checkpoint_identity(self) -> dict:
        """What a checkpoint of a source over this must match: the dataset's type, size and streams (the
        session adds this class's name)."""
        return {"dataset": _qualified_name(self.dataset), "num_sequences": self.num_sequences,
                "streams": [info.describe() for info in self.streams.values()]}

    # -- workers ---------------------------------------------------------------------------------------
    def close(self) -> None:
        """Ends the worker processes or threads (after the read in progress, if any); a later read starts
        new ones."""
        read_lock, lock = self.__dict__.get("_read_lock"), self.__dict__.get("_lock")
        if read_lock is None or lock is None:
            return
        with read_lock:
            with lock:
                workers, self._workers = self._workers, None
                self._prefetched.clear()  # their work ends with the workers; a read of them reads anew
            if workers is not None:
                workers.close()

    def __enter__(self) -> DatasetDeserializer:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_workers"] = None  # processes, pipes and threads do not pickle; a copy starts its own
        state["_lock"] = state["_read_lock"] = None
        state["_prefetched"] = deque()  # work at this object's workers; a copy reads its indices anew
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._read_lock = threading.Lock()
        self._lock = threading.Lock()

    def _chunks(self, indices: np.ndarray) -> list[np.ndarray]:
        """``indices`` in contiguous chunks: one without workers, else ``_TASKS_PER_WORKER`` per worker."""
        if self.num_workers == 0:
            return [indices]
        return np.array_split(indices, min(len(indices), self.num_workers * _TASKS_PER_WORKER))

    def _checked_indices(self, indices: np.ndarray) -> np.ndarray:
        """``indices`` as int64, checked (ValueError: not a 1-d array of indices in ``[0, num_sequences)``)."""
        indices = np.asarray(indices)
        if indices.ndim != 1 or not (np.issubdtype(indices.dtype, np.integer) or indices.size == 0):
            raise ValueError(f"indices must be a 1-d integer array, got shape {indices.shape} ({indices.dtype})")
        indices = indices.astype(np.int64, copy=False)
        if len(indices) and (int(indices.min()) < 0 or int(indices.max()) >= self.num_sequences):
            raise ValueError(f"indices must lie in [0, {self.num_sequences}), got [{int(indices.min())}, "
                             f"{int(indices.max())}]")
        return indices

    def _run(self, method: str, chunks: list[np.ndarray], extra: tuple, on_part: Callable[[int, dict], None]) -> None:
        """``plan.method(dataset, chunk, *extra)`` for every chunk, each result handed to ``on_part(number,
        result)`` (whose tensors it must copy if it keeps them past the call)."""
        if self.num_workers == 0:
            for number, chunk in enumerate(chunks):
                on_part(number, getattr(self._plan, method)(self.dataset, chunk, *extra))
            return
        tasks = [(chunk, *extra) for chunk in chunks]
        self._collect(lambda workers: (workers.submit(method, tasks, on_part), None))

    def _started(self) -> _ThreadWorkers | _ProcessWorkers:
        """The workers, started if there are none (under ``_lock``)."""
        if self._workers is None:
            kind = _ProcessWorkers if self.worker_type == "process" else _ThreadWorkers
            self._workers = kind(self.num_workers, self.dataset, self._plan)
        return self._workers

    def _start_read(self, workers, indices: np.ndarray) -> tuple[object, _Merger]:
        """``(job, merger)``: the chunks of ``indices`` handed to ``workers``, their results to go into ``merger``."""
        chunks = self._chunks(indices)
        merger = _Merger(self.streams, chunks)
        return workers.submit("read_chunk", [(chunk,) for chunk in chunks], merger.add), merger

    def _claim(self, workers, indices: np.ndarray) -> tuple[object, _Merger] | None:
        """The prefetched ``(job, merger)`` of ``indices`` (under ``_lock``), dropping the prefetched reads
        before it (all of them when none matches: this read is not the one announced)."""
        match = next((number for number, (prefetched, owner, _, _) in enumerate(self._prefetched)
                      if owner is workers and np.array_equal(prefetched, indices)), None)
        for _ in range(len(self._prefetched) if match is None else match):
            _, owner, job, _ = self._prefetched.popleft()
            if owner is workers:
                workers.drop(job)
        if match is None:
            return None
        _, _, job, merger = self._prefetched.popleft()
        return job, merger

    def _collect(self, start: Callable):
        """``start(workers) -> (job, result)`` (under ``_lock``, on the workers, started if need be), then waits
        for the job and returns ``result``. A worker that died takes its workers with it (the next read
        starts fresh ones); when it died on another read's task, taking this job's tasks along, this
        read runs again on fresh workers."""
        with self._read_lock:
            while True:
                with self._lock:
                    workers = self._started()
                    job, result = start(workers)
                try:
                    complete = workers.collect(job)
                finally:
                    if workers.broken:
                        with self._lock:
                            if self._workers is workers:
                                self._workers = None
                                self._prefetched.clear()  # their work died with the workers
                        workers.close()
                if complete:
                    return result

    def _finish(self, streams: dict, indices: np.ndarray) -> dict[str, torch.Tensor | Sequences]:
        """The merged streams with sequence streams padded, after checking their lengths against those
        the source planned with."""
        out: dict[str, torch.Tensor | Sequences] = {}
        for name, info in self.streams.items():
            if not info.is_sequence:
                out[name] = streams[name]
                continue
            values, lengths = streams[name]
            declared = self._lengths[name][indices]
            if not np.array_equal(lengths.numpy(), declared):
                row = int(np.flatnonzero(lengths.numpy() != declared)[0])
                raise DataError(f"stream {name!r}: {self._plan.type_name}[{int(indices[row])}] has "
                                f"{int(lengths[row])} steps, but its length was given (or measured at construction) "
                                f"as {int(declared[row])}; a sample's number of steps must not change between reads")
            out[name] = _padded(values, lengths, info)
        return out

    def _sequence_lengths(self, given: dict[str, object]) -> dict[str, np.ndarray]:
        """The lengths of every sequence stream: as given, or measured by one scan over the data set."""
        sequence_names = [name for name, info in self.streams.items() if info.is_sequence]
        unknown = sorted(set(given) - set(sequence_names))
        if unknown:
            raise ValueError(f"lengths names {unknown}, which are not sequence streams; the sequence streams are "
                             f"{sequence_names} (declare them with sequences=[...])")
        lengths = {}
        for name, value in given.items():
            array = np.asarray(value)
            if array.shape != (self.num_sequences,) or not np.issubdtype(array.dtype, np.integer):
                raise ValueError(f"lengths[{name!r}] must be an integer array of {self.num_sequences} lengths (one per "
                                 f"sample), got shape {array.shape} ({array.dtype})")
            array = array.astype(np.int64)
            if array.min() < 1:
                index = int(np.argmin(array))
                raise DataError(f"stream {name!r}: lengths[{name!r}][{index}] is {int(array[index])}; every sequence "
                                f"needs at least one step")
            lengths[name] = array
        missing = [name for name in sequence_names if name not in lengths]
        if missing:
            chunks = self._chunks(np.arange(self.num_sequences, dtype=np.int64))
            parts: list = [None] * len(chunks)
            self._run("scan_chunk", chunks, (tuple(missing),), parts.__setitem__)
            lengths.update((name, np.concatenate([part[name] for part in parts])) for name in missing)
        return {name: lengths[name] for name in sequence_names}


# -- what a sample holds ----------------------------------------------------------------------------------

class _Layout:
    """How a sample (or a collated batch) maps onto streams: ``kind`` is ``"tuple"`` (elements by
    position), ``"dict"`` (values by key) or ``"single"`` (the value itself); ``names`` in stream order."""

    def __init__(self, kind: str, keys: tuple, names: tuple[str, ...]):
        self.kind, self.keys, self.names = kind, keys, names

    @classmethod
    def of(cls, value: object, names: tuple[str, ...] | None, what: str) -> _Layout:
        """The layout of ``value`` (sample 0, or ``collate_fn([sample 0])``), named by ``names``."""
        if isinstance(value, Mapping):
            if names is not None:
                raise ValueError(f"names={list(names)}: {what} is a dict, whose keys name its streams "
                                 f"({', '.join(map(repr, value))}); leave names out")
            bad = [key for key in value if not isinstance(key, str)]
            if bad:
                raise DataError(f"{what} is a dict with the key {bad[0]!r}; stream names are strings")
            if not value:
                raise DataError(f"{what} is an empty dict; a sample holds at least one stream")
            return cls("dict", tuple(value), tuple(value))
        if isinstance(value, (tuple, list)):
            if names is None:
                if len(value) != 2:
                    raise DataError(f"{what} is {_describe(value)}; name its streams "
                                    f"with names=[...] (one per value; only a pair is named "
                                    f"{' and '.join(PAIR_NAMES)} without it)")
                names = PAIR_NAMES
            if len(names) != len(value):
                raise ValueError(f"names={list(names)} names {len(names)} streams but {what} is a "
                                 f"{type(value).__name__} of {len(value)} values; give one name per value")
            return cls("tuple", tuple(range(len(value))), tuple(names))
        if names is not None and len(names) != 1:
            raise ValueError(f"names={list(names)} names {len(names)} streams but {what} is a single "
                             f"{type(value).__name__} (one stream); give one name")
        return cls("single", (None,), tuple(names or ("features",)))

    def split(self, value: object, what: str) -> list:
        """The values of ``value``'s streams, in stream order.

        Raises:
            DataError: ``value`` has another structure than sample 0 (``what`` names it).
        """
        if self.kind == "tuple":
            if isinstance(value, (tuple, list)) and len(value) == len(self.keys):
                return list(value)
            expected = f"a tuple of {len(self.keys)} values ({', '.join(self.names)})"
        elif self.kind == "dict":
            if isinstance(value, Mapping) and len(value) == len(self.keys):
                try:
                    return [value[key] for key in self.keys]
                except KeyError:
                    pass
            expected = f"a dict with the keys {', '.join(map(repr, self.keys))}"
        else:
            if not isinstance(value, (tuple, list, Mapping)):
                return [value]
            expected = "a single value"
        return _raise(DataError(f"{what} is {_describe(value)}, but sample 0 was {expected}; every sample needs the "
                                f"same structure"))


class _Plan:
    """What reading a chunk of samples needs, in a form that pickles and that each worker holds a copy
    of: the layouts, the streams (from sample 0) and ``collate_fn``. Its methods run in the caller or in
    a worker; everything they raise is a one-line DataError naming the stream and the index."""

    def __init__(self, type_name: str, collate_fn: Callable | None):
        self.type_name = type_name
        self.collate_fn = collate_fn
        self.sample_layout: _Layout | None = None
        self.batch_layout: _Layout | None = None
        self.infos: dict[str, StreamInfo] = {}

    # -- construction ---------------------------------------------------------------------------------
    def describe(self, dataset, names, sequence_names: list[str], num_classes: dict) -> None:
        """Sets the layouts and stream infos from sample 0 (and ``collate_fn([sample 0])``)."""
        sample = self.sample(dataset, 0)
        what = f"{self.type_name}[0]"
        layout = None
        if self.collate_fn is None or sequence_names:
            layout = self.sample_layout = _Layout.of(sample, names, what)
        if self.collate_fn is not None:
            batch = self.collate(dataset, [sample], [0])
            self.batch_layout = _Layout.of(batch, names, f"collate_fn([{what}])")
            if layout is not None and set(layout.names) != set(self.batch_layout.names):
                raise DataError(f"collate_fn([{what}]) holds the streams {list(self.batch_layout.names)} but {what} "
                                f"holds {list(layout.names)}; the batch must have the sample's streams")
        stream_names = (self.batch_layout or layout).names
        unknown = [name for name in sequence_names if name not in stream_names]
        if unknown:
            raise ValueError(f"sequences names {unknown}, which are not streams; the streams are {list(stream_names)}")
        unknown = sorted(set(num_classes) - set(stream_names))
        if unknown:
            raise ValueError(f"num_classes names {unknown}, which are not streams; the streams are "
                             f"{list(stream_names)}")
        sample_values = dict(zip(layout.names, layout.split(sample, what))) if layout is not None else {}
        batch_values = dict(zip(self.batch_layout.names, self.batch_layout.split(batch, what))) \
            if self.batch_layout is not None else {}
        for name in stream_names:
            if name in sequence_names:
                tensor = _to_tensor(sample_values[name], name, what)
                self._check_steps(name, tensor, 0)
                shape = tuple(tensor.shape[1:])
            elif self.batch_layout is not None:
                tensor = _to_tensor(batch_values[name], name, f"collate_fn([{what}])")
                if tensor.dim() == 0 or tensor.shape[0] != 1:
                    raise DataError(f"stream {name!r}: collate_fn([{what}]) returned shape {list(tensor.shape)}; "
                                    f"expected [1, ...] (one row per sample)")
                shape = tuple(tensor.shape[1:])
            else:
                tensor = _to_tensor(sample_values[name], name, what)
                shape = tuple(tensor.shape)
            classes = None
            if name in num_classes:
                classes = check_int(f"num_classes[{name!r}]", num_classes[name], 1)
                check_id_dtype(name, tensor.dtype, classes, what)
            self.infos[name] = StreamInfo(name, shape, tensor.dtype, is_sequence=name in sequence_names,
                                          num_classes=classes)

    # -- reading --------------------------------------------------------------------------------------
    def sample(self, dataset, index: int):
        """``dataset[index]``; its exception as one DataError line."""
        try:
            return dataset[index]
        except Exception as error:  # noqa: BLE001 - any error of user code becomes the one-line DataError
            raise DataError(f"{self.type_name}[{index}] raised {type(error).__name__}: {_one_line(error)}") from error

    def collate(self, dataset, samples: list, indices: list[int]):
        """``collate_fn(samples)``; its exception as one DataError line."""
        try:
            return self.collate_fn(samples)
        except Exception as error:  # noqa: BLE001
            raise DataError(f"collate_fn over {self._span(indices)} raised {type(error).__name__}: "
                            f"{_one_line(error)}") from error

    def read_chunk(self, dataset, indices: np.ndarray) -> dict:
        """The samples ``indices`` collated: name -> tensor ``[n, ...]``, or for a sequence stream
        ``(values [total steps, ...], lengths int64 [n])`` (the caller pads, once for all chunks)."""
        indices = indices.tolist()
        samples = [self.sample(dataset, index) for index in indices]
        values = None
        if self.sample_layout is not None:
            columns = [self.sample_layout.split(sample, f"{self.type_name}[{index}]")
                       for sample, index in zip(samples, indices)]
            values = dict(zip(self.sample_layout.names, zip(*columns)))
        batch = None
        if self.batch_layout is not None:
            collated = self.collate(dataset, samples, indices)
            batch = dict(zip(self.batch_layout.names,
                             self.batch_layout.split(collated, f"collate_fn over {self._span(indices)}")))
        del samples
        out = {}
        for name, info in self.infos.items():
            if info.is_sequence:
                out[name] = self._pack(info, values[name], indices)
                ids = out[name][0]
            elif batch is not None:
                ids = out[name] = self._batch(info, batch[name], indices)
            else:
                ids = out[name] = self._stack(info, values[name], indices)
            if info.num_classes is not None:
                self._check_ids(info, ids, indices, out[name][1] if info.is_sequence else None)
        return out

    def scan_chunk(self, dataset, indices: np.ndarray, names: tuple[str, ...]) -> dict[str, np.ndarray]:
        """The steps of the sequence streams ``names`` of the samples ``indices`` (int64 arrays)."""
        lengths = {name: np.empty(len(indices), dtype=np.int64) for name in names}
        positions = [self.sample_layout.names.index(name) for name in names]
        for row, index in enumerate(indices.tolist()):
            values = self.sample_layout.split(self.sample(dataset, index), f"{self.type_name}[{index}]")
            for name, position in zip(names, positions):
                value = values[position]
                shape = getattr(value, "shape", None)
                if shape is None:
                    value = _to_tensor(value, name, f"{self.type_name}[{index}]")
                    shape = value.shape
                if len(shape) == 0:
                    raise DataError(f"stream {name!r}: {self.type_name}[{index}] is a single number; a sequence is an "
                                    f"array of steps [length, ...]")
                if shape[0] == 0:
                    raise DataError(f"stream {name!r}: {self.type_name}[{index}] is an empty sequence; every sequence "
                                    f"needs at least one step")
                lengths[name][row] = shape[0]
        return lengths

    def empty(self) -> dict[str, torch.Tensor | Sequences]:
        """The streams of no samples."""
        out: dict[str, torch.Tensor | Sequences] = {}
        for name, info in self.infos.items():
            data = torch.empty((0, 0, *info.shape) if info.is_sequence else (0, *info.shape), dtype=info.dtype)
            out[name] = Sequences(data, torch.zeros(0, dtype=torch.int64), _checked=True) if info.is_sequence else data
        return out

    # -- per stream -----------------------------------------------------------------------------------
    def _span(self, indices: list[int]) -> str:
        return f"{self.type_name}[{indices[0]}]" if len(indices) == 1 else \
            f"{self.type_name}[{indices[0]}..{indices[-1]}] ({len(indices)} samples)"

    def _cast(self, info: StreamInfo, tensor: torch.Tensor, what: str) -> torch.Tensor:
        if tensor.dtype == info.dtype:
            return tensor
        if torch.can_cast(tensor.dtype, info.dtype):
            return tensor.to(info.dtype)
        return _raise(DataError(f"stream {info.name!r}: {what} holds {str(tensor.dtype).replace('torch.', '')} values "
                                f"but sample 0 holds {str(info.dtype).replace('torch.', '')}; every sample of a stream "
                                f"needs one dtype (or one that converts to it without loss)"))

    def _stack(self, info: StreamInfo, values: tuple, indices: list[int]) -> torch.Tensor:
        """The default collation of a stream with one value per sample: the values stacked."""
        kind = type(values[0])
        if not info.shape and kind in _NUMBER_DTYPES and all(type(value) is kind for value in values):
            return self._cast(info, torch.tensor(values, dtype=_NUMBER_DTYPES[kind]), self._span(indices))
        tensors = []
        for value, index in zip(values, indices):
            what = f"{self.type_name}[{index}]"
            tensor = _to_tensor(value, info.name, what)
            if tensor.shape != info.shape:
                raise DataError(f"stream {info.name!r}: {what} has shape {list(tensor.shape)} but sample 0 has "
                                f"{list(info.shape)}; a stream with one value per sample needs one shape (give "
                                f"variable-length streams in sequences=[...])")
            tensors.append(self._cast(info, tensor, what))
        return _collate(torch.stack, tensors, (len(tensors), *info.shape))

    def _check_steps(self, name: str, tensor: torch.Tensor, index: int) -> None:
        if tensor.dim() == 0:
            raise DataError(f"stream {name!r}: {self.type_name}[{index}] is a single number; a sequence is an array "
                            f"of steps [length, ...]")
        if tensor.shape[0] == 0:
            raise DataError(f"stream {name!r}: {self.type_name}[{index}] is an empty sequence; every sequence needs "
                            f"at least one step")

    def _pack(self, info: StreamInfo, values: tuple, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """A sequence stream's samples back to back, and their lengths."""
        tensors = []
        for value, index in zip(values, indices):
            what = f"{self.type_name}[{index}]"
            tensor = _to_tensor(value, info.name, what)
            self._check_steps(info.name, tensor, index)
            if tuple(tensor.shape[1:]) != info.shape:
                raise DataError(f"stream {info.name!r}: the steps of {what} have shape {list(tensor.shape[1:])} but "
                                f"those of sample 0 have {list(info.shape)}; every step of a sequence stream needs "
                                f"one shape")
            tensors.append(self._cast(info, tensor, what))
        lengths = torch.tensor([len(tensor) for tensor in tensors], dtype=torch.int64)
        return _collate(torch.cat, tensors, (int(lengths.sum()), *info.shape)), lengths

    def _batch(self, info: StreamInfo, value: object, indices: list[int]) -> torch.Tensor:
        """A stream of ``collate_fn``'s batch, checked: ``[n, *shape]`` of the stream's dtype."""
        what = f"collate_fn over {self._span(indices)}"
        tensor = _to_tensor(value, info.name, what)
        if tuple(tensor.shape) != (len(indices), *info.shape):
            raise DataError(f"stream {info.name!r}: {what} returned shape {list(tensor.shape)}; expected "
                            f"{[len(indices), *info.shape]} (one row per sample, each like collate_fn([sample 0]))")
        return self._cast(info, tensor, what)

    def _check_ids(self, info: StreamInfo, ids: torch.Tensor, indices: list[int],
                   lengths: torch.Tensor | None) -> None:
        """Raises DataError naming the first sample with an id outside ``[0, num_classes)``."""
        if not ids.numel() or (int(ids.min()) >= 0 and int(ids.max()) < info.num_classes):
            return
        flat = ids.reshape(len(ids), -1)
        outside = (flat < 0) | (flat >= info.num_classes)
        first = int(outside.any(dim=1).nonzero()[0])
        value = int(flat[first][outside[first]][0])
        if lengths is not None:  # a position among the steps: find its sample
            first = int(np.searchsorted(np.cumsum(lengths.numpy()), first, side="right"))
        raise DataError(f"stream {info.name!r}: {self.type_name}[{indices[first]}] holds the id {value}, outside its "
                        f"vocabulary [0, {info.num_classes}) (num_classes={info.num_classes})")


# -- values -----------------------------------------------------------------------------------------------

def _to_tensor(value: object, name: str, what: str) -> torch.Tensor:
    """A sample's value as a CPU-side tensor (tensors as they are; see the class docstring)."""
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, (np.ndarray, np.generic)):
        return _from_numpy(np.asarray(value), name, what)
    kind = _NUMBER_DTYPES.get(type(value))
    if kind is None:
        kind = next((dtype for number, dtype in _NUMBER_DTYPES.items() if isinstance(value, number)), None)
    if kind is not None:
        try:
            return torch.tensor(value, dtype=kind)
        except (RuntimeError, OverflowError) as error:
            raise DataError(f"stream {name!r}: {what} holds {value!r}, which is no {kind}: {_one_line(error)}") from None
    if isinstance(value, list):
        return _from_numpy(np.asarray(value), name, what)
    raise DataError(f"stream {name!r}: {what} is {_describe(value)}; expected a tensor, a numpy array or a number")


def _from_numpy(array: np.ndarray, name: str, what: str) -> torch.Tensor:
    if array.dtype.kind not in "biufc":
        raise DataError(f"stream {name!r}: {what} is an array of {array.dtype} values; expected numbers (a list of "
                        f"arrays of different shapes is a sequence stream's job, see sequences=)")
    if array.dtype == np.float64:
        array = array.astype(np.float32)
    elif not array.flags.writeable or not array.flags.c_contiguous:
        array = array.copy()
    try:
        return torch.from_numpy(array)
    except TypeError as error:
        raise DataError(f"stream {name!r}: {what}: {_one_line(error)}") from None


def _collate(combine: Callable, tensors: list[torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
    """``combine(tensors, 0)`` (stack or cat); in a worker process a large result is written straight into
    the worker's shared-memory arena, which the reading process copies it out of (no other copy)."""
    first = tensors[0]
    if _ARENAS is not None and first.element_size() * int(np.prod(shape)) >= _INLINE_BYTES:
        out = _ARENAS.allocate(shape, first.dtype)
        if out is not None:
            return combine(tensors, 0, out=out)
    return combine(tensors, 0)


def _padded(values: torch.Tensor, lengths: torch.Tensor, info: StreamInfo) -> Sequences:
    """Sequences ``[n, longest, *step_shape]`` from steps stored back to back and their lengths."""
    longest = int(lengths.max()) if len(lengths) else 0
    data = torch.full((len(lengths), longest, *info.shape), PADDING_VALUE, dtype=values.dtype)
    if len(lengths):
        data[torch.arange(longest).unsqueeze(0) < lengths.unsqueeze(1)] = values  # row-major: sequence by sequence
    return Sequences(data, lengths, _checked=True)


# -- checks and messages ------------------------------------------------------------------------------------

def _check_map_style(dataset: object) -> None:
    """Raises TypeError for a DataLoader, an IterableDataset or anything without ``__getitem__`` and ``__len__``."""
    check_not_a_data_loader(dataset)
    why = ("dtrain reads samples by index, so that each rank reads its share exactly once per sweep, sweeps are "
           "shuffled and a checkpoint resumes mid-sweep")
    instead = ("give a map-style Dataset (__getitem__(index) and __len__), e.g. materialise the stream into a list "
               "of samples, or a StreamDeserializer (see docs/data.md)")
    if isinstance(dataset, torch.utils.data.IterableDataset):
        raise TypeError(f"{type(dataset).__name__} is an IterableDataset, which can only be read from its start; "
                        f"{why}; {instead}")
    missing = [name for name in ("__getitem__", "__len__") if not hasattr(dataset, name)]
    if missing or isinstance(dataset, (str, bytes, Mapping)):
        lacks = f"has no {' and no '.join(missing)}" if missing else "is not a data set of samples"
        raise TypeError(f"{type(dataset).__name__} {lacks}; {why}; {instead}")


def _checked_names(names: object) -> tuple[str, ...] | None:
    if names is None:
        return None
    if isinstance(names, str) or not isinstance(names, (list, tuple)):
        raise TypeError(f"names must be a list of stream names, got {names!r}")
    bad = [name for name in names if not isinstance(name, str) or not name]
    if bad or not names:
        raise TypeError(f"names must be a non-empty list of non-empty strings, got {list(names)!r}")
    if len(set(names)) != len(names):
        raise ValueError(f"names must differ from each other, got {list(names)}")
    return tuple(names)


def _describe(value: object) -> str:
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)} value{'' if len(value) == 1 else 's'}"
    if isinstance(value, Mapping):
        return f"a dict with the keys {', '.join(map(repr, value))}"
    if isinstance(value, (torch.Tensor, np.ndarray)):
        return f"a {type(value).__name__} of shape {list(value.shape)}"
    return f"a {type(value).__name__}"


def _one_line(error: object) -> str:
    return " ".join(str(error).split()) or "(no message)"


def _raise(error: Exception):
    raise error


def _qualified_name(value: object) -> str:
    kind = type(value)
    return f"{kind.__module__}.{kind.__qualname__}"


# -- putting chunks together ---------------------------------------------------------------------------------

class _Merger:
    """Collects the chunks of one read as they arrive: rows of the streams with one value per sample are
    copied into their place in tensors ``[n, ...]`` made once (one chunk is kept as it is, unless it lies in
    a worker's arena), a sequence stream's steps are kept to be padded once at the end."""

    def __init__(self, streams: Mapping[str, StreamInfo], chunks: list[np.ndarray]):
        self.streams = streams
        self.bounds = np.cumsum([0] + [len(chunk) for chunk in chunks]).tolist()
        self.single = len(chunks) == 1
        self.fixed: dict[str, torch.Tensor] = {} if self.single else {
            name: torch.empty((self.bounds[-1], *info.shape), dtype=info.dtype)
            for name, info in streams.items() if not info.is_sequence}
        self.packed: dict[str, list] = {name: [None] * len(chunks) for name, info in streams.items() if info.is_sequence}

    def add(self, number: int, part: dict) -> None:
        """Takes chunk ``number``'s streams (copying what lies in an arena, which its worker reuses)."""
        for name, info in self.streams.items():
            value = part[name]
            if info.is_sequence:
                self.packed[name][number] = (_owned(value[0]), _owned(value[1]))
            elif self.single:
                self.fixed[name] = _owned(value)
            else:
                self.fixed[name][self.bounds[number]:self.bounds[number + 1]].copy_(_borrowed(value))

    def result(self) -> dict:
        """name -> tensor ``[n, ...]``, or ``(steps back to back, lengths)`` for a sequence stream."""
        out: dict = dict(self.fixed)
        for name, parts in self.packed.items():
            out[name] = (parts[0][0] if len(parts) == 1 else torch.cat([values for values, _ in parts]),
                         parts[0][1] if len(parts) == 1 else torch.cat([lengths for _, lengths in parts]))
        return out


class _Borrowed:
    """A tensor that lies in a worker process's arena: valid until that worker's next task."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


def _borrowed(value) -> torch.Tensor:
    return value.tensor if isinstance(value, _Borrowed) else value


def _owned(value) -> torch.Tensor:
    return value.tensor.clone() if isinstance(value, _Borrowed) else value


# -- workers ------------------------------------------------------------------------------------------------

#: chunks per worker and read. More than one lets a worker that is done take the next chunk (a slow
#: sample or a busy core then delays a read less), at a cost per task; on samples of even cost one was as
#: fast or faster (benchmarks/dataset_adapter.py)
_TASKS_PER_WORKER = 1
#: tasks a worker process holds at once (with several, it starts the next while the reading process
#: takes in the last; each has its own arena). Two: the chunk of the read being taken in and that of the
#: next, prefetched one, the most a source reading two minibatches ahead has outstanding at a worker
#: (it announces a read only once the one before last was taken in); more tasks wait for a free slot
_QUEUE_DEPTH = 2
#: a task whose indices take more bytes than this goes only to an idle worker (one that is reading its
#: pipe): a busy worker's pipe then never fills up with tasks while it waits to send a reply
_QUEUED_TASK_BYTES = 32 * 1024
#: the arenas of this process when it is a worker process (None elsewhere)
_ARENAS: _Arenas | None = None


class _ThreadJob:
    """The tasks of one read in a thread pool: their futures, and where their results go."""

    __slots__ = ("futures", "on_part")

    def __init__(self, futures: list, on_part: Callable[[int, dict], None]):
        self.futures, self.on_part = futures, on_part


class _ThreadWorkers:
    """A thread pool: one task per chunk, run as soon as a thread is free (a prefetched read's tasks
    queue behind those before them); the results are handed on in chunk order."""

    broken = False

    def __init__(self, count: int, dataset, plan: _Plan):
        self._dataset, self._plan = dataset, plan
        self._executor = ThreadPoolExecutor(count, thread_name_prefix="dtrain-dataset")

    def submit(self, method: str, tasks: list[tuple], on_part: Callable[[int, dict], None]) -> _ThreadJob:
        """Queues the tasks ``plan.method(dataset, *task)``; their results go to ``on_part`` in :meth:`collect`."""
        function = getattr(self._plan, method)
        return _ThreadJob([self._executor.submit(function, self._dataset, *task) for task in tasks], on_part)

    def collect(self, job: _ThreadJob) -> bool:
        """Waits for the job's tasks and hands their results on in order (the first error in index order is
        raised); True: a thread pool loses no task."""
        wait(job.futures)
        for number, future in enumerate(job.futures):
            job.on_part(number, future.result())
        return True

    def drop(self, job: _ThreadJob) -> None:
        """Forgets a job: its tasks that have not started never run."""
        for future in job.futures:
            future.cancel()

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)


class _Arenas:
    """In a worker process: ``depth`` shared-memory byte buffers that its results are written into, one
    per task in turn; the reading process maps each once and copies the results out before it sends the
    task that reuses the buffer. A buffer grows (a new one, sent once) when a task needed more."""

    def __init__(self, depth: int):
        self.depth = depth
        self.buffers: list[torch.Tensor | None] = [None] * depth
        self.generations = [0] * depth
        self.needed = [0] * depth
        self.slot = -1
        self.offset = 0

    def start_task(self) -> tuple[int, int, torch.Tensor | None]:
        """Moves to the next buffer, replacing it when the last task in it needed more room; returns
        ``(slot, generation, new buffer or None)`` for the reply."""
        self.slot = (self.slot + 1) % self.depth
        slot, fresh = self.slot, None
        buffer = self.buffers[slot]
        if self.needed[slot] > (0 if buffer is None else buffer.numel()):
            size = -(-self.needed[slot] * 5 // 4 // 4096) * 4096  # a quarter to spare, whole pages
            fresh = self.buffers[slot] = torch.empty(size, dtype=torch.uint8).share_memory_()
            self.generations[slot] += 1
        self.needed[slot] = self.offset = 0
        return slot, self.generations[slot], fresh

    def allocate(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """A tensor in this task's buffer (64-byte aligned), or None when it does not fit (it will next time)."""
        start = -(-self.offset // 64) * 64
        nbytes = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
        self.needed[self.slot] = max(self.needed[self.slot], start + nbytes)
        buffer = self.buffers[self.slot]
        if buffer is None or start + nbytes > buffer.numel():
            return None
        self.offset = start + nbytes
        return buffer[start:start + nbytes].view(dtype).view(shape)

    def place(self, tensor: torch.Tensor):
        """``tensor`` as a reference into this task's buffer (copied there if it is elsewhere and fits), or
        the tensor itself."""
        buffer = self.buffers[self.slot]
        if buffer is not None and tensor.is_contiguous():
            base, size = buffer.data_ptr(), buffer.numel()
            start = tensor.data_ptr() - base
            if 0 <= start < size and tensor.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr():
                return _InArena(start, tuple(tensor.shape), tensor.dtype)
        out = self.allocate(tuple(tensor.shape), tensor.dtype)
        if out is None:
            return tensor
        out.copy_(tensor)
        return _InArena(out.data_ptr() - buffer.data_ptr(), tuple(tensor.shape), tensor.dtype)


class _InArena:
    """Where a result tensor lies in its task's arena: byte offset, shape and dtype."""

    __slots__ = ("offset", "shape", "dtype")

    def __init__(self, offset: int, shape: tuple[int, ...], dtype: torch.dtype):
        self.offset, self.shape, self.dtype = offset, shape, dtype

    def __getstate__(self):
        return self.offset, self.shape, self.dtype

    def __setstate__(self, state):
        self.offset, self.shape, self.dtype = state


class _ProcessJob:
    """The tasks of one read at the worker processes: sent in order as arena slots free up, their replies
    handed to ``on_part`` (None once the read was dropped: replies are taken in and thrown away)."""

    __slots__ = ("number", "method", "tasks", "on_part", "sent", "open", "failures", "lost")

    def __init__(self, number: int, method: str, tasks: list[tuple], on_part: Callable[[int, dict], None]):
        self.number, self.method, self.tasks, self.on_part = number, method, tasks, on_part
        self.sent = 0  # tasks sent so far, in order
        self.open = len(tasks)  # tasks neither answered nor given up
        self.failures: dict[int, Exception] = {}  # task number -> its error
        self.lost = False  # tasks went down with a worker that died on another job's task


class _ProcessWorkers:
    """Persistent worker processes, each with a pipe. A task is ``(method, args)``; the reply is
    ``(status, payload, arena)``: ``("ok", result)`` with large tensors in the worker's arena and small
    ones inline, or ``("error", (type, module, message))``; ``arena`` is ``(slot, generation, buffer or
    None)``. A worker answers its tasks in the order they were sent.

    :meth:`submit` (any thread, under ``_lock`` with the rest of the bookkeeping) queues a read's tasks
    and sends what the arena slots allow: at most ``_QUEUE_DEPTH`` tasks held by one worker at a time
    (one, for a task of many indices), each to the worker holding fewest, jobs in the order they were
    submitted. :meth:`collect` (one
    thread at a time: the reader) takes in the replies up to the last of its job's, each copied out of
    its arena before the slot is freed and the next task sent."""

    def __init__(self, count: int, dataset, plan: _Plan):
        import torch.multiprocessing  # noqa: F401 - registers the shared-memory reductions of tensors

        methods = multiprocessing.get_all_start_methods()
        context = multiprocessing.get_context("fork" if "fork" in methods else None)
        self.type_name = plan.type_name
        self.broken = False
        self._depth = _QUEUE_DEPTH
        self._lock = threading.Lock()
        self._jobs = 0  # jobs submitted so far: each one's number
        self._unsent: deque[_ProcessJob] = deque()  # jobs with tasks still to send, oldest first
        self._held: list[deque] = []  # per worker: (job, task number) sent and not yet taken in, oldest first
        self._cause: _ProcessJob | None = None  # the job whose task a worker died on
        self._workers: list[tuple[multiprocessing.Process, multiprocessing.connection.Connection]] = []
        self._arenas: list[list] = []  # per worker, per slot: [generation, buffer]
        self._finalizer = weakref.finalize(self, _stop_processes, self._workers)
        for number in range(count):
            ours, theirs = context.Pipe()
            process = context.Process(target=_worker_main, args=(dataset, plan, theirs, ours, os.getpid(), self._depth),
                                      name=f"dtrain-dataset-{number}", daemon=True)
            process.start()
            theirs.close()
            self._workers.append((process, ours))
            self._held.append(deque())
            self._arenas.append([[0, None] for _ in range(self._depth)])

    def submit(self, method: str, tasks: list[tuple], on_part: Callable[[int, dict], None]) -> _ProcessJob:
        """Queues the tasks ``plan.method(dataset, *task)`` behind those submitted before, sending what the
        slots allow now; the replies go to ``on_part(number, result)`` in :meth:`collect`."""
        with self._lock:
            job = _ProcessJob(self._jobs, method, tasks, on_part)
            self._jobs += 1
            self._unsent.append(job)
            self._send()
        return job

    def drop(self, job: _ProcessJob) -> None:
        """Forgets a job: its tasks not yet sent never are; the replies of the others are thrown away."""
        with self._lock:
            job.on_part = None
            self._send()

    def collect(self, job: _ProcessJob) -> bool:
        """Takes in the replies up to the last of ``job``'s (those of earlier jobs first), handing them to
        their jobs; raises the job's lowest task's error, if any. False: some of its tasks were lost
        with a worker that died on another job's task (run it again on fresh workers)."""
        try:
            while job.open:
                waiting = {}
                with self._lock:
                    for worker, held in enumerate(self._held):
                        if held and held[0][0].number <= job.number:
                            process, connection = self._workers[worker]
                            waiting[connection] = waiting[process.sentinel] = worker
                if not waiting:  # none of its tasks can come any more (a worker died, the others were not sent)
                    self.broken = True
                    job.lost = job.lost or job is not self._cause
                    break
                for worker in sorted({waiting[ready] for ready in multiprocessing.connection.wait(list(waiting))}):
                    self._take(worker)
        except BaseException:
            self.broken = True  # an interrupted reply leaves a pipe in an unknown state: the next read starts afresh
            raise
        if job.lost:
            return False
        if job.failures:
            raise job.failures[min(job.failures)]  # the lowest chunk's, as without workers
        return True

    def _take(self, worker: int) -> None:
        """Takes in the reply to ``worker``'s oldest task."""
        with self._lock:
            job, number = self._held[worker][0]
        status, payload = self._receive(worker, job.tasks[number][0])
        if status == "ok" and job.on_part is not None:
            job.on_part(number, payload)  # copies out of the arena before the slot is freed below
        with self._lock:
            self._held[worker].popleft()
            job.open -= 1
            if status != "ok":
                job.failures[number] = payload
                if status == "dead":  # on this task; the tasks it held after it are lost with it
                    self.broken, self._cause = True, job
                    for other, other_number in self._held[worker]:
                        other.open -= 1
                        if other is job:
                            job.failures[other_number] = payload
                        else:
                            other.lost = True
                    self._held[worker].clear()
            self._send()

    def _send(self) -> None:
        """Sends queued tasks while a worker has a free slot (under ``_lock``); gives up the unsent tasks of a
        job that failed or was dropped, and all of them once a worker died."""
        while self._unsent:
            job = self._unsent[0]
            if self.broken or job.failures or job.on_part is None:
                job.open -= len(job.tasks) - job.sent
                job.sent = len(job.tasks)
                if self.broken and job is not self._cause and job.on_part is not None:
                    job.lost = True
                self._unsent.popleft()
                continue
            worker = min(range(len(self._held)), key=lambda each: len(self._held[each]))
            room = 1 if job.tasks[job.sent][0].nbytes > _QUEUED_TASK_BYTES else self._depth
            if len(self._held[worker]) >= room:
                return
            try:
                self._workers[worker][1].send((job.method, job.tasks[job.sent]))
            except (OSError, ValueError):
                pass  # a dead worker: waiting for its reply says so
            self._held[worker].append((job, job.sent))
            job.sent += 1
            if job.sent == len(job.tasks):
                self._unsent.popleft()

    def _receive(self, worker: int, chunk: np.ndarray) -> tuple[str, object]:
        """``("ok", result)``, ``("error", exception)`` or, when the worker died on the task or its reply was
        lost, ``("dead", DataError)``."""
        process, connection = self._workers[worker]
        span = f"{self.type_name}[{int(chunk[0])}..{int(chunk[-1])}]"
        if connection.poll():
            try:
                status, payload, arena = connection.recv()
            except (EOFError, OSError):
                pass
            except Exception as error:  # noqa: BLE001 - e.g. no file descriptors left for shared memory
                return "dead", DataError(
                    f"the reply of {self.type_name} worker {process.name} for {span} could not be received: "
                    f"{type(error).__name__}: {_one_line(error)} (too many open files? try "
                    f"torch.multiprocessing.set_sharing_strategy('file_system'))")
            else:
                slot, generation, fresh = arena
                if fresh is not None:
                    self._arenas[worker][slot] = [generation, fresh]
                if status == "ok":
                    return "ok", _unpack(payload, self._arenas[worker][slot])
                return "error", _rebuilt_error(*payload)
        process.join(1.0)
        code = process.exitcode
        how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
        return "dead", DataError(f"{self.type_name} worker process {process.name} (pid {process.pid}) {how} while "
                                  f"reading {span} (out of memory, or a crash in native code of __getitem__?)")

    def close(self) -> None:
        self._finalizer()


def _stop_processes(workers: list) -> None:
    """Asks each worker to stop, then ends those that do not within a few seconds (never hangs)."""
    for _, connection in workers:
        try:
            connection.send(None)
        except (OSError, ValueError):
            pass
    deadline = time.monotonic() + 3.0
    for process, connection in workers:
        process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            process.terminate()
            process.join(1.0)
        connection.close()


def _worker_main(dataset, plan: _Plan, connection, parent_end, parent_pid: int, depth: int) -> None:
    """A worker process: reads tasks until told to stop, the pipe closes, or its parent is gone; its
    results go into ``depth`` arenas in turn (it never holds more tasks than that)."""
    global _ARENAS
    arenas = _ARENAS = _Arenas(depth)
    parent_end.close()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the main process's to handle
    torch.set_num_threads(1)
    while True:
        while not connection.poll(_WATCHDOG_SECONDS):
            if os.getppid() != parent_pid:
                return
        try:
            message = connection.recv()
        except (EOFError, OSError):
            return
        if message is None:
            return
        method, args = message
        arena = arenas.start_task()
        try:
            reply = ("ok", _pack(getattr(plan, method)(dataset, *args), arenas), arena)
        except Exception as error:  # noqa: BLE001 - sent to the reading process, raised there
            reply = ("error", (type(error).__name__, type(error).__module__, _one_line(error)), arena)
        try:
            connection.send(reply)
        except (OSError, ValueError):
            return


def _rebuilt_error(type_name: str, module: str, message: str) -> Exception:
    """A worker's exception in the reading process: a DataError as it was, a builtin one (TypeError, ...)
    by its type, any other as a DataError that names its type."""
    if type_name == DataError.__name__ and module == DataError.__module__:
        return DataError(message)
    kind = getattr(builtins, type_name, None) if module == "builtins" else None
    if isinstance(kind, type) and issubclass(kind, Exception):
        try:
            return kind(message)
        except Exception:  # noqa: BLE001 - an exception type that needs other arguments
            pass
    return DataError(f"a worker raised {module}.{type_name}: {message}")


class _Inline:
    """A small tensor sent as pickled bytes (a numpy array) instead of through shared memory."""

    __slots__ = ("array",)

    def __init__(self, array: np.ndarray):
        self.array = array

    def __getstate__(self):
        return self.array

    def __setstate__(self, state):
        self.array = state


def _pack(value, arenas: _Arenas):
    """A worker's result for sending: small tensors inline, large ones as places in the task's arena (or,
    when they do not fit it yet, through torch's shared-memory reductions)."""
    if isinstance(value, torch.Tensor):
        if value.element_size() * value.numel() < _INLINE_BYTES and value.dtype != torch.bfloat16:
            try:
                return _Inline(value.numpy())
            except (TypeError, RuntimeError):
                return value
        return arenas.place(value)
    if isinstance(value, dict):
        return {key: _pack(item, arenas) for key, item in value.items()}
    if isinstance(value, tuple):
        return tuple(_pack(item, arenas) for item in value)
    return value


def _unpack(value, arena: list):
    """The inverse of :func:`_pack` in the reading process; tensors in the arena ``[generation, buffer]``
    come as :class:`_Borrowed` views."""
    if isinstance(value, _Inline):
        return torch.from_numpy(value.array)
    if isinstance(value, _InArena):
        nbytes = int(np.prod(value.shape)) * torch.empty((), dtype=value.dtype).element_size()
        return _Borrowed(arena[1][value.offset:value.offset + nbytes].view(value.dtype).view(value.shape))
    if isinstance(value, dict):
        return {key: _unpack(item, arena) for key, item in value.items()}
    if isinstance(value, tuple):
        return tuple(_unpack(item, arena) for item in value)
    return value
