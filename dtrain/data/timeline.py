"""Where each global minibatch lies on the reading timeline, and each partition's share of it.

The timeline (``docs/semantics.md#partitions-and-sweeps``) visits sequences: position ``p`` lies in
sweep ``p // M`` (``M`` sequences per sweep) and reads the sequence that sweep's order puts at
``p % M``. A sample of data without sequences is a sequence of one step, so both kinds of data
share these rules; only counting differs:

* :class:`SampleTimeline`: every sequence counts one sample. A global minibatch of ``B`` samples
  is positions ``[p, p + B)`` and partition ``k`` of ``N`` takes ``[p + kB//N, p + (k+1)B//N)``
  (``dtrain.data.partition``).
* :class:`SequenceTimeline`: a sequence counts its steps of the defining stream. A global
  minibatch takes whole sequences while their steps fit the budget (at least one sequence, as
  CNTK's reader), and its sequences are dealt to the ``N`` partitions by steps, longest first,
  each to the partition with the fewest steps so far (``SequenceTimeline.share``). No partition
  gets more than ``S/N`` plus one sequence (``S`` the minibatch's steps), none is empty while the
  minibatch has ``N`` sequences, and a share holds its sequences in timeline order (its positions
  need not be contiguous).

Everything is a pure function of the data's lengths, the seed and the position, so every rank
plans the same global minibatch without talking, and a position restores the same stream at any
world size. Finding a minibatch's end is a binary search over a sweep's cumulative steps: its
cost does not grow with the position.
"""
from __future__ import annotations

import functools
import heapq
from typing import NamedTuple

import numpy as np
import torch

from dtrain.data.chunk_order import ChunkedOrder
from dtrain.data.partition import _cached_sweep_order, partition_bounds, range_to_indices

__all__ = ["BUCKETS_PER_POOL", "SampleTimeline", "SequenceTimeline", "Span", "bucketed_order"]

#: length bucketing sorts pools of this many buckets by length, then reads their buckets in a random order
BUCKETS_PER_POOL = 32


class Span(NamedTuple):
    """A global minibatch: timeline positions ``[start, stop)`` holding ``steps`` samples (a tuple: made
    and compared once per minibatch, where a dataclass would cost microseconds)."""

    start: int
    stop: int
    steps: int


class SampleTimeline:
    """The timeline of data without sequences: one sample per position."""

    def __init__(self, num_samples: int, seed: int, randomize: bool, chunked: ChunkedOrder | None = None):
        self.sequences_per_sweep = num_samples
        self.samples_per_sweep = num_samples
        self.seed = seed
        self.randomize = randomize
        self.chunked = chunked if randomize else None  # chunked data's block randomization, else a full permutation

    def steps_before(self, position: int) -> int:
        """Samples at positions before ``position``."""
        return position

    def span(self, position: int, budget: int, end_position: int | None) -> Span | None:
        """The global minibatch of ``budget`` samples from ``position``, clipped at ``end_position``; None past it."""
        stop = position + budget
        if end_position is not None:
            if position >= end_position:
                return None
            stop = min(stop, end_position)
        return Span(position, stop, stop - position)

    def share(self, span: Span, num_partitions: int, index: int) -> tuple[int, int, int]:
        """``(start, stop, samples)`` of partition ``index``'s share of ``span``."""
        start, stop = partition_bounds(span.start, span.steps, num_partitions, index)
        return start, stop, stop - start

    def indices(self, start: int, stop: int) -> np.ndarray:
        """Data-set indices of positions ``[start, stop)``."""
        if self.chunked is not None:
            return _take_across_sweeps(self.chunked.take, start, stop, self.sequences_per_sweep)
        return range_to_indices(start, stop, self.sequences_per_sweep, self.seed, self.randomize)

    def index_tensor(self, start: int, stop: int) -> torch.Tensor | None:
        """The indices as a slice of the sweep's cached int64 order tensor, where the range lies in one
        randomized sweep (a view: read it, never write to it); None otherwise."""
        if not self.randomize or self.chunked is not None:
            return None
        sweep, offset = divmod(start, self.sequences_per_sweep)
        if offset + stop - start > self.sequences_per_sweep:
            return None
        return _sweep_order_tensor(self.sequences_per_sweep, self.seed, sweep)[offset:offset + stop - start]


