"""MinibatchSource: CNTK-style reading of a deserializer along an infinite, partitioned timeline.

Semantics (``docs/semantics.md#minibatch-source``, ``docs/data.md``): sizes are global and counted
in samples, and a sample of sequence data is one step of the defining stream. Every worker builds
the same source (same deserializer, seed, limits) and asks for the same global minibatch size;
each gets its share of the global minibatch (a contiguous slice of samples, or whole sequences
dealt by steps), and all advance the same global position. A checkpoint is just that position, so a run resumes on
any world size.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

import numpy as np
import torch

from dtrain.data import _checks
from dtrain.data._checks import (check_bool, check_finite, check_id_dtype, check_int, check_partition,
                                 floating_streams)
from dtrain.data.device_checks import DeferredFiniteChecks
from dtrain.data.chunk_order import ChunkedOrder
from dtrain.data.deserializer import (Deserializer, FeaturesAndLabels, StreamDeserializer, label_tensor,
                                      as_stream_deserializer)
from dtrain.data.errors import DataError
from dtrain.data.limits import reading_limits
from dtrain.data.minibatch import Minibatch
from dtrain.data.streams import Sequences, StreamInfo, StreamReference
from dtrain.data.timeline import SampleTimeline, SequenceTimeline, Span
from dtrain.data.user_source import UserMinibatchSource

__all__ = ["Deserializer", "Minibatch", "MinibatchSource", "StreamDeserializer"]

#: the keys of get_checkpoint_state() without sequences; restore requires exactly these
_STATE_KEYS = ("position", "seed", "samples_per_sweep", "randomize")
#: ... and with sequence streams
_SEQUENCE_STATE_KEYS = _STATE_KEYS + ("sequences_per_sweep", "defining_stream", "length_bucketing")
#: CNTK's default randomization window of chunked data, in chunks (4 GB of its 32 MB chunks)
DEFAULT_WINDOW_IN_CHUNKS = 128


class MinibatchSource(UserMinibatchSource):
    """Read a deserializer as an infinite sequence of sweeps, in global minibatches (a
    :class:`~dtrain.data.UserMinibatchSource` that declares everything the session reads).

    Sweep ``s`` covers timeline positions ``[s*M, (s+1)*M)`` (``M`` sequences; a sample of data
    without sequences is a sequence of one step) and, with ``randomize``, visits the data in a
    permutation that is a pure function of ``(randomization_seed, s)``; without it, in order.
    Reading stops at ``max_samples`` samples or at the end of sweep ``max_sweeps`` (at most one of
    them may be given); with neither, it never stops and minibatches may span a sweep boundary.

    Samples are counted in steps of the *defining stream* (CNTK's samples): a global minibatch of
    ``B`` samples holds whole sequences whose defining steps add up to at most ``B`` (at least one
    sequence), dealt to the partitions by steps: longest first, each to the partition with the fewest
    steps so far, so none gets more than ``B/N`` plus one sequence and none is empty while the
    minibatch holds ``N`` sequences (``dtrain.data.timeline``).

    Args:
        deserializer: a stream deserializer (``streams``, ``num_sequences``, ``sequence_lengths``,
            ``read``), a two-stream one (``num_samples``, ``feature_shape``, ``num_classes``,
            ``get``), or any map-style ``torch.utils.data.Dataset``; see ``dtrain.data.deserializer``.
        randomize: shuffle each sweep (True) or read in data-set order (False).
        randomization_seed: seed of the per-sweep permutations and of random augmentation (>= 0).
        max_samples: total samples to read across all sweeps and partitions, or None;
            ``dtrain.data.FULL_DATA_SWEEP`` reads one sweep, ``INFINITELY_REPEAT`` has no limit (CNTK's).
        max_sweeps: number of sweeps to read, or None (``INFINITELY_REPEAT`` too).
        transform: callable ``transform(features, positions, seed) -> float32 tensor`` applied to
            each local minibatch's ``features`` stream; if it has ``setup(deserializer)``, that is
            called once here. Without a transform, two-stream features are only converted to float32.
        read_ahead: after returning a minibatch, read (decode and transform) the next one in a
            background thread, assuming the same size and partitions; a request that differs
            (another size, partition or position, after a restore) discards it and reads anew, so
            the stream is the same with or without. ``None``: on when the deserializer says reads
            are slow (``benefits_from_read_ahead``, e.g. decoding image files). A deserializer that
            reads with workers of its own may ask for more than one minibatch ahead
            (``read_ahead_minibatches``), so its workers never wait for the next request.
        defining_stream: the stream whose steps count samples, optionally a step slice of it
            (``text[1:]``, the steps a language model predicts). ``None``: the deserializer's own
            ``defining_stream``, else its only sequence stream; ``training_session`` sets it to the
            loss's target when it was not given, so that the data-parallel weighting by samples is
            the loss's own (``docs/data.md#samples-are-steps``).
        length_bucketing: sequences per bucket (0: off): each sweep is read in pools of 32 buckets
            sorted by length and read bucket by bucket in a random order, so a minibatch holds
            sequences of similar length (less padding; ``dtrain.data.timeline``).
        randomization_window_in_chunks, randomization_window_in_samples: for chunked data (a deserializer
            with ``chunk_sizes()``: Parquet, Arrow and tar shards), CNTK's randomization window: each sweep
            visits the chunks in a random order and the samples of each window of consecutive chunks in a
            random order (``dtrain.data.chunk_order``). At most one of them; neither: the deserializer's
            ``randomization_window_in_chunks``, else CNTK's 128 chunks.

    Raises:
        TypeError: an argument has the wrong type (e.g. an ``IterableDataset``).
        ValueError: a value is out of range, or both ``max_samples`` and ``max_sweeps`` are given.
        DataError: a sequence stream has an empty sequence.
    """

    def __init__(
        self,
        deserializer: StreamDeserializer | Deserializer | torch.utils.data.Dataset,
        randomize: bool = True,
        randomization_seed: int = 0,
        max_samples: int | None = None,
        max_sweeps: int | None = None,
        transform: Callable[[torch.Tensor, np.ndarray, int], torch.Tensor] | None = None,
        read_ahead: bool | None = None,
        defining_stream: str | None = None,
        length_bucketing: int = 0,
        randomization_window_in_chunks: int | None = None,
        randomization_window_in_samples: int | None = None,
    ) -> None:
        self._data = as_stream_deserializer(deserializer)
        self._deserializer = getattr(self._data, "deserializer", deserializer) \
            if isinstance(self._data, FeaturesAndLabels) else self._data
        self._randomize = check_bool("randomize", randomize)
        self._seed = check_int("randomization_seed", randomization_seed, 0)
        max_samples, max_sweeps = reading_limits(max_samples, max_sweeps)  # CNTK's INFINITELY_REPEAT, FULL_DATA_SWEEP
        self._max_samples = None if max_samples is None else check_int("max_samples", max_samples, 0)
        self._max_sweeps = None if max_sweeps is None else check_int("max_sweeps", max_sweeps, 0)
        self._streams: dict[str, StreamInfo] = dict(self._data.streams)
        if not self._streams:
            raise ValueError(f"{type(self._deserializer).__name__} declares no streams; a deserializer serves at "
                             f"least one")
        self._sequences_per_sweep = check_int(f"{type(self._deserializer).__name__}.num_sequences",
                                              self._data.num_sequences, 1)
        for info in self._streams.values():
            if info.num_classes is not None:
                check_id_dtype(info.name, info.dtype, info.num_classes, type(self._deserializer).__name__)
        self._lengths = {name: self._checked_lengths(name) for name, info in self._streams.items() if info.is_sequence}
        self._length_bucketing = check_int("length_bucketing", length_bucketing, 0)
        if self._length_bucketing and not self._lengths:
            raise ValueError(f"length_bucketing={self._length_bucketing}: the data has no sequence stream (streams "
                             f"{', '.join(self._streams)}); leave it at 0")
        self._defining: StreamReference | None = None
        self._defining_is_explicit = defining_stream is not None
        if defining_stream is not None:
            self._set_defining(defining_stream, "defining_stream")
        elif self._lengths:
            own = getattr(self._data, "defining_stream", None)
            if own is None and len(self._lengths) == 1:
                own = next(iter(self._lengths))
            if own is not None:
                self._set_defining(own, f"{type(self._deserializer).__name__}.defining_stream")
        self._chunked = self._chunked_order(randomization_window_in_chunks, randomization_window_in_samples)
        self._timeline: SampleTimeline | SequenceTimeline | None = None
        if not self._lengths:
            self._timeline = SampleTimeline(self._sequences_per_sweep, self._seed, self._randomize, self._chunked)
        if transform is not None and not callable(transform):
            raise TypeError(
                f"transform must be callable as transform(features, positions, seed), got "
                f"{type(transform).__name__}"
            )
        if transform is not None:
            features = self._streams.get("features")
            if features is None or features.is_sequence:
                raise TypeError(f"transform applies to a 'features' stream with one value per sample; this data has "
                                f"streams {', '.join(self._streams)}")
        self._transform = transform
        if transform is not None and hasattr(transform, "setup"):
            transform.setup(self._deserializer)
        # in-memory two-stream data is read by index tensor, straight from the deserializer (a call per
        # minibatch saved: the loop's own cost is measured against a bare one)
        self._take = getattr(self._deserializer, "take", None) if isinstance(self._data, FeaturesAndLabels) else None
        self._float_features = isinstance(self._data, FeaturesAndLabels)  # two-stream features are served as float32
        self._position = 0
        if read_ahead is None:
            read_ahead = bool(getattr(self._deserializer, "benefits_from_read_ahead", False)
                              or getattr(self._data, "benefits_from_read_ahead", False))
        self._read_ahead = check_bool("read_ahead", read_ahead)
        self._read_ahead_depth = max(1, int(getattr(self._data, "read_ahead_minibatches", 1)))
        # a deserializer with workers of its own may be told what comes next (``prefetch(indices)``, then
        # ``read`` of the same indices in the same order), so that its workers never wait between reads
        self._prefetch = getattr(self._data, "prefetch", None) if self._take is None else None
        # True: the in-memory data was checked for NaN and infinities once (ArrayDeserializer, StreamArrays), so
        # the minibatches read from it are not (a transform's output still is)
        self._values_finite = getattr(self._deserializer, "values_finite", None)
        # each minibatch's values are checked unless that was done once (a transform's output always is): those on
        # the CPU as they are read, those on an accelerator without waiting for it (dtrain.data.device_checks)
        self._checks_values = transform is not None or self._values_finite is not True
        self._device_checks = DeferredFiniteChecks()
        self._executor: ThreadPoolExecutor | None = None
        # the minibatches being read in the background, in order: (request key, future)
        self._pending: deque[tuple[tuple, Future]] = deque()

    def _chunked_order(self, in_chunks: int | None, in_samples: int | None) -> ChunkedOrder | None:
        """The block randomization of chunked data (None for data read by a full permutation, or in order)."""
        name = type(self._deserializer).__name__
        given = [(key, value) for key, value in (("randomization_window_in_chunks", in_chunks),
                                                 ("randomization_window_in_samples", in_samples)) if value is not None]
        if len(given) > 1:
            raise ValueError("randomization_window_in_chunks and randomization_window_in_samples are exclusive; give "
                             "at most one")
        for key, value in given:
            check_int(key, value, 1)
        chunk_sizes = getattr(self._data, "chunk_sizes", None)
        if chunk_sizes is None:
            if given:
                raise ValueError(f"{given[0][0]}={given[0][1]}: {name} is not chunked (every sweep is one permutation "
                                 f"of all its samples); leave it unset")
            return None
        if given and not self._randomize:
            raise ValueError(f"{given[0][0]}={given[0][1]} applies to randomize=true; with randomize=false the data "
                             f"is read in order, so leave it unset")
        sizes = np.asarray(chunk_sizes(), dtype=np.int64)
        if sizes.ndim != 1 or not len(sizes) or int(sizes.sum()) != self._sequences_per_sweep or sizes.min() < 0:
            raise ValueError(f"{name}.chunk_sizes() must be {self._sequences_per_sweep} sequences (num_sequences) in "
                             f"chunks of >= 0, got {sizes.shape} summing to {int(sizes.sum())}")
        if in_samples is None:
            chunks = in_chunks if in_chunks is not None else \
                getattr(self._data, "randomization_window_in_chunks", DEFAULT_WINDOW_IN_CHUNKS)
            in_samples = max(1, -(-self._sequences_per_sweep * int(chunks) // len(sizes)))
        return ChunkedOrder(sizes, self._seed, min(in_samples, self._sequences_per_sweep))  # a window at most a sweep

    @property
    def randomization_window(self) -> int | None:
        """Samples (sequences) per randomization window of chunked data; None for data that is not chunked."""
        return None if self._chunked is None or not self._randomize else self._chunked.window

    def describe_randomization_window(self) -> str:
        """The start-up line's words on chunked data's shuffling ("" for data read by a full permutation)."""
        window = self.randomization_window
        if window is None:
            return ""
        chunks = len(self._chunked.chunk_sizes)
        return (f"shards read in randomization windows of {window:,} sequences (about "
                f"{min(chunks, window * chunks / self._sequences_per_sweep):.3g} of {chunks:,} chunks): a minibatch "
                f"draws from one window, two at a boundary")

    def _checked_lengths(self, name: str) -> np.ndarray:
        """The sequence stream ``name``'s lengths, checked: one per sequence, each at least one step."""
        lengths = np.asarray(self._data.sequence_lengths(name))
        if lengths.shape != (self._sequences_per_sweep,) or not np.issubdtype(lengths.dtype, np.integer):
            raise ValueError(f"{type(self._deserializer).__name__}.sequence_lengths({name!r}) must be an integer array "
                             f"of {self._sequences_per_sweep} lengths (num_sequences), got shape {lengths.shape} "
                             f"({lengths.dtype})")
        lengths = lengths.astype(np.int64, copy=False)
        if len(lengths) and lengths.min() < 1:
            empty = int(np.argmin(lengths))
            raise DataError(f"stream {name!r}: sequence {empty} of {type(self._deserializer).__name__} is empty "
                            f"({int(lengths[empty])} steps); every sequence needs at least one step")
        return lengths

    def _set_defining(self, text: str, what: str) -> None:
        reference = StreamReference.parse(text, what)
        if reference.part is not None:
            raise ValueError(f"{what}={text!r}: samples are counted in steps of a stream (or a step slice of it), "
                             f"not of its {reference.part}")
        reference.check_against(self._streams.get(reference.name), list(self._streams), what)
        lengths = self._lengths.get(reference.name)
        if lengths is not None:
            try:
                reference.check_keeps_steps(lengths, what, type(self._deserializer).__name__, "there is no sample to count")
            except ValueError as error:
                raise DataError(str(error)) from None
        self._defining = reference

    # -- what the data is ------------------------------------------------------------------------------
    @property
    def read_ahead(self) -> bool:
        """Whether the next minibatch is read in the background (see the class docstring)."""
        return self._read_ahead

    @property
    def deserializer(self):
        """The deserializer this source reads (as given; a torch Dataset is wrapped in a DatasetDeserializer)."""
        return self._deserializer

    @property
    def streams(self) -> dict[str, StreamInfo]:
        """The streams every minibatch has, by name."""
        return dict(self._streams)

    @property
    def has_sequences(self) -> bool:
        """Whether any stream holds sequences (samples are then steps of the defining stream)."""
        return bool(self._lengths)

    @property
    def defining_stream(self) -> str | None:
        """The stream (or step slice) whose steps count samples; None without sequences or before it is known."""
        return self._defining.text if self._defining is not None else None

    @property
    def defining_stream_is_explicit(self) -> bool:
        """Whether ``defining_stream`` was given to this source (else a session may choose it)."""
        return self._defining_is_explicit

    def use_defining_stream(self, text: str, what: str = "defining_stream") -> None:
        """Counts samples in steps of ``text`` from now on (``training_session`` calls it with the loss's
        target when the source was given none). Only before anything is read.

        Raises:
            ValueError: the stream does not exist, or this source has read already with another one.
        """
        previous = self._defining
        self._set_defining(text, what)
        if previous != self._defining and self._timeline is not None and self._lengths and self._position:
            self._defining = previous
            raise ValueError(f"{what}={text!r}: this source has read {self._position} sequences counted in steps of "
                             f"{previous.text!r}; choose the defining stream before reading")
        if previous != self._defining and self._lengths:
            self._timeline = None

    def sequence_lengths(self, reference: str) -> np.ndarray | None:
        """Steps of every sequence of a sequence stream or step slice (``text[:-1]``); None for a stream
        with one value per sample."""
        parsed = StreamReference.parse(reference)
        lengths = self._lengths.get(parsed.name)
        return None if lengths is None else parsed.step_counts(lengths)

    def _timeline_now(self) -> SampleTimeline | SequenceTimeline:
        """The timeline (built on first use, once the defining stream is known)."""
        if self._timeline is None:
            if self._defining is None:
                names = ", ".join(repr(name) for name in self._lengths)
                raise ValueError(f"the data has several sequence streams ({names}); say which one counts samples with "
                                 f"defining_stream=NAME (training_session uses the loss's target)")
            lengths = self._lengths.get(self._defining.name)
            counts = self._defining.step_counts(lengths) if lengths is not None \
                else np.ones(self._sequences_per_sweep, dtype=np.int64)
            sort_lengths = None
            if self._length_bucketing:  # by the defining steps, then by all sequence streams' steps together
                total = np.sum(list(self._lengths.values()), axis=0)
                sort_lengths = counts * (int(total.max()) + 1) + total
            self._timeline = SequenceTimeline(counts, self._seed, self._randomize, self._length_bucketing, sort_lengths,
                                              self._chunked)
        return self._timeline

    @property
    def repeats_forever(self) -> bool:
        """Whether reading never ends: neither ``max_samples`` nor ``max_sweeps`` was given."""
        return self._max_samples is None and self._max_sweeps is None

    @property
    def samples_per_sweep(self) -> int:
        """Samples in one sweep: steps of the defining stream over every sequence (sequences, without any)."""
        return self._timeline_now().samples_per_sweep

    @property
    def sequences_per_sweep(self) -> int:
        """Sequences in one sweep (samples, for data without sequences)."""
        return self._sequences_per_sweep

    @property
    def current_position(self) -> int:
        """Global timeline position: sequences (samples, without sequences) read so far by all partitions together.

        Settable, as CNTK's: setting a value the getter returned makes the source read from there
        again exactly as it did (CNTK's callbacks save and restore it around an evaluation of their
        own). A ``get_checkpoint_state()`` dict is accepted too (CNTK's position is that dict).
        """
        return self._position

    @current_position.setter
    def current_position(self, position: int | dict[str, Any]) -> None:
        if isinstance(position, dict):
            self.restore_from_checkpoint(position)
            return
        position = check_int("current_position", position, 0)
        self._discard_read_ahead()  # read for the old position
        self._position = position

    @property
    def samples_read(self) -> int:
        """Samples (defining steps) read so far by all partitions together."""
        return self._timeline_now().steps_before(self._position)

    # -- reading ---------------------------------------------------------------------------------------
    def next_minibatch(
        self, minibatch_size_in_samples: int, num_data_partitions: int = 1, partition_index: int = 0
    ) -> Minibatch | None:
        """Read this partition's share of the next global minibatch and advance the position.

        The global minibatch holds the sequences from the position on whose samples fit
        ``minibatch_size_in_samples`` (at least one sequence; without sequences exactly that many
        samples), clipped at the reading limit; partition ``k`` of ``N`` gets its share: a contiguous
        slice of samples, or the whole sequences dealt to it by steps (``dtrain.data.timeline``; the
        Minibatch's ``positions`` say where they lie). Every partition must make the same calls: each
        returns a Minibatch (possibly with 0 local samples) for the same number of calls, then None on
        the same call, and all advance the position alike.

        Args:
            minibatch_size_in_samples: global minibatch size ``B`` (samples, >= 1).
            num_data_partitions: number of partitions ``N`` (>= 1), usually the world size.
            partition_index: this partition ``k`` (``0 <= k < N``), usually the rank.

        Returns:
            The local Minibatch, or None once the reading limit is reached.

        Raises:
            TypeError / ValueError: an argument is not an int in its range.
        """
        global_size = minibatch_size_in_samples
        # plain ints in range (every call of a training loop) pass without a call; anything else is checked
        if not (type(global_size) is type(num_data_partitions) is type(partition_index) is int
                and global_size >= 1 and 0 <= partition_index < num_data_partitions):
            global_size = check_int("minibatch_size_in_samples", global_size, 1)
            num_data_partitions, partition_index = check_partition(
                "num_data_partitions", num_data_partitions, "partition_index", partition_index)
        request = self._request(self._position, global_size, num_data_partitions, partition_index)
        if request is None:
            self._discard_read_ahead()
            self._device_checks.flush()
            return None
        if self._pending and self._pending[0][0] == request:
            minibatch = self._pending.popleft()[1].result()  # an error of the background read is raised here
        else:
            if self._pending:
                self._discard_read_ahead()  # never two reads at once: deserializers need not be thread-safe
            minibatch = self._read(*request)
        self._position = request[0].stop
        if self._checks_values:
            self._check_device_values(minibatch)
        if self._read_ahead:
            self._read_ahead_from(self._pending[-1][0][0].stop if self._pending else self._position, global_size,
                                  num_data_partitions, partition_index)
        return minibatch

    def _check_device_values(self, minibatch: Minibatch) -> None:
        """Looks at the finished checks of earlier minibatches' streams on an accelerator, then queues this
        one's (:mod:`dtrain.data.device_checks`; its streams on the CPU were checked as it was read)."""
        self._device_checks.poll()
        on_device = [(name, data) for name, data in floating_streams(minibatch.streams)
                     if _checks.on_accelerator(data) and data.layout == torch.strided]
        if on_device:
            timeline, positions = self._timeline, minibatch.positions
            self._device_checks.add(on_device, lambda row: self._describe_sample(timeline, int(positions[row])))

    def check_pending_values(self) -> None:
        """Waits for the value checks of the minibatches handed out whose streams live on an accelerator, and
        raises DataError naming a sample that holds NaN or an infinity (the session asks at its progress,
        cross-validation and checkpoint points and at the end of training, before it judges the loss)."""
        self._device_checks.flush()

    def _read_ahead_from(self, position: int, global_size: int, num_data_partitions: int, partition_index: int) -> None:
        """Queues background reads of the minibatches that follow ``position``, up to the depth."""
        while len(self._pending) < self._read_ahead_depth:
            following = self._request(position, global_size, num_data_partitions, partition_index)
            if following is None:
                return
            if self._executor is None:
                self._executor = ThreadPoolExecutor(1, thread_name_prefix="dtrain-read-ahead")
            if self._prefetch is not None:  # the deserializer's workers start on it now, not when the thread gets to it
                span, partitions, index = following
                if self._lengths:
                    positions, _ = self._timeline.share(span, partitions, index)
                    if len(positions):
                        self._prefetch(self._timeline.indices_at(positions))
                else:
                    start, stop, _ = self._timeline.share(span, partitions, index)
                    if stop > start:
                        self._prefetch(self._timeline.indices(start, stop))
            self._pending.append((following, self._executor.submit(self._read, *following)))
            position = following[0].stop

    def _request(self, position: int, budget: int, num_data_partitions: int,
                 partition_index: int) -> tuple[Span, int, int] | None:
        """``(global span, partitions, index)`` of the minibatch at ``position``; None past the reading limit."""
        timeline = self._timeline if self._timeline is not None else self._timeline_now()
        end_position = None
        if self._max_sweeps is not None:
            end_position = self._max_sweeps * self._sequences_per_sweep
        elif self._max_samples is not None:
            if self._lengths:
                remaining = self._max_samples - timeline.steps_before(position)
                if remaining <= 0:
                    return None
                budget = min(budget, remaining)
            else:
                end_position = self._max_samples
        span = timeline.span(position, budget, end_position)
        return None if span is None else (span, num_data_partitions, partition_index)

    def _read(self, span: Span, num_data_partitions: int, partition_index: int) -> Minibatch:
        """The minibatch of one request: a pure function of it (no state of the source changes)."""
        timeline = self._timeline
        positions = index = None
        if self._lengths:  # sequences: the share is the positions dealt to this partition (dtrain.data.timeline)
            positions, samples = timeline.share(span, num_data_partitions, partition_index)
            start, count = int(positions[0]) if len(positions) else span.start, len(positions)
            streams = self._checked_read(timeline.indices_at(positions), count)
        else:
            start, stop, samples = timeline.share(span, num_data_partitions, partition_index)
            count = stop - start
            index = timeline.index_tensor(start, stop) if self._take is not None else None
            if index is not None:
                features, labels = self._take(index)
                streams = {"features": features, "labels": labels if labels.dtype is torch.int64 else label_tensor(labels)}
            else:
                streams = self._checked_read(timeline.indices(start, stop), count)
        if self._float_features:
            features = streams["features"]
            if features.dtype is not torch.float32 and self._transform is None:
                streams["features"] = features.to(torch.float32)
        per_sweep = self._sequences_per_sweep
        minibatch = Minibatch(streams, global_num_samples=span.steps, sweep_end=span.stop // per_sweep > span.start // per_sweep,
                              first_position=start, num_samples=samples, num_sequences=count,
                              global_num_sequences=span.stop - span.start,
                              owns_tensors=index is not None and self._transform is None, positions=positions)
        if self._transform is not None:
            minibatch.features = self._apply_transform(minibatch.features, minibatch)
        if self._checks_values:
            check_finite(minibatch.streams, lambda row: self._describe_sample(
                timeline, start + row if positions is None else int(positions[row])))
        return minibatch

    def _describe_sample(self, timeline, position: int) -> str:
        """``sample 137 of Digits (timeline position 1,637)``, or ``MyDataset[137] (...)`` for a torch Dataset: a
        sequence by its index in the data, for messages."""
        index = int(timeline.indices(position, position + 1)[0])
        dataset = getattr(self._deserializer, "dataset", None)
        if dataset is not None:
            where = f"{type(dataset).__name__}[{index}]"
        else:
            where = f"{'sequence' if self._lengths else 'sample'} {index} of {type(self._deserializer).__name__}"
        return f"{where} (timeline position {position:,})"

    def _checked_read(self, indices: np.ndarray, count: int) -> dict:
        """The deserializer's streams of ``indices``, with sequence streams as Sequences, checked against
        what it declared (one line naming the stream when they differ)."""
        streams = self._data.read(indices)
        if not isinstance(streams, Mapping) or set(streams) != set(self._streams):
            got = sorted(streams) if isinstance(streams, Mapping) else type(streams).__name__
            raise DataError(f"{type(self._deserializer).__name__}.read returned {got}; expected the declared streams "
                            f"{sorted(self._streams)}")
        streams = {name: streams[name] for name in self._streams}  # in the declared order
        for name, info in self._streams.items():
            value = streams[name]
            if info.is_sequence and not isinstance(value, Sequences):
                value = streams[name] = Sequences.from_list(value, dtype=info.dtype)
            elif not info.is_sequence and not isinstance(value, torch.Tensor):
                value = streams[name] = torch.as_tensor(value)
            size = len(value) if isinstance(value, Sequences) else (value.shape[0] if value.dim() else -1)
            if size != count:
                raise DataError(f"{type(self._deserializer).__name__}.read returned {size} values of stream {name!r} "
                                f"for {count} sequences; expected one per sequence")
        return streams

    def _discard_read_ahead(self) -> None:
        """Drops the background reads (after they finish, so no read overlaps the next one)."""
        pending, self._pending = self._pending, deque()
        for _, future in pending:
            _wait_quietly(future)

    def close(self) -> None:
        """Stops the read-ahead thread (reading again starts a new one)."""
        self._discard_read_ahead()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_executor"] = None  # threads and futures do not pickle; a copy reads ahead anew
        state["_pending"] = deque()
        return state

    def _apply_transform(self, features: torch.Tensor, minibatch: Minibatch) -> torch.Tensor:
        """The transform's float32 features of ``minibatch`` (at its positions)."""
        positions = minibatch.positions
        transformed = self._transform(features, positions, self._seed)
        if not isinstance(transformed, torch.Tensor) or transformed.dtype != torch.float32:
            raise TypeError(
                f"transform must return a float32 torch.Tensor, got "
                f"{getattr(transformed, 'dtype', type(transformed).__name__)}"
            )
        if transformed.shape[0] != len(positions):
            raise ValueError(
                f"transform must keep the number of samples ({len(positions)}), got {transformed.shape[0]}"
            )
        return transformed

    # -- checkpoints -------------------------------------------------------------------------------------
    def get_checkpoint_state(self) -> dict[str, Any]:
        """Small dict of plain values that ``restore_from_checkpoint`` replays from.

        Keys: ``position`` (global timeline position), ``seed``, ``samples_per_sweep`` and
        ``randomize``; with sequence streams also ``sequences_per_sweep``, ``defining_stream`` and
        ``length_bucketing`` (all but the position guard against restoring into a different stream).
        """
        self._device_checks.flush()  # a position is kept only past minibatches whose values were checked
        state = {
            "position": self._position,
            "seed": self._seed,
            "samples_per_sweep": self.samples_per_sweep,
            "randomize": self._randomize,
        }
        if self._lengths:
            state.update(sequences_per_sweep=self._sequences_per_sweep, defining_stream=self.defining_stream,
                         length_bucketing=self._length_bucketing)
        if self.randomization_window is not None:
            state["randomization_window"] = self.randomization_window
        return state

    def state_dict(self) -> dict[str, Any]:
        """The reading position, in the ``state_dict()`` / ``load_state_dict()`` naming of torchdata's
        ``StatefulDataLoader`` and ``torch.distributed.checkpoint``'s ``Stateful`` protocol, which this source
        satisfies: the same dict as :meth:`get_checkpoint_state` (one format), so a loop or a tool that
        carries state dicts saves and restores dtrain's position. The position is global, so the state
        is the same on every rank and restores exactly at any world size.
        """
        return self.get_checkpoint_state()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue reading from a :meth:`state_dict` (or :meth:`get_checkpoint_state`) dict: the same as
        :meth:`restore_from_checkpoint`, whose checks and errors it has.
        """
        self.restore_from_checkpoint(state_dict)

    def restore_from_checkpoint(self, state: dict[str, Any]) -> None:
        """Continue reading from a state saved by ``get_checkpoint_state``.

        The next minibatches equal the ones the saved source would have read next, whatever
        ``num_data_partitions`` is used now (the position is global).

        Raises:
            TypeError: ``state`` is not a dict or a value has the wrong type.
            ValueError: a key is missing or unknown, or the state's seed, sweep size, randomize flag,
                defining stream or bucketing differs from this source's (it would replay another stream).
        """
        if not isinstance(state, dict):
            raise TypeError(f"checkpoint state must be a dict, got {type(state).__name__}")
        keys = (_SEQUENCE_STATE_KEYS if self._lengths else _STATE_KEYS) + \
            (("randomization_window",) if self.randomization_window is not None else ())
        missing = [key for key in keys if key not in state]
        unknown = sorted(set(state) - set(keys))
        if missing or unknown:
            raise ValueError(
                f"checkpoint state must have keys {list(keys)}; missing {missing}, unknown {unknown}"
            )
        position = check_int("state['position']", state["position"], 0)
        seed = check_int("state['seed']", state["seed"], 0)
        samples_per_sweep = check_int("state['samples_per_sweep']", state["samples_per_sweep"], 1)
        randomize = check_bool("state['randomize']", state["randomize"])
        if seed != self._seed:
            raise ValueError(
                f"checkpoint state has seed {seed} but this source has randomization_seed "
                f"{self._seed}; build the source with randomization_seed={seed}"
            )
        if self._lengths:
            self._check_sequence_state(state)
        if "randomization_window" in state and state["randomization_window"] != self.randomization_window:
            raise ValueError(f"checkpoint state has a randomization window of {state['randomization_window']} samples "
                             f"but this source has {self.randomization_window}; build the source with "
                             f"randomization_window_in_samples={state['randomization_window']}")
        if samples_per_sweep != self.samples_per_sweep:
            raise ValueError(
                f"checkpoint state has samples_per_sweep {samples_per_sweep} but this source's "
                f"deserializer has {self.samples_per_sweep} samples; restore onto the same data set"
            )
        if randomize != self._randomize:
            raise ValueError(
                f"checkpoint state has randomize={randomize} but this source has "
                f"randomize={self._randomize}; build the source with randomize={randomize}"
            )
        self._discard_read_ahead()
        self._position = position

    def _check_sequence_state(self, state: dict[str, Any]) -> None:
        sequences = check_int("state['sequences_per_sweep']", state["sequences_per_sweep"], 1)
        if sequences != self._sequences_per_sweep:
            raise ValueError(f"checkpoint state has {sequences} sequences per sweep but this source's deserializer has "
                             f"{self._sequences_per_sweep}; restore onto the same data set")
        if state["defining_stream"] != self.defining_stream:
            raise ValueError(f"checkpoint state counts samples in steps of {state['defining_stream']!r} but this source "
                             f"counts steps of {self.defining_stream!r}; restore with defining_stream="
                             f"{state['defining_stream']} (a session's target sets it when the source names none)")
        if state["length_bucketing"] != self._length_bucketing:
            raise ValueError(f"checkpoint state has length_bucketing={state['length_bucketing']} but this source has "
                             f"{self._length_bucketing}; build the source with length_bucketing="
                             f"{state['length_bucketing']}")


def _wait_quietly(future: Future) -> None:
    """Waits for a discarded background read; its result or error is not needed."""
    try:
        future.result()
    except Exception:  # noqa: BLE001 - a read that was not asked for cannot fail the one that was
        pass
