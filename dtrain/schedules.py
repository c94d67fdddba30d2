"""Schedules indexed by samples seen (CNTK's ``learning_parameter_schedule`` semantics).

A schedule is a list of ``(count, value)`` pairs: ``value`` holds for ``count * epoch_size``
samples, then the next pair takes over; the last value holds for ever. A bare list of values
means one value per ``epoch_size`` samples, and a scalar means a constant.
"""
from __future__ import annotations

import bisect
import math
from collections.abc import Sequence


class Schedule:
    """A piecewise-constant function of the global sample count.

    Args:
        values: a number, a list of numbers (one per ``epoch_size`` samples), or a list of
            ``[count, value]`` pairs (``value`` for ``count * epoch_size`` samples).
        epoch_size: samples one unit of ``count`` stands for; ignored for a scalar.
        warmup_samples: scale the value linearly from ~0 up to 1x over this many samples (a
            learning-rate warm-up for large minibatches, Goyal et al. 2017); 0 for none.

    Raises:
        ValueError: on an empty list, a non-positive count or epoch size, a negative warm-up.
    """

    def __init__(self, values: float | Sequence, epoch_size: int = 1, warmup_samples: int = 0):
        if not isinstance(warmup_samples, int) or warmup_samples < 0:
            raise ValueError(f"schedule warmup_samples must be a non-negative number of samples, got {warmup_samples!r}")
        self.warmup_samples = warmup_samples
        if isinstance(values, (int, float)):
            values = [(1, float(values))]
            epoch_size = 1
        values = list(values)
        if not values:
            raise ValueError("a schedule needs at least one value, got an empty list")
        if not isinstance(epoch_size, int) or epoch_size <= 0:
            raise ValueError(f"schedule epoch_size must be a positive number of samples, got {epoch_size!r}")
        pairs = []
        for entry in values:
            if isinstance(entry, (int, float)):
                count, value = 1, entry
            else:
                if len(entry) != 2:
                    raise ValueError(f"schedule entry {list(entry)!r} must be a number or a [count, value] pair")
                count, value = entry
            if not isinstance(count, int) or count <= 0:
                raise ValueError(f"schedule count {count!r} must be a positive integer")
            pairs.append((count, float(value)))
        self.epoch_size = epoch_size
        self.values = [value for _, value in pairs]
        # sample count at which each value ends; the last one never ends
        self._ends = []
        end = 0
        for count, _ in pairs:
            end += count * epoch_size
            self._ends.append(end)

    def __call__(self, samples_seen: int) -> float:
        """The value in force after ``samples_seen`` global samples."""
        index = bisect.bisect_right(self._ends, samples_seen)
        value = self.values[min(index, len(self.values) - 1)]
        if samples_seen < self.warmup_samples:
            value *= (samples_seen + 1) / self.warmup_samples
        return value

    def __repr__(self) -> str:
        return (f"Schedule(values={self.values}, ends={self._ends}, epoch_size={self.epoch_size}, "
                f"warmup_samples={self.warmup_samples})")


def momentum_from_time_constant(time_constant: float, minibatch_size: int) -> float:
    """CNTK's ``TimeConstant2Momentum``: ``exp(-minibatch_size / time_constant)``; 0 maps to 0.

    The time constant is in samples, so the momentum per minibatch follows the minibatch size.
    """
    if time_constant < 0:
        raise ValueError(f"momentum time constant must be >= 0 samples, got {time_constant}")
    if time_constant == 0:
        return 0.0
    return math.exp(-minibatch_size / time_constant)