class SequenceTimeline:
    """The timeline of sequences, counted in steps of the defining stream.

    Args:
        counts: int64 ``[M]``, the defining stream's steps of each sequence (in data-set order).
        seed, randomize: the per-sweep order (a permutation seeded by ``(seed, sweep)``, as without sequences).
        bucket_size: length bucketing (0: off): each sweep's order is cut into pools of
            ``BUCKETS_PER_POOL * bucket_size`` sequences, each pool sorted by ``sort_lengths`` and cut
            into buckets of ``bucket_size``, and a pool's buckets are read in a random order. A global
            minibatch never spans two buckets (the last one of a bucket may hold fewer samples), so it
            holds sequences of similar length (less padding), while every sweep still reads every
            sequence once.
        sort_lengths: what bucketing sorts by (default ``counts``).
        chunked: the block randomization of chunked data (``dtrain.data.chunk_order``), which then replaces
            the full permutation of each sweep.
    """

    def __init__(self, counts: np.ndarray, seed: int, randomize: bool, bucket_size: int = 0,
                 sort_lengths: np.ndarray | None = None, chunked: ChunkedOrder | None = None):
        self.counts = np.ascontiguousarray(counts, dtype=np.int64)
        self.sequences_per_sweep = int(len(self.counts))
        self.samples_per_sweep = int(self.counts.sum())
        self.seed = seed
        self.randomize = randomize
        self.bucket_size = bucket_size
        self.sort_lengths = self.counts if sort_lengths is None else np.asarray(sort_lengths, dtype=np.int64)
        self.chunked = chunked if randomize else None
        self._cache: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray | None]] = {}
        self._shares: tuple | None = None  # ((span, partitions), positions of each, steps of each) of the last span

    # -- one sweep --------------------------------------------------------------------------------
    def _sweep(self, sweep: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """``(order, cumulative, bucket ends)``: the sweep's data-set indices in visiting order, the steps
        before each of its positions (``[M + 1]``, from 0 to the sweep's steps), and with bucketing the
        offsets where its buckets end (increasing, the last one ``M``). A few sweeps are cached."""
        cached = self._cache.get(sweep)
        if cached is None:
            ends = None
            if self.bucket_size:
                order, ends = bucketed_order(self.sort_lengths, self.seed, sweep, self.randomize, self.bucket_size,
                                             with_bucket_ends=True, chunked=self.chunked)
            else:
                order = self.order(sweep)
            cumulative = np.zeros(self.sequences_per_sweep + 1, dtype=np.int64)
            np.cumsum(self.counts[order], out=cumulative[1:])
            cached = (order, cumulative, ends)
            if len(self._cache) >= 4:
                self._cache.pop(next(iter(self._cache)))
            self._cache[sweep] = cached
        return cached

    def order(self, sweep: int) -> np.ndarray:
        """Data-set indices in the order sweep ``sweep`` visits them (read-only)."""
        if self.bucket_size:
            return bucketed_order(self.sort_lengths, self.seed, sweep, self.randomize, self.bucket_size,
                                  chunked=self.chunked)
        if self.chunked is not None:
            return self.chunked.sweep(sweep)
        if not self.randomize:
            order = np.arange(self.sequences_per_sweep, dtype=np.int64)
            order.setflags(write=False)
            return order
        return _cached_sweep_order(self.sequences_per_sweep, self.seed, sweep)

    # -- positions and steps ------------------------------------------------------------------------
    def steps_before(self, position: int) -> int:
        """Steps of the sequences at positions before ``position``."""
        sweep, offset = divmod(position, self.sequences_per_sweep)
        return sweep * self.samples_per_sweep + int(self._sweep(sweep)[1][offset])

    def span(self, position: int, budget: int, end_position: int | None) -> Span | None:
        """The global minibatch from ``position``: whole sequences while their steps fit ``budget`` (at
        least one), clipped at ``end_position``; None past it."""
        if end_position is not None and position >= end_position:
            return None
        start_steps = self.steps_before(position)
        target = start_steps + budget
        stop = position
        while True:  # usually one step; a budget larger than a sweep walks on into the next sweep
            sweep, offset = divmod(stop, self.sequences_per_sweep)
            _, cumulative, bucket_ends = self._sweep(sweep)
            base = sweep * self.samples_per_sweep
            last = int(np.searchsorted(cumulative, target - base, side="right")) - 1  # positions that fit
            if bucket_ends is not None:  # never past the end of the bucket the minibatch starts in
                last = min(last, int(bucket_ends[np.searchsorted(bucket_ends, offset, side="right")]))
            stop = sweep * self.sequences_per_sweep + max(last, offset)
            if last < self.sequences_per_sweep or self.samples_per_sweep == 0 or bucket_ends is not None:
                break
        stop = max(stop, position + 1)
        if end_position is not None:
            stop = min(stop, end_position)
        return Span(position, stop, self.steps_before(stop) - start_steps)

    def share(self, span: Span, num_partitions: int, index: int) -> tuple[np.ndarray, int]:
        """``(positions, steps)`` of partition ``index``'s share of ``span``: the timeline positions of its
        sequences (int64, increasing, read-only) and their steps.

        The span's sequences are dealt longest first (ties: the earlier position), each to the partition
        with the fewest steps so far; ties go to the one with fewer sequences, then to the first in turn,
        turns starting at ``first_partition(span.start, N)``. So every partition gets at most
        ``S/N + (1 - 1/N) L`` steps (``S = span.steps``, ``L`` its longest sequence), none is empty while
        the span holds ``N`` sequences, and no partition always gets the longest sequence. A pure function
        of the span (its position and lengths) and ``N``: every partition computes the same deal, and the
        last span's is kept for the next partition or read that asks."""
        key = (span, num_partitions)
        shares = self._shares
        if shares is None or shares[0] != key:
            shares = self._shares = (key, *self._deal(span, num_partitions))
        return shares[1][index], shares[2][index]

    def _deal(self, span: Span, num_partitions: int) -> tuple[list[np.ndarray], list[int]]:
        """Every partition's positions and steps of ``span`` (see ``share``)."""
        if num_partitions == 1:
            positions = np.arange(span.start, span.stop, dtype=np.int64)
            positions.setflags(write=False)
            return [positions], [span.steps]
        steps = np.diff(self._steps_from(span.start, span.stop))
        order = np.argsort(-steps, kind="stable")  # longest first, ties in timeline order
        # a heap of keys steps * scale + sequences * N + turn: the least steps, then the fewest sequences, then
        # the earliest turn first (one int compares faster than a tuple); turn t is partition (first + t) % N
        scale = (len(steps) + 1) * num_partitions
        if span.steps < 2**62 // scale:
            increments = (steps[order] * scale + num_partitions).tolist()
        else:  # Python ints do not overflow
            increments = [count * scale + num_partitions for count in steps[order].tolist()]
        heap = list(range(num_partitions))
        rows: list[list[int]] = [[] for _ in range(num_partitions)]
        replace = heapq.heapreplace
        for row, increment in zip(order.tolist(), increments):
            key = heap[0]
            rows[key % num_partitions].append(row)
            replace(heap, key + increment)
        first = first_partition(span.start, num_partitions)
        totals = [0] * num_partitions
        for key in heap:
            totals[(first + key % num_partitions) % num_partitions] = key // scale
        flat, bounds = [], [0]
        for k in range(num_partitions):
            mine = rows[(k - first) % num_partitions]
            mine.sort()  # timeline order within a share
            flat += mine
            bounds.append(len(flat))
        grouped = np.array(flat, dtype=np.int64)
        grouped += span.start
        grouped.setflags(write=False)
        return [grouped[low:high] for low, high in zip(bounds, bounds[1:])], totals

    def _steps_from(self, start: int, stop: int) -> np.ndarray:
        """Steps before each position of ``[start, stop]`` counted from ``start`` (``[stop - start + 1]``)."""
        pieces, position = [], start
        base = 0
        while position < stop or not pieces:
            sweep, offset = divmod(position, self.sequences_per_sweep)
            cumulative = self._sweep(sweep)[1]
            end = min(stop - sweep * self.sequences_per_sweep, self.sequences_per_sweep)
            piece = cumulative[offset:end + 1] - cumulative[offset] + base
            pieces.append(piece if not pieces else piece[1:])
            base = int(piece[-1])
            position = sweep * self.sequences_per_sweep + end
            if position >= stop:
                break
        return np.concatenate(pieces)

    def indices(self, start: int, stop: int) -> np.ndarray:
        """Data-set indices of positions ``[start, stop)`` (a new array)."""
        out = np.empty(max(stop - start, 0), dtype=np.int64)
        filled = 0
        while filled < len(out):
            sweep, offset = divmod(start + filled, self.sequences_per_sweep)
            take = min(len(out) - filled, self.sequences_per_sweep - offset)
            out[filled:filled + take] = self._sweep(sweep)[0][offset:offset + take]
            filled += take
        return out

    def indices_at(self, positions: np.ndarray) -> np.ndarray:
        """Data-set indices of increasing ``positions`` (a share's; a new array)."""
        if not len(positions):
            return np.zeros(0, dtype=np.int64)
        first, last = int(positions[0]), int(positions[-1])
        covering = self.indices(first, last + 1)
        return covering if last - first + 1 == len(positions) else covering[positions - first]

    def index_tensor(self, start: int, stop: int) -> torch.Tensor | None:
        """Always None: sequence data is read through ``indices``."""
        return None


def first_partition(position: int, num_partitions: int) -> int:
    """The partition that a global minibatch starting at ``position`` deals to first (the longest sequence,
    and ties), spread evenly over the partitions by Fibonacci hashing of the position: no partition
    always gets the longest sequences, whatever the stride of the minibatches' positions."""
    return ((position * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF) * num_partitions >> 64


def bucketed_order(lengths: np.ndarray, seed: int, sweep: int, randomize: bool, bucket_size: int,
                   with_bucket_ends: bool = False, chunked: ChunkedOrder | None = None):
    """Length bucketing's visiting order for one sweep (see :class:`SequenceTimeline`).

    A pure function of its arguments: the sweep's permutation (the one without bucketing), cut into
    pools of ``BUCKETS_PER_POOL * bucket_size``; each pool stably sorted by ``lengths``, cut into
    buckets of ``bucket_size`` and, with ``randomize``, its buckets read in an order drawn from
    ``SeedSequence([seed, sweep, 1])``. Every index appears exactly once. With ``with_bucket_ends``,
    returns ``(order, ends)``: also the offsets where the buckets end, in reading order. With ``chunked``, the
    sweep's order is its block randomization instead (pools then lie within a window or two).
    """
    count = len(lengths)
    if chunked is not None and randomize:
        order = chunked.sweep(sweep)
    else:
        order = _cached_sweep_order(count, seed, sweep) if randomize else np.arange(count, dtype=np.int64)
    pool_size = BUCKETS_PER_POOL * bucket_size
    generator = np.random.default_rng(np.random.SeedSequence([seed, sweep, 1]))
    pieces = []
    for pool_start in range(0, count, pool_size):
        pool = order[pool_start:pool_start + pool_size]
        pool = pool[np.argsort(lengths[pool], kind="stable")]
        buckets = [pool[i:i + bucket_size] for i in range(0, len(pool), bucket_size)]
        if randomize:
            buckets = [buckets[i] for i in generator.permutation(len(buckets))]
        pieces.extend(buckets)
    result = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)
    result.setflags(write=False)
    if not with_bucket_ends:
        return result
    return result, np.cumsum([len(piece) for piece in pieces], dtype=np.int64)


def _take_across_sweeps(take, start: int, stop: int, per_sweep: int) -> np.ndarray:
    """``take(sweep, offset, count)`` over the positions ``[start, stop)``, which may span sweeps."""
    pieces, position = [], start
    while position < stop or not pieces:
        sweep, offset = divmod(position, per_sweep)
        count = min(stop - position, per_sweep - offset)
        pieces.append(take(sweep, offset, max(count, 0)))
        position += max(count, 1)
    return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)


@functools.lru_cache(maxsize=4)  # the sweeps being read by a few streams at once (train, cross-validation, ...)
def _sweep_order_tensor(num_samples: int, seed: int, sweep: int) -> torch.Tensor:
    """``sweep_order`` of a randomized sweep as an int64 tensor (cached: a minibatch reads a slice of it;
    a copy, because the shared order is read-only and torch tensors cannot be)."""
    return torch.from_numpy(_cached_sweep_order(num_samples, seed, sweep).copy())
