"""A value of the run's ``metrics.jsonl`` records that a callback watches: ``KIND.KEY`` (``cv.error``,
``train.loss``), whether lower or higher is better, and what counts as an improvement."""
from __future__ import annotations

import math

from dtrain import checks

#: the record kinds a monitor may name (cv: each cross-validation's, train: each progress report's), and what
#: one evaluation of that kind is called in messages
KINDS = {"cv": "cross-validation", "train": "progress report"}

#: keys where higher is better; any other key the default mode knows is lower-is-better (see default_mode)
_HIGHER_IS_BETTER = ("accuracy",)
_LOWER_IS_BETTER = ("loss", "perplexity", "wer", "per", "cer")


def default_mode(key: str) -> str | None:
    """``"max"`` for an accuracy, ``"min"`` for a loss or an error rate, ``None`` for a key it cannot tell."""
    if key in _HIGHER_IS_BETTER or key.endswith("accuracy"):
        return "max"
    if key in _LOWER_IS_BETTER or key.endswith("error") or key.endswith("loss"):
        return "min"
    return None


class Monitor:
    """``monitor`` (``KIND.KEY``) read from records of that kind, better by ``mode`` by more than ``min_delta``.

    Args:
        owner: the callback's class name, to name the setting in errors (``EarlyStopping``).
        monitor: ``cv.KEY`` or ``train.KEY``, a key of that kind of ``metrics.jsonl`` record.
        mode: ``"min"`` or ``"max"``; ``None`` takes it from the key (loss and error rates: min, accuracy: max).
        min_delta: how much better than the best so far a value must be to count as an improvement.

    Raises:
        ValueError: a malformed ``monitor``, an unknown ``mode``, a negative ``min_delta``.
    """

    def __init__(self, owner: str, monitor: str, mode: str | None = None, min_delta: float = 0.0):
        kind, _, key = monitor.partition(".") if isinstance(monitor, str) else ("", "", "")
        if kind not in KINDS or not key:
            raise ValueError(f"{owner} monitor={monitor!r}: expected KIND.KEY of a metrics.jsonl record with KIND one "
                             f"of {', '.join(KINDS)} (cv.error, cv.loss, train.loss)")
        self.owner = owner
        self.name = monitor
        self.kind, self.key = kind, key
        self.evaluation = KINDS[kind]
        # a key the default cannot tell is refused by check(), after whether the run writes it at all
        self.mode = default_mode(key) if mode is None else checks.choice(f"{owner} mode", mode, ("min", "max"))
        self.min_delta = checks.positive_number(f"{owner} min_delta", min_delta, allow_zero=True)

    def check(self, run) -> None:
        """Refuses a monitor this run does not write (ValueError naming it and the keys the run does write), or one
        whose better direction is neither given nor known."""
        produced = run.produced_metrics()
        # an objective's figures are named by its first call: such a key is checked against the first record
        later = bool(getattr(run, "figures_named_later", False)) and self.kind in produced
        if self.key in produced.get(self.kind, ()) or later:
            if self.mode is None:
                raise ValueError(f"{self.owner} monitor={self.name!r}: cannot tell whether a lower or a higher "
                                 f"{self.key} is better; expected mode=min or mode=max")
            return
        writes = ", ".join(f"{kind}.{key}" for kind in KINDS for key in produced.get(kind, ())) or "none"
        if self.kind not in produced:
            why = ("this run writes no cv records (no cross-validation data, or a cross-validation frequency of 0)"
                   if self.kind == "cv" else "this run writes no train records (a progress frequency of 0)")
        else:
            why = f"{self.kind} records have no {self.key}"
        raise ValueError(f"{self.owner} monitor={self.name!r}: {why}; expected one of the values it writes: {writes}")

    def value(self, record: dict) -> float | None:
        """The monitored value of ``record`` (``None``: a record of another kind)."""
        if record.get("kind") != self.kind:
            return None
        if self.key not in record:  # a figure the objective did not return (checked here: see check)
            figures = ", ".join(f"{self.kind}.{key}" for key in record if key not in ("kind", "samples", "time"))
            raise ValueError(f"{self.owner} monitor={self.name!r}: the {self.kind} records have no {self.key}; "
                             f"expected one of the values the run writes: {figures}")
        return float(record[self.key])

    def improves(self, value: float, best: float | None) -> bool:
        """Whether ``value`` is better than ``best`` by more than ``min_delta`` (anything beats no best; NaN
        never improves)."""
        if math.isnan(value):
            return False
        if best is None:
            return True
        return value < best - self.min_delta if self.mode == "min" else value > best + self.min_delta

    def format(self, value: float, run) -> str:
        """``3.12%`` for a rate this run shows in percent (its metric, the metric's other rates, an accuracy),
        else ``0.4123``."""
        rate = self.key.endswith("accuracy") or (self.key not in ("loss", "lr", "samples_per_second")
                                                 and run.metric_in_percent)
        return f"{100 * value:.2f}%" if rate else f"{value:.4g}"


def samples(count: int) -> str:
    """``6,144``: a sample count as the progress lines write it."""
    return f"{count:,}"
