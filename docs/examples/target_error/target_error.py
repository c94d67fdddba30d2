"""A callback of your own: ends training once a cross-validation reaches a target error (docs/callbacks-and-loggers.md).

Choose it with ``--config-dir conf callbacks=[target_error]`` from a directory where Python finds this module (the
working directory, or PYTHONPATH).
"""
from dtrain import Callback, checks


class TargetError(Callback):
    """Stops the run at the first cross-validation whose error is at or below ``error`` (a fraction: 0.05 is 5%)."""

    def __init__(self, error: float = 0.05):
        self.error = checks.number_in_range("TargetError error", error, 0.0, 1.0)

    def check(self, run):
        """Refused before anything is written when the run writes no cv.error to compare."""
        if "error" not in run.produced_metrics().get("cv", ()):
            raise ValueError("TargetError: this run writes no cv.error; expected cross-validation data "
                             "(source.cv) and the classification_error metric")

    def on_cross_validation(self, run, record):
        if record["error"] <= self.error:
            run.stop(f"cross-validation error {100 * record['error']:.2f}% reached the target {100 * self.error:.2f}%")
