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

This module is the public class; how samples become streams is ``_dataset_plan`` and the pools of
threads and processes are ``_dataset_workers``. The pool is dtrain's own because ``DataLoader``'s
does not serve: its iterator pulls index lists from its sampler at its own pace and gives each whole
batch to one worker, so a caller can neither announce a given read nor spread one over all workers,
and a prefetched read is only dropped by draining every worker (a persistent iterator's reset waits for
each). It also sends every batch back as new shared-memory segments, a file descriptor per tensor, and
its errors span lines and name no sample (a worker that died, only its pid).
"""
from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence as SequenceType

import numpy as np
import torch

from dtrain.data._checks import check_int, check_not_a_data_loader
from dtrain.data._dataset_plan import Merger, Plan, padded
from dtrain.data._dataset_workers import ProcessWorkers, ThreadWorkers
from dtrain.data.errors import DataError
from dtrain.data.streams import Sequences, StreamInfo, StreamReference

__all__ = ["DatasetDeserializer", "WORKER_TYPES"]

#: the kinds of parallel reading (``worker_type``)
WORKER_TYPES = ("process", "thread")
#: chunks per worker and read. More than one lets a worker that is done take the next chunk (a slow
#: sample or a busy core then delays a read less), at a cost per task; on samples of even cost one was as
#: fast or faster (benchmarks/dataset_adapter.py)
_TASKS_PER_WORKER = 1


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
        self._plan = Plan(type_name, collate_fn)
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
        self._workers: ThreadWorkers | ProcessWorkers | None = None
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
            merger = Merger(self.streams, chunks)
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

    def _started(self) -> ThreadWorkers | ProcessWorkers:
        """The workers, started if there are none (under ``_lock``)."""
        if self._workers is None:
            kind = ProcessWorkers if self.worker_type == "process" else ThreadWorkers
            self._workers = kind(self.num_workers, self.dataset, self._plan)
        return self._workers

    def _start_read(self, workers, indices: np.ndarray) -> tuple[object, Merger]:
        """``(job, merger)``: the chunks of ``indices`` handed to ``workers``, their results to go into ``merger``."""
        chunks = self._chunks(indices)
        merger = Merger(self.streams, chunks)
        return workers.submit("read_chunk", [(chunk,) for chunk in chunks], merger.add), merger

    def _claim(self, workers, indices: np.ndarray) -> tuple[object, Merger] | None:
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
            out[name] = padded(values, lengths, info)
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


# -- checks ----------------------------------------------------------------------------------------------------

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



def _qualified_name(value: object) -> str:
    kind = type(value)
    return f"{kind.__module__}.{kind.__qualname__}"

