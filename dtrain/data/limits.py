"""CNTK's reading limits and scheduling unit: ``FULL_DATA_SWEEP`` and ``INFINITELY_REPEAT``.

The values of ``cntk.io.FULL_DATA_SWEEP`` and ``cntk.io.INFINITELY_REPEAT`` (``SIZE_MAX - 2`` and
``SIZE_MAX``), so ported code passes them where CNTK accepts them: ``max_samples`` and
``max_sweeps`` of a :class:`~dtrain.data.MinibatchSource` (``INFINITELY_REPEAT``: no limit, CNTK's
default; ``max_samples=FULL_DATA_SWEEP``: one sweep) and a schedule's ``epoch_size``
(``FULL_DATA_SWEEP``: one sweep, as ``None``).
"""
from __future__ import annotations

INFINITELY_REPEAT = 2**64 - 1
"""``cntk.io.INFINITELY_REPEAT``: read without a limit (the default of ``max_samples`` and ``max_sweeps``)."""

FULL_DATA_SWEEP = 2**64 - 3
"""``cntk.io.FULL_DATA_SWEEP``: one sweep of the data (``max_samples``; a schedule's ``epoch_size``)."""


def reading_limits(max_samples: object, max_sweeps: object) -> tuple[object, object]:
    """``(max_samples, max_sweeps)`` with CNTK's constants resolved: ``INFINITELY_REPEAT`` is no limit
    (None) and ``max_samples=FULL_DATA_SWEEP`` one sweep (``max_sweeps=1``); other values unchanged.

    Raises:
        ValueError: ``max_sweeps=FULL_DATA_SWEEP`` (not a number of sweeps), or both limits given
            (CNTK: mutually exclusive when both have non-default values).
    """
    if max_samples == INFINITELY_REPEAT and not isinstance(max_samples, bool):
        max_samples = None
    if max_sweeps == INFINITELY_REPEAT and not isinstance(max_sweeps, bool):
        max_sweeps = None
    if max_sweeps == FULL_DATA_SWEEP and not isinstance(max_sweeps, bool):
        raise ValueError("max_sweeps=FULL_DATA_SWEEP: expected a number of sweeps; for one sweep give max_sweeps=1 "
                         "or max_samples=FULL_DATA_SWEEP")
    if max_samples is not None and max_sweeps is not None:
        raise ValueError(f"max_samples ({_name(max_samples)}) and max_sweeps ({max_sweeps}) are mutually exclusive; "
                         "give at most one of them")
    if max_samples == FULL_DATA_SWEEP and not isinstance(max_samples, bool):
        return None, 1
    return max_samples, max_sweeps


def _name(value: object) -> str:
    return "FULL_DATA_SWEEP" if value == FULL_DATA_SWEEP else str(value)


__all__ = ["FULL_DATA_SWEEP", "INFINITELY_REPEAT", "reading_limits"]
