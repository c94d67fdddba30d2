"""``EarlyStopping``: ends training when a monitored value has stopped improving for ``patience`` evaluations."""
from __future__ import annotations

import sys

from dtrain import checks
from dtrain.callbacks.monitor import Monitor, samples
from dtrain.session.callbacks import Callback


class EarlyStopping(Callback):
    """Stops the run once ``monitor`` has not improved on its best for ``patience`` evaluations in a row.

    The run then ends as at ``max_samples`` (last checkpoint, test, outputs, exit 0) with a line saying why, and
    ``TrainingResult.stopped_early``/``stop_reason`` set. The best value, where it was reached and the count so far
    are kept in checkpoints, so a resumed run continues the count; a run resumed after the stop ends again at its
    first point where the ranks meet.

    Args:
        monitor: ``cv.KEY`` (``cv.error``, ``cv.loss``, the run's metric name) or ``train.KEY`` (``train.loss``):
            a value the run writes to ``metrics.jsonl``, checked when the session is built.
        mode: ``"min"`` or ``"max"``; by default from the key (loss and error rates: min, accuracy: max).
        patience: evaluations (cross-validations, or progress reports for ``train.*``) without improvement
            before the run stops.
        min_delta: how much better than the best a value must be to count as an improvement.
    """

    def __init__(self, monitor: str = "cv.error", mode: str | None = None, patience: int = 3, min_delta: float = 0.0):
        self.monitor = Monitor("EarlyStopping", monitor, mode, min_delta)
        self.patience = checks.whole_number("EarlyStopping patience", patience, low=1, unit="evaluations")
        self.best: float | None = None
        self.best_samples: int | None = None
        self.wait = 0  # evaluations since the best

    def check(self, run) -> None:
        """Also refuses a run that evaluates the monitor only at its end: it could never stop early."""
        self.monitor.check(run)
        period, end = run.evaluation_period(self.monitor.kind), run.max_samples
        if period == sys.maxsize or (end is not None and period >= end):
            setting = ("the cross-validation frequency (session.cv.frequency)" if self.monitor.kind == "cv" else
                       "the progress frequency (session.progress_frequency)")
            when = ("only once, at its end" if period == sys.maxsize else
                    f"only at its end (every {period:,} samples, max_samples {end:,})")
            raise ValueError(f"EarlyStopping monitor={self.monitor.name!r}: this run evaluates it {when}, so it could "
                             f"never stop early; expected {setting} below max_samples")

    def on_run_start(self, run) -> None:
        if self.wait >= self.patience:  # restored from the checkpoint the stop left: stop again, at once
            run.stop(self.reason(run))

    def on_progress(self, run, record: dict) -> None:
        self._observe(run, record)

    def on_cross_validation(self, run, record: dict) -> None:
        self._observe(run, record)

    def _observe(self, run, record: dict) -> None:
        value = self.monitor.value(record)
        if value is None:
            return
        if self.monitor.improves(value, self.best):
            self.best, self.best_samples, self.wait = value, int(record["samples"]), 0
            return
        self.wait += 1
        if self.wait >= self.patience:
            run.stop(self.reason(run))

    def reason(self, run) -> str:
        """``early stopping: cv.error has not improved on 3.12% (at 4,096 samples) for 3 cross-validations
        (patience 3)``."""
        monitor = self.monitor
        since = (f"on {monitor.format(self.best, run)} (at {samples(self.best_samples)} samples)"
                 if self.best is not None else "(no finite value yet)")
        return (f"early stopping: {monitor.name} has not improved {since} for {self.wait} "
                f"{monitor.evaluation}{'s' if self.wait != 1 else ''} (patience {self.patience})")

    def state_dict(self) -> dict:
        return {"monitor": self.monitor.name, "mode": self.monitor.mode, "best": self.best,
                "best_samples": self.best_samples, "wait": self.wait}

    def load_state_dict(self, state: dict) -> None:
        if (state.get("monitor"), state.get("mode")) != (self.monitor.name, self.monitor.mode):
            return  # another monitor or mode since: its best says nothing of this one
        self.best, self.best_samples, self.wait = state["best"], state["best_samples"], int(state["wait"])
