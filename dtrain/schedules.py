"""Schedules indexed by samples seen (CNTK's ``learning_parameter_schedule`` semantics).

A schedule is a list of ``(count, value)`` pairs: ``value`` holds for ``count * epoch_size``
samples, then the next pair takes over; the last value holds for ever. A bare list of values
means one value per ``epoch_size`` samples, and a scalar means a constant. Without an
``epoch_size`` (or with ``FULL_DATA_SWEEP``) the unit is one sweep of the training data, as in
CNTK: the session tells the schedule its training source's samples per sweep.
"""
from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Sequence

from dtrain.data.limits import FULL_DATA_SWEEP


class Schedule:
    """A piecewise-constant function of the global sample count.

    Args:
        values: a number, a list of numbers (one per ``epoch_size`` samples), or a list of
            ``[count, value]`` pairs (``value`` for ``count * epoch_size`` samples).
        epoch_size: samples one unit of ``count`` stands for; ignored for a scalar. ``None`` (the
            default) or ``FULL_DATA_SWEEP``: one sweep of the training data (CNTK's default), whose
            samples :meth:`set_sweep_size` gives (``training_session`` does).
        warmup_samples: scale the value linearly from ~0 up to 1x over this many samples (a
            learning-rate warm-up for large minibatches, Goyal et al. 2017); 0 for none.

    Raises:
        ValueError: on an empty list, a non-positive count or epoch size, a negative warm-up.
    """

    def __init__(self, values: float | Sequence, epoch_size: int | None = None, warmup_samples: int = 0):
        if not isinstance(warmup_samples, int) or warmup_samples < 0:
            raise ValueError(f"schedule warmup_samples must be a non-negative number of samples, got {warmup_samples!r}")
        self.warmup_samples = warmup_samples
        if isinstance(values, (int, float)):
            values = [(1, float(values))]
            epoch_size = 1
        values = list(values)
        if not values:
            raise ValueError("a schedule needs at least one value, got an empty list")
        self.counts_sweeps = epoch_size is None or epoch_size == FULL_DATA_SWEEP
        if not self.counts_sweeps and (not isinstance(epoch_size, int) or isinstance(epoch_size, bool)
                                       or epoch_size <= 0):
            raise ValueError(f"schedule epoch_size must be a positive number of samples (or None: one sweep), "
                             f"got {epoch_size!r}")
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
        self._counts = [count for count, _ in pairs]
        self.values = [value for _, value in pairs]
        self.epoch_size: int | None = None
        self._ends: list[int] | None = None  # sample count at which each value ends; the last one never ends
        if not self.counts_sweeps:
            self._set_epoch_size(epoch_size)
        elif len(self.values) == 1:
            self._set_epoch_size(1)  # a constant: the unit does not matter

    def _set_epoch_size(self, epoch_size: int) -> None:
        self.epoch_size = epoch_size
        self._ends, end = [], 0
        for count in self._counts:
            end += count * epoch_size
            self._ends.append(end)

    def set_sweep_size(self, samples_per_sweep: int) -> None:
        """Gives a schedule that counts sweeps (no ``epoch_size``) the samples of one sweep; others ignore it."""
        if self.counts_sweeps:
            if not isinstance(samples_per_sweep, int) or samples_per_sweep <= 0:
                raise ValueError(f"samples per sweep must be a positive whole number, got {samples_per_sweep!r}")
            self._set_epoch_size(samples_per_sweep)

    def __call__(self, samples_seen: int) -> float:
        """The value in force after ``samples_seen`` global samples.

        Raises:
            RuntimeError: the schedule counts sweeps and was not told the samples of one.
        """
        if self._ends is None:
            raise RuntimeError("this schedule changes once per sweep (no epoch_size) but does not know the samples of "
                               "a sweep: training_session tells it; alone, call schedule.set_sweep_size(samples) or "
                               "give epoch_size")
        index = bisect.bisect_right(self._ends, samples_seen)
        return self.values[min(index, len(self.values) - 1)] * self.warmup_multiplier(samples_seen)

    def constant(self) -> float | None:
        """The value, for a schedule that never changes (one value, no warm-up); None for one that does."""
        if self.warmup_samples or len(set(self.values)) != 1:
            return None
        return self.values[0]

    def warmup_multiplier(self, samples_seen: int) -> float:
        """The warm-up's share of the value after ``samples_seen`` samples: ``(samples_seen + 1) / warmup_samples``
        inside the warm-up, 1 after it (and without one)."""
        if samples_seen < self.warmup_samples:
            return (samples_seen + 1) / self.warmup_samples
        return 1.0

    def first_change(self) -> tuple[int, float, float] | None:
        """``(samples, before, after)`` where the value first changes, or None for a constant (or one whose sweep
        size is not known yet); the session says so when a run ends before it, e.g. a shortened recipe whose
        learning rate would never drop."""
        if self._ends is None:
            return None
        for end, before, after in zip(self._ends, self.values, self.values[1:]):
            if after != before:
                return end, before, after
        return None

    def __repr__(self) -> str:
        epoch_size = "sweep" if self.counts_sweeps and len(self.values) > 1 else self.epoch_size
        return (f"Schedule(values={self.values}, ends={self._ends}, epoch_size={epoch_size}, "
                f"warmup_samples={self.warmup_samples})")


def size_sweeps(schedules: Iterable[Schedule | None], samples_per_sweep: int | None, source_name: str) -> None:
    """Tells every schedule that counts sweeps the training source's ``samples_per_sweep`` (None: the source,
    of type ``source_name``, does not say).

    Raises:
        ValueError: such a schedule, and a source that does not say how many samples a sweep has.
    """
    counting = [schedule for schedule in schedules
                if isinstance(schedule, Schedule) and schedule.counts_sweeps and len(schedule.values) > 1]
    if not counting:
        return
    if samples_per_sweep is None:
        raise ValueError(f"a schedule without epoch_size changes once per sweep, but the training source "
                         f"({source_name}) does not say how many samples a sweep has; give epoch_size")
    for schedule in counting:
        schedule.set_sweep_size(int(samples_per_sweep))


def momentum_from_time_constant(time_constant: float, minibatch_size: int) -> float:
    """CNTK's ``TimeConstant2Momentum``: ``exp(-minibatch_size / time_constant)``; 0 maps to 0.

    The time constant is in samples, so the momentum per minibatch follows the minibatch size.
    """
    if time_constant < 0:
        raise ValueError(f"momentum time constant must be >= 0 samples, got {time_constant}")
    if time_constant == 0:
        return 0.0
    return math.exp(-minibatch_size / time_constant)


def schedule_values(setting) -> object:
    """A schedule setting's ``values`` (``session.lr_schedule`` and the like), or None when the schedule is off:
    the setting null, or its ``values`` null (the session's default)."""
    return None if setting is None else setting.get("values")
