"""Pure index maths for reading an infinite sample timeline in partitions.

CNTK's model (``docs/semantics.md#partitions-and-sweeps``): reading follows an infinite nominal timeline
of sample positions 0, 1, 2, ...; sweep ``s`` covers positions ``[s*M, (s+1)*M)`` where ``M``
is the number of samples in the data set. With randomisation, sweep ``s`` visits the data in a
permutation that depends only on ``(seed, s)``, so every worker computes the same global order
without talking to the others. A global minibatch is a contiguous range of positions; each of
``N`` partitions takes a contiguous, balanced slice of it.

Everything here is a pure function of its arguments (the permutation cache only saves time).
"""

from __future__ import annotations

import functools

import numpy as np

from dtrain.data._checks import check_bool, check_int, check_partition

__all__ = ["partition_slice", "sweep_order", "timeline_to_indices"]


def partition_slice(
    global_start: int, global_size: int, num_partitions: int, partition_index: int
) -> tuple[int, int]:
    """Timeline range ``[start, stop)`` of one partition's share of a global minibatch.

    The global minibatch is positions ``[global_start, global_start + global_size)``. Partition
    ``k`` of ``N`` gets ``[global_start + k*B//N, global_start + (k+1)*B//N)`` with ``B`` the
    global size: the shares are contiguous, disjoint, cover the minibatch, and differ in size by
    at most one sample (a share may be empty when ``B < N``).

    Args:
        global_start: first timeline position of the global minibatch (samples, >= 0).
        global_size: samples in the global minibatch (>= 0).
        num_partitions: number of partitions ``N`` (>= 1).
        partition_index: this partition ``k``, ``0 <= k < N``.

    Raises:
        TypeError / ValueError: an argument is not an int in its range.
    """
    global_start = check_int("global_start", global_start, 0)
    global_size = check_int("global_size", global_size, 0)
    num_partitions, partition_index = check_partition("num_partitions", num_partitions, "partition_index", partition_index)
    return partition_bounds(global_start, global_size, num_partitions, partition_index)


def partition_bounds(global_start: int, global_size: int, num_partitions: int, partition_index: int) -> tuple[int, int]:
    """:func:`partition_slice` for arguments already checked (the source's read, once per minibatch)."""
    return (global_start + partition_index * global_size // num_partitions,
            global_start + (partition_index + 1) * global_size // num_partitions)


@functools.lru_cache(maxsize=8)
def _cached_sweep_order(num_samples: int, seed: int, sweep: int) -> np.ndarray:
    # SeedSequence mixes (seed, sweep) into independent streams, so consecutive seeds or sweeps
    # do not give correlated permutations (unlike seeding with seed + sweep).
    generator = np.random.default_rng(np.random.SeedSequence([seed, sweep]))
    order = generator.permutation(num_samples).astype(np.int64, copy=False)
    order.setflags(write=False)  # shared through the cache; callers must not mutate it
    return order


def sweep_order(num_samples: int, seed: int, sweep: int, randomize: bool) -> np.ndarray:
    """Data-set indices in the order sweep ``sweep`` visits them.

    With ``randomize`` the order is a permutation drawn from a numpy Generator seeded with
    ``SeedSequence([seed, sweep])`` — a pure function of ``(num_samples, seed, sweep)``, the same
    on every worker and every run. Without it, the order is ``0, 1, ..., num_samples - 1``.

    Returns:
        int64 array of length ``num_samples``, read-only (permutations are cached and shared).

    Raises:
        TypeError / ValueError: ``num_samples < 1``, ``seed < 0``, ``sweep < 0`` or a non-bool
        ``randomize``.
    """
    num_samples = check_int("num_samples", num_samples, 1)
    seed = check_int("seed", seed, 0)
    sweep = check_int("sweep", sweep, 0)
    if not check_bool("randomize", randomize):
        order = np.arange(num_samples, dtype=np.int64)
        order.setflags(write=False)
        return order
    return _cached_sweep_order(num_samples, seed, sweep)


def timeline_to_indices(
    positions: np.ndarray, num_samples: int, seed: int, randomize: bool
) -> np.ndarray:
    """Map global timeline positions to data-set indices (vectorised).

    Position ``p`` lies in sweep ``p // num_samples`` at offset ``p % num_samples`` and reads
    ``sweep_order(num_samples, seed, p // num_samples, randomize)[p % num_samples]``. A minibatch
    usually touches one or two sweeps, whose permutations are cached.

    Args:
        positions: integer array of timeline positions (>= 0), any shape.
        num_samples: samples per sweep (>= 1).
        seed: randomisation seed (>= 0).
        randomize: whether sweeps are shuffled.

    Returns:
        int64 array of data-set indices in ``[0, num_samples)``, same shape as ``positions``.

    Raises:
        TypeError: ``positions`` is not an integer array.
        ValueError: a position is negative, or another argument is out of range.
    """
    num_samples = check_int("num_samples", num_samples, 1)
    seed = check_int("seed", seed, 0)
    randomize = check_bool("randomize", randomize)
    positions = np.asarray(positions)
    if positions.size and not np.issubdtype(positions.dtype, np.integer):
        raise TypeError(f"positions must be an integer array, got dtype {positions.dtype}")
    positions = positions.astype(np.int64, copy=False)
    if positions.size and positions.min() < 0:
        raise ValueError(f"positions must be >= 0, got minimum {positions.min()}")
    sweeps, offsets = np.divmod(positions, num_samples)
    if not randomize:
        return offsets
    indices = np.empty_like(offsets)
    for sweep in np.unique(sweeps):
        in_sweep = sweeps == sweep
        indices[in_sweep] = _cached_sweep_order(num_samples, seed, int(sweep))[offsets[in_sweep]]
    return indices


def range_to_indices(start: int, stop: int, num_samples: int, seed: int, randomize: bool) -> np.ndarray:
    """Data-set indices of the contiguous timeline positions ``[start, stop)``.

    The same as ``timeline_to_indices(np.arange(start, stop), ...)``, but by slicing each
    sweep's cached order instead of masking, which keeps the per-minibatch cost negligible
    next to a training step. Arguments are trusted (the source has checked them). A range over
    several sweeps fills one array allocated first, so a range too large for memory fails at
    once (``MemoryError``) instead of growing a list sweep by sweep.
    """
    count = max(stop - start, 0)
    sweep, offset = divmod(start, num_samples)
    if offset + count <= num_samples:  # within one sweep: the usual minibatch
        if randomize:  # a copy: never hand out the shared cached array
            return _cached_sweep_order(num_samples, seed, sweep)[offset:offset + count].copy()
        return np.arange(offset, offset + count, dtype=np.int64)
    indices = np.empty(count, dtype=np.int64)
    filled = 0
    while filled < count:
        sweep, offset = divmod(start + filled, num_samples)
        take = min(count - filled, num_samples - offset)
        piece = indices[filled:filled + take]
        if randomize:
            piece[:] = _cached_sweep_order(num_samples, seed, sweep)[offset:offset + take]
        else:
            piece[:] = np.arange(offset, offset + take, dtype=np.int64)
        filled += take
    return indices
