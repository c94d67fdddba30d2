"""Random numbers that are a pure function of (seed, global timeline position).

A sample's random decisions (crop position, flip, colour jitter) come from a counter-based hash
of ``(seed, stream, position)`` instead of a stateful generator, so a sample is augmented the
same way whatever the number of partitions, the minibatch it lands in, the backend (native or
DALI) and after a resume. Each decision has its own ``stream`` number, so adding one never
changes another. Used by :class:`~dtrain.data.transform.ImageTransform` and
:class:`~dtrain.data.augmentation.ImageAugmentation`.
"""

from __future__ import annotations

import numpy as np

from dtrain.data._checks import check_int

__all__ = ["STREAM_CROP_X", "STREAM_CROP_Y", "STREAM_FLIP", "flip_mask", "uniform_from_positions"]

# splitmix64 constants (Steele, Lea & Flood 2014; the same as java.util.SplittableRandom).
_GOLDEN_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_MIX_MULTIPLIER_1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX_MULTIPLIER_2 = np.uint64(0x94D049BB133111EB)

#: streams of the crop position (x, y) and of the horizontal flip; other decisions use 11 and up
STREAM_CROP_X, STREAM_CROP_Y, STREAM_FLIP = 1, 2, 3


def _mix64(state: np.ndarray) -> np.ndarray:
    """splitmix64's output function on a uint64 array (wrapping arithmetic is intended)."""
    z = state
    z = (z ^ (z >> np.uint64(30))) * _MIX_MULTIPLIER_1
    z = (z ^ (z >> np.uint64(27))) * _MIX_MULTIPLIER_2
    return z ^ (z >> np.uint64(31))


def uniform_from_positions(seed: int, positions: np.ndarray, stream: int) -> np.ndarray:
    """Uniform floats in [0, 1), one per position, a pure function of (seed, position, stream).

    The stream key is hashed from ``(seed, stream)``; position ``p`` then takes the ``p``-th
    output of the splitmix64 generator started at that key. Vectorised in numpy uint64.

    Args:
        seed: non-negative integer seed (taken modulo 2**64).
        positions: non-negative integer array of global timeline positions.
        stream: small non-negative integer naming the random decision (crop x, flip, ...).

    Returns:
        float64 array shaped like ``positions``.

    Raises:
        TypeError / ValueError: a negative seed or stream, or non-integer positions.
    """
    seed = check_int("seed", seed, 0)
    stream = check_int("stream", stream, 0)
    positions = np.asarray(positions)
    if positions.size and not np.issubdtype(positions.dtype, np.integer):
        raise TypeError(f"positions must be an integer array, got dtype {positions.dtype}")
    with np.errstate(over="ignore"):
        seed_key = _mix64(np.array([seed % 2**64], dtype=np.uint64) + _GOLDEN_GAMMA)
        stream_key = _mix64(seed_key + np.uint64(stream) * _GOLDEN_GAMMA)
        counters = stream_key + (positions.astype(np.uint64) + np.uint64(1)) * _GOLDEN_GAMMA
        bits = _mix64(counters)
    # The top 53 bits fill a float64 mantissa exactly: values k / 2**53.
    return (bits >> np.uint64(11)).astype(np.float64) * (1.0 / 2**53)


def flip_mask(seed: int, positions: np.ndarray) -> np.ndarray:
    """bool array: True for the positions (about half) whose image is mirrored horizontally."""
    return uniform_from_positions(seed, positions, STREAM_FLIP) < 0.5
