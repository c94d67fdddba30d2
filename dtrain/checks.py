"""Value rules shared by the API and the config validator: each rule written once, one line per problem.

Every check takes the name the user knows the value by (``"session.minibatch_size"`` from the
config, ``"minibatch_size"`` from the API), returns the value in its canonical type, and raises
``ValueError`` with one line ``name=value: expected ...``. ``collect`` runs several checks and
gathers their lines, so a validator reports every problem at once instead of the first.
"""
from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterable
from typing import Any

__all__ = [
    "collect", "boolean", "device", "finite_number", "number_in_range", "positive_number", "precision", "sample_count",
    "whole_number",
]

#: the training precisions a session accepts (``session.precision``)
PRECISIONS = ("32", "bf16", "fp16")

#: how a compressing exchange's warm start trains (``learner.warm_start_mode``): float32 all-reduce
#: steps on each rank's share, or CNTK's local steps on the full stream on every rank
WARM_STARTS = ("allreduce", "local")

#: the learning rate of block momentum's local steps (``learner.local_learning_rate``): the optimizer's
#: lr times the worker's share of the global minibatch (CNTK's per-sample rate), or the full lr
LOCAL_LEARNING_RATES = ("share", "full")

#: how tensors travel between ranks (``comm.backend``; see ``dtrain.comm.resolve_backend``)
COMM_BACKENDS = ("auto", "gloo", "mpi", "nccl", "local")

#: which ranks ``session.profile`` traces: rank 0 only (``main``) or every rank (``all``)
PROFILE_RANKS = ("main", "all")

#: where a session trains (``session.device``): ``auto``, ``cpu``, ``cuda`` or ``cuda:N``
DEVICE_WORDS = ("auto", "cpu", "cuda")


def _fail(name: str, value: Any, expected: str) -> ValueError:
    return ValueError(f"{name}={value!r}: expected {expected}")


def _is_whole(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def sample_count(name: str, value: Any, *, allow_zero: bool = False, allow_none: bool = False) -> int | None:
    """A whole number of (global) samples: positive, or non-negative with ``allow_zero``; ``None`` with ``allow_none``."""
    if value is None and allow_none:
        return None
    if not _is_whole(value) or value < 0 or (value == 0 and not allow_zero):
        kind = "a non-negative" if allow_zero else "a positive"
        raise _fail(name, value, f"{kind} whole number of samples" + (" or null" if allow_none else ""))
    return int(value)


def whole_number(name: str, value: Any, low: int | None = None, high: int | None = None, *,
                 allow_none: bool = False, unit: str = "") -> int | None:
    """A whole number in ``[low, high]`` (either bound may be open); ``unit`` names what it counts."""
    if value is None and allow_none:
        return None
    if not _is_whole(value) or (low is not None and value < low) or (high is not None and value > high):
        raise _fail(name, value, _range_words("a whole number", low, high, unit) + (" or null" if allow_none else ""))
    return int(value)


def finite_number(name: str, value: Any, *, allow_none: bool = False) -> float | None:
    """Any finite real number (NaN and infinities refused)."""
    if value is None and allow_none:
        return None
    if not _is_real(value) or not math.isfinite(value):
        raise _fail(name, value, "a finite number" + (" or null" if allow_none else ""))
    return float(value)


def positive_number(name: str, value: Any, *, allow_zero: bool = False, allow_none: bool = False,
                    unit: str = "") -> float | None:
    """A finite number above 0 (or at least 0 with ``allow_zero``)."""
    if value is None and allow_none:
        return None
    if not _is_real(value) or not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        kind = "a non-negative" if allow_zero else "a positive"
        raise _fail(name, value, f"{kind} finite number" + (f" of {unit}" if unit else "") + (" or null" if allow_none else ""))
    return float(value)


def number_in_range(name: str, value: Any, low: float, high: float, *, include_high: bool = True,
                    allow_none: bool = False) -> float | None:
    """A finite number with ``low <= value <= high`` (``< high`` when ``include_high`` is false)."""
    if value is None and allow_none:
        return None
    if (not _is_real(value) or not math.isfinite(value) or value < low
            or (value > high if include_high else value >= high)):
        bracket = "]" if include_high else ")"
        raise _fail(name, value, f"a number in [{low}, {high}{bracket}" + (" or null" if allow_none else ""))
    return float(value)


def boolean(name: str, value: Any, *, allow_none: bool = False) -> bool | None:
    """``True`` or ``False`` (numbers and strings refused: ``1`` is not a switch); ``None`` with ``allow_none``."""
    if value is None and allow_none:
        return None
    if type(value).__name__ not in ("bool", "bool_"):  # numpy's bool_ too, without importing numpy
        raise _fail(name, value, "true or false" + (" or null" if allow_none else ""))
    return bool(value)


def boolean_or_auto(name: str, value: Any) -> bool | str:
    """``True``, ``False`` or ``"auto"`` (the learner decides from its other settings and says so)."""
    if value == "auto":
        return "auto"
    if type(value).__name__ not in ("bool", "bool_"):
        raise _fail(name, value, "true, false or auto")
    return bool(value)


def collect(checks: Iterable[Callable[[], Any]]) -> list[str]:
    """Runs every check (a callable with no arguments) and returns each one's problem line."""
    problems = []
    for check in checks:
        try:
            check()
        except (ValueError, TypeError) as error:
            problems.append(str(error))
    return problems


def _range_words(kind: str, low: int | None, high: int | None, unit: str) -> str:
    unit_words = f" of {unit}" if unit else ""
    if low is not None and high is not None:
        return f"{kind}{unit_words} from {low} to {high}"
    if low is not None:
        return f"{kind}{unit_words} of at least {low}"
    if high is not None:
        return f"{kind}{unit_words} of at most {high}"
    return kind + unit_words


def choice(name: str, value: Any, choices: tuple[str, ...]) -> str:
    """One of ``choices`` (strings, compared exactly)."""
    if not isinstance(value, str) or value not in choices:
        raise _fail(name, value, "one of " + ", ".join(choices))
    return value



def warm_start_mode(mode: Any, prefix: str = "") -> str:
    """The learner's ``warm_start_mode`` (one of ``WARM_STARTS``; None: ``allreduce``); ``prefix``
    (``"learner."``) goes before the name in messages. Raises ValueError for another value."""
    return "allreduce" if mode is None else choice(f"{prefix}warm_start_mode", mode, WARM_STARTS)


def device(name: str, value: Any) -> str:
    """A training device: ``auto``, ``cpu``, ``cuda`` or ``cuda:N`` (N a GPU index), returned as written.

    Whether this machine has that device is the caller's question (``dtrain.session.device``).
    """
    text = str(value) if isinstance(value, str) or type(value).__name__ == "device" else None
    kind, _, index = (text or "").partition(":")
    if text not in DEVICE_WORDS and not (kind == "cuda" and index.isdigit() and str(int(index)) == index):
        raise _fail(name, value, "auto, cpu, cuda or cuda:N (N the index of a GPU)")
    return text


def precision(name: str, value: Any) -> str:
    """A training precision: ``32`` (or ``"32"``) for float32, ``"bf16"`` or ``"fp16"`` (autocast)."""
    text = str(value).strip().lower() if _is_whole(value) or isinstance(value, str) else None
    if text not in PRECISIONS:
        raise _fail(name, value, "one of 32, bf16, fp16")
    return text
