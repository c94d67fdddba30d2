"""Pure partition maths: exactly-once coverage, balance, determinism, disjointness."""

from __future__ import annotations

import numpy as np
import pytest

from dtrain.data.partition import partition_slice, sweep_order, timeline_to_indices

SWEEP_SIZES = [1, 2, 7, 10, 64, 257]
SEEDS = [0, 1, 12345]


@pytest.mark.parametrize("global_start", [0, 5, 1000])
@pytest.mark.parametrize("global_size", [0, 1, 3, 8, 17, 64])
def test_partition_slices_tile_the_minibatch_and_are_balanced(global_start, global_size):
    for num_partitions in range(1, 9):
        slices = [
            partition_slice(global_start, global_size, num_partitions, index)
            for index in range(num_partitions)
        ]
        assert slices[0][0] == global_start
        assert slices[-1][1] == global_start + global_size
        for (_, stop), (next_start, _) in zip(slices, slices[1:]):
            assert stop == next_start  # contiguous and disjoint
        shares = [stop - start for start, stop in slices]
        assert max(shares) - min(shares) <= 1
        assert sum(shares) == global_size


@pytest.mark.parametrize("num_samples", SWEEP_SIZES)
@pytest.mark.parametrize("seed", SEEDS)
def test_sweep_order_is_a_deterministic_permutation(num_samples, seed):
    first = sweep_order(num_samples, seed, sweep=3, randomize=True)
    again = sweep_order(num_samples, seed, sweep=3, randomize=True)
    assert first.dtype == np.int64
    np.testing.assert_array_equal(np.sort(first), np.arange(num_samples))
    np.testing.assert_array_equal(first, again)
    np.testing.assert_array_equal(
        sweep_order(num_samples, seed, 3, randomize=False), np.arange(num_samples)
    )


def test_sweeps_and_seeds_give_different_orders():
    orders = {tuple(sweep_order(100, seed, sweep, True)) for seed in SEEDS for sweep in range(4)}
    assert len(orders) == len(SEEDS) * 4


def test_sweep_order_is_read_only_so_the_cache_cannot_be_corrupted():
    order = sweep_order(10, 0, 0, True)
    with pytest.raises(ValueError):
        order[0] = 5


@pytest.mark.parametrize("num_samples", SWEEP_SIZES)
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("randomize", [True, False])
def test_every_sample_seen_exactly_once_per_sweep_across_partitions(num_samples, seed, randomize):
    for num_partitions in (1, 2, 3, 5, 8):
        minibatch_size = 3 * num_partitions + 1  # shares of unequal size, minibatches span sweeps
        seen_per_sweep = [[] for _ in range(3)]
        per_partition = [[] for _ in range(num_partitions)]
        for global_start in range(0, 3 * num_samples, minibatch_size):
            global_size = min(minibatch_size, 3 * num_samples - global_start)
            for index in range(num_partitions):
                start, stop = partition_slice(global_start, global_size, num_partitions, index)
                positions = np.arange(start, stop)
                indices = timeline_to_indices(positions, num_samples, seed, randomize)
                per_partition[index].append(indices)
                for position, sample in zip(positions, indices):
                    seen_per_sweep[position // num_samples].append(sample)
        for seen in seen_per_sweep:
            np.testing.assert_array_equal(np.sort(seen), np.arange(num_samples))
        # Per sweep the local shares are disjoint (checked by exactly-once above) and balanced.
        totals = [sum(len(indices) for indices in chunks) for chunks in per_partition]
        assert max(totals) - min(totals) <= len(range(0, 3 * num_samples, minibatch_size))


@pytest.mark.parametrize("num_samples", [7, 64])
def test_timeline_to_indices_matches_sweep_order_elementwise(num_samples):
    positions = np.array([0, 1, num_samples - 1, num_samples, 5 * num_samples + 3, 2 * num_samples + 2])
    positions = positions[positions >= 0]
    indices = timeline_to_indices(positions, num_samples, seed=9, randomize=True)
    expected = [sweep_order(num_samples, 9, p // num_samples, True)[p % num_samples] for p in positions]
    np.testing.assert_array_equal(indices, expected)


def test_timeline_to_indices_handles_empty_positions():
    indices = timeline_to_indices(np.array([], dtype=np.int64), 10, 0, True)
    assert indices.shape == (0,) and indices.dtype == np.int64


@pytest.mark.parametrize(
    "call, error",
    [
        (lambda: partition_slice(0, 10, 0, 0), ValueError),
        (lambda: partition_slice(0, 10, 4, 4), ValueError),
        (lambda: partition_slice(-1, 10, 4, 0), ValueError),
        (lambda: partition_slice(0, 10.0, 4, 0), TypeError),
        (lambda: partition_slice(0, True, 4, 0), TypeError),
        (lambda: sweep_order(0, 0, 0, True), ValueError),
        (lambda: sweep_order(5, -1, 0, True), ValueError),
        (lambda: sweep_order(5, 0, 0, "yes"), TypeError),
        (lambda: timeline_to_indices(np.array([-1]), 5, 0, True), ValueError),
        (lambda: timeline_to_indices(np.array([0.5]), 5, 0, True), TypeError),
    ],
)
def test_bad_arguments_are_rejected(call, error):
    with pytest.raises(error):
        call()


def test_error_message_names_the_value():
    with pytest.raises(ValueError, match=r"partition_index must be < num_partitions \(4\), got 4"):
        partition_slice(0, 10, 4, 4)


@pytest.mark.parametrize("randomize", [True, False])
@pytest.mark.parametrize("start, stop", [(0, 0), (0, 7), (5, 23), (13, 14), (20, 61), (39, 40)])
def test_range_to_indices_equals_the_general_mapping(start, stop, randomize):
    """The source's fast path gives exactly the indices of the vectorised mapping, across sweeps."""
    from dtrain.data.partition import range_to_indices

    expected = timeline_to_indices(np.arange(start, stop, dtype=np.int64), 20, 7, randomize)
    got = range_to_indices(start, stop, 20, 7, randomize)
    np.testing.assert_array_equal(got, expected)
    if randomize and got.size:
        got[0] = -1  # a private copy: the cached sweep order must stay intact
        assert timeline_to_indices(np.array([start]), 20, 7, True)[0] != -1


def test_a_range_too_large_for_memory_fails_at_once():
    """A minibatch of 10**12 samples over a 1,437-sample set: the indices are allocated first, so the
    read stops with numpy's MemoryError for the whole array, instead of building 7 * 10**8 pieces
    until the machine swaps (a 4 GiB address-space limit keeps a regression from taking it down)."""
    import subprocess
    import sys

    code = ("import resource\n"
            "from dtrain.data.partition import range_to_indices\n"
            "resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))\n"
            "range_to_indices(0, 10**12, 1437, 0, True)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode != 0 and "MemoryError" in result.stderr and "7.28 TiB" in result.stderr, result.stderr[-500:]
