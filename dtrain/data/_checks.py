"""Argument checks shared by the data modules: one-line messages naming the value and the fix."""

from __future__ import annotations

import numbers

import numpy as np

__all__ = ["check_bool", "check_int", "check_partition"]


def check_int(name: str, value: object, minimum: int | None = None) -> int:
    """Return ``value`` as a Python int, or raise if it is not an integer >= ``minimum``.

    Raises:
        TypeError: ``value`` is not an integer (bools are refused: ``True`` is not a size).
        ValueError: ``value`` is below ``minimum``.
    """
    if type(value) is not int:  # a plain int skips the slower abstract-class check (it runs per minibatch)
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
        value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def check_partition(count_name: str, count: object, index_name: str, index: object) -> tuple[int, int]:
    """Return ``(count, index)`` as Python ints for partition ``index`` of ``count``, or raise if they
    are not integers with ``count >= 1`` and ``0 <= index < count``."""
    count = check_int(count_name, count, 1)
    index = check_int(index_name, index, 0)
    if index >= count:
        raise ValueError(f"{index_name} must be < {count_name} ({count}), got {index}")
    return count, index


def check_bool(name: str, value: object) -> bool:
    """Return ``value`` if it is a bool (numpy bools included), else raise ``TypeError``."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {value!r} ({type(value).__name__})")
    return bool(value)
