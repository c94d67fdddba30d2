"""The shared value rules: what each accepts, what it refuses, and the one line it gives."""
import math

import numpy as np
import pytest

from dtrain import checks


@pytest.mark.parametrize("value", [1, 64, np.int64(5)])
def test_sample_count_accepts_positive_whole_numbers(value):
    assert checks.sample_count("session.minibatch_size", value) == int(value)


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "64", None, float("nan")])
def test_sample_count_refuses_with_the_name_and_the_expectation(value):
    with pytest.raises(ValueError) as error:
        checks.sample_count("session.minibatch_size", value)
    assert str(error.value) == f"session.minibatch_size={value!r}: expected a positive whole number of samples"


def test_sample_count_zero_and_none_only_when_allowed():
    assert checks.sample_count("f", 0, allow_zero=True) == 0
    assert checks.sample_count("f", None, allow_none=True) is None
    with pytest.raises(ValueError, match=r"f=None: expected a non-negative whole number of samples$"):
        checks.sample_count("f", None, allow_zero=True)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf"), "0.1", True])
def test_numbers_refuse_nan_infinity_strings_and_bools(value):
    for check in (checks.finite_number, checks.positive_number):
        with pytest.raises(ValueError, match=r"^optimizer\.lr="):
            check("optimizer.lr", value)


def test_positive_number_bounds():
    assert checks.positive_number("lr", 0.5) == 0.5
    assert checks.positive_number("wd", 0, allow_zero=True) == 0.0
    with pytest.raises(ValueError, match=r"lr=0: expected a positive finite number of MiB"):
        checks.positive_number("lr", 0, unit="MiB")


def test_number_in_range_open_and_closed_upper_bound():
    assert checks.number_in_range("momentum", 0.0, 0.0, 1.0, include_high=False) == 0.0
    with pytest.raises(ValueError, match=r"momentum=1.0: expected a number in \[0.0, 1.0\)"):
        checks.number_in_range("momentum", 1.0, 0.0, 1.0, include_high=False)
    with pytest.raises(ValueError, match=r"momentum=-1: expected a number in \[0, 1\]"):
        checks.number_in_range("momentum", -1, 0, 1)


def test_whole_number_names_its_range_and_unit():
    assert checks.whole_number("bits", 32, 1, 32) == 32
    with pytest.raises(ValueError, match=r"^bits=0: expected a whole number from 1 to 32$"):
        checks.whole_number("bits", 0, 1, 32)
    with pytest.raises(ValueError, match=r"^threads=0: expected a whole number of threads of at least 1 or null$"):
        checks.whole_number("threads", 0, 1, allow_none=True, unit="threads")


def test_boolean_refuses_numbers_and_strings():
    assert checks.boolean("flag", np.bool_(True)) is True
    for value in (1, "true", None):
        with pytest.raises(ValueError, match="expected true or false"):
            checks.boolean("flag", value)


def test_collect_reports_every_problem_in_order():
    problems = checks.collect([
        lambda: checks.sample_count("a", 0),
        lambda: checks.sample_count("b", 3),
        lambda: checks.positive_number("c", math.nan),
    ])
    assert problems == ["a=0: expected a positive whole number of samples", "c=nan: expected a positive finite number"]
