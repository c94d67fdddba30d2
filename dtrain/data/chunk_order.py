"""The visiting order of chunked data: CNTK's block randomization as a pure function of ``(seed, sweep)``.

Data bigger than memory is stored in chunks (a Parquet row group, an Arrow record batch, a tar shard) that
are read whole, so a permutation of every sample of the data set would read a chunk per sample. Sweep
``s`` instead visits the chunks in a permutation drawn from ``(seed, s)``, cuts that chunk order into
**windows** (consecutive chunks, a window closing once it holds ``window`` samples), and visits each
window's samples in a permutation of their own. Every sample is still read once per sweep; a minibatch
draws from one window (two at a boundary), so a reader holds one window's chunks at a time.

What it costs in randomness: two samples land in the same minibatch only when their chunks share a
window, and the chunk order within a sweep is a permutation, so a window of ``W`` samples over chunks
of ``c`` samples mixes about ``W / c`` chunks. With a window of the whole data set this is the full
permutation's distribution (not its draw: the two orders differ).

Memory: the order never holds a sweep's full permutation. It keeps the chunk order and the window
boundaries (``O(chunks)``) and the permutations of the few windows being read (``O(window)``), so a
position is found with one binary search over the windows, in the same time at any position.
"""
from __future__ import annotations

import functools

import numpy as np

__all__ = ["ChunkedOrder"]


class ChunkedOrder:
    """The per-sweep visiting order of data stored in chunks (see the module docstring).

    Args:
        chunk_sizes: samples (sequences) of each chunk, in data-set order (chunk ``j`` holds the data-set
            indices ``[starts[j], starts[j] + chunk_sizes[j])``).
        seed: the randomization seed (the chunk order of sweep ``s`` is drawn from ``SeedSequence([seed, s, 2])``,
            window ``w``'s sample order from ``SeedSequence([seed, s, 3, w])``).
        window: samples per randomization window (a window closes at the first chunk that brings it to
            ``window`` samples or more, so it holds at least one chunk).
    """

    def __init__(self, chunk_sizes: np.ndarray, seed: int, window: int):
        sizes = np.asarray(chunk_sizes, dtype=np.int64)
        if sizes.ndim != 1 or not len(sizes) or sizes.min() < 0 or window < 1:
            raise ValueError(f"chunked order needs chunk sizes >= 0 and a window >= 1; got {len(sizes)} chunks, "
                             f"window {window}")
        self.chunk_sizes = sizes
        self.chunk_starts = np.concatenate(([0], np.cumsum(sizes)))
        self.num_samples = int(self.chunk_starts[-1])
        self.seed = seed
        self.window = int(window)
        self._windows = functools.lru_cache(maxsize=4)(self._sweep_windows)
        self._window_cache = functools.lru_cache(maxsize=8)(self._window_indices)

    # -- one sweep ------------------------------------------------------------------------------------
    def _sweep_windows(self, sweep: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(chunk order, window positions, window chunk bounds)`` of sweep ``sweep``: the chunks in visiting
        order, the offsets in the sweep where each window starts (``[windows + 1]``, ending at the sweep's
        samples) and where each window's chunks start in the chunk order (``[windows + 1]``)."""
        generator = np.random.default_rng(np.random.SeedSequence([self.seed, sweep, 2]))
        order = generator.permutation(len(self.chunk_sizes)).astype(np.int64)
        before = np.concatenate(([0], np.cumsum(self.chunk_sizes[order])))  # samples before each chunk in order
        # chunk i opens a new window once the open one holds `window` samples or more (the last one: what is left)
        chunk_bounds, position_bounds = [0], [0]
        for i in range(1, len(order)):
            if before[i] - position_bounds[-1] >= self.window:
                chunk_bounds.append(i)
                position_bounds.append(int(before[i]))
        chunk_bounds.append(len(order))
        position_bounds.append(self.num_samples)
        return order, np.asarray(position_bounds, dtype=np.int64), np.asarray(chunk_bounds, dtype=np.int64)

    def _window_indices(self, sweep: int, window: int) -> np.ndarray:
        """The data-set indices that window ``window`` of sweep ``sweep`` visits, in its order (read-only)."""
        order, _, chunk_bounds = self._windows(sweep)
        chunks = order[chunk_bounds[window]:chunk_bounds[window + 1]]
        indices = np.concatenate([np.arange(self.chunk_starts[chunk], self.chunk_starts[chunk + 1], dtype=np.int64)
                                  for chunk in chunks])
        generator = np.random.default_rng(np.random.SeedSequence([self.seed, sweep, 3, window]))
        indices = indices[generator.permutation(len(indices))]
        indices.setflags(write=False)
        return indices

    # -- what a timeline asks -------------------------------------------------------------------------
    def take(self, sweep: int, offset: int, count: int) -> np.ndarray:
        """Data-set indices at offsets ``[offset, offset + count)`` of sweep ``sweep`` (a new array; the range
        lies within the sweep)."""
        _, position_bounds, _ = self._windows(sweep)
        out = np.empty(count, dtype=np.int64)
        filled = 0
        window = int(np.searchsorted(position_bounds, offset, side="right")) - 1
        while filled < count:
            here = offset + filled - int(position_bounds[window])
            take = min(count - filled, int(position_bounds[window + 1]) - (offset + filled))
            out[filled:filled + take] = self._window_cache(sweep, window)[here:here + take]
            filled += take
            window += 1
        return out

    def sweep(self, sweep: int) -> np.ndarray:
        """Every data-set index in the order sweep ``sweep`` visits them (``[num_samples]``, read-only): what a
        sequence timeline plans with."""
        order = self.take(sweep, 0, self.num_samples)
        order.setflags(write=False)
        return order

    def chunk_of(self, indices: np.ndarray) -> np.ndarray:
        """The chunk holding each data-set index."""
        return np.searchsorted(self.chunk_starts, indices, side="right") - 1
