"""Schedules by samples seen, with CNTK's (count, value) x epoch_size meaning."""
import math

import pytest

from dtrain.schedules import Schedule, momentum_from_time_constant


def test_pairs_hold_for_count_times_epoch_size_and_last_value_forever():
    schedule = Schedule([[2, 1.0], [1, 0.3], [1, 0.1]], epoch_size=100)
    assert [schedule(s) for s in (0, 199, 200, 299, 300, 399, 400, 10**9)] == [1.0, 1.0, 0.3, 0.3, 0.1, 0.1, 0.1, 0.1]


def test_bare_list_is_one_value_per_epoch_and_scalar_is_constant():
    assert [Schedule([3, 2, 1], epoch_size=10)(s) for s in (0, 9, 10, 25, 1000)] == [3, 3, 2, 1, 1]
    assert Schedule(0.5)(123456) == 0.5


@pytest.mark.parametrize("values, epoch_size, fragment", [
    ([], 1, "at least one value"),
    ([[0, 1.0]], 1, "count 0"),
    ([[1, 2, 3]], 1, "pair"),
    ([1.0], 0, "epoch_size"),
])
def test_bad_schedules_are_refused_naming_the_value(values, epoch_size, fragment):
    with pytest.raises(ValueError, match=fragment):
        Schedule(values, epoch_size)


def test_momentum_time_constant_matches_cntk_conversion():
    assert momentum_from_time_constant(0, 64) == 0.0
    assert momentum_from_time_constant(600, 64) == pytest.approx(math.exp(-64 / 600))
    assert momentum_from_time_constant(600, 64) == pytest.approx(0.899, abs=1e-3)
    with pytest.raises(ValueError):
        momentum_from_time_constant(-1, 64)


def test_warmup_ramps_linearly_then_hands_over_to_the_schedule():
    schedule = Schedule([[1, 1.0], [1, 0.1]], epoch_size=1000, warmup_samples=500)
    assert schedule(0) == pytest.approx(1 / 500)
    assert schedule(249) == pytest.approx(0.5)
    assert schedule(499) == pytest.approx(1.0)
    assert schedule(500) == 1.0 and schedule(1000) == 0.1
    with pytest.raises(ValueError, match="warmup_samples"):
        Schedule(1.0, warmup_samples=-1)


def test_first_change_skips_repeated_values_and_needs_the_sweep_size():
    schedule = Schedule([[2, 1.0], [1, 1.0], [1, 0.1], [1, 0.01]])  # counts sweeps
    assert schedule.first_change() is None  # the sweep's samples are not known yet
    schedule.set_sweep_size(100)
    assert schedule.first_change() == (300, 1.0, 0.1)
    assert Schedule(0.5).first_change() is None
