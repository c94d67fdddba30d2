"""``TimeLimit``: ends training after a wall-clock budget, so a job with a scheduler's time limit ends on its own
terms (its last checkpoint, its test, exit 0) instead of being killed."""
from __future__ import annotations

import sys
import time

from dtrain import checks
from dtrain.session.callbacks import Callback


def seconds_of(duration: float | int | str) -> float:
    """``duration`` in seconds: a number of seconds, or ``"HH:MM:SS"`` / ``"D-HH:MM:SS"`` (Slurm's ``--time``).

    Raises:
        ValueError: anything else, or a duration that is not positive (naming the value).
    """
    if isinstance(duration, bool):
        raise ValueError(f"TimeLimit max_time={duration!r}: expected seconds or HH:MM:SS")
    if isinstance(duration, (int, float)):
        return checks.positive_number("TimeLimit max_time", duration, unit="seconds")
    text = str(duration).strip()
    days, _, clock = text.rpartition("-")
    try:
        parts = [float(part) for part in clock.split(":")]
        whole_days = int(days) if days else 0
    except ValueError:
        raise ValueError(f"TimeLimit max_time={duration!r}: expected seconds or HH:MM:SS (D-HH:MM:SS with days)") \
            from None
    if not 1 <= len(parts) <= 3 or any(part < 0 for part in parts) or whole_days < 0:
        raise ValueError(f"TimeLimit max_time={duration!r}: expected seconds or HH:MM:SS (D-HH:MM:SS with days)")
    seconds = whole_days * 86400 + sum(part * 60 ** index for index, part in enumerate(reversed(parts)))
    return checks.positive_number("TimeLimit max_time", seconds, unit="seconds")


class TimeLimit(Callback):
    """Stops the run once ``max_time`` of wall-clock time has passed since this job started training.

    The budget is this job's (a resumed job gets it afresh, as a scheduler's time limit is per job). The run then
    ends as at ``max_samples``: a last checkpoint, the test, ``model.safetensors``, exit 0, with a line saying why;
    leave room for those in the budget. One process stops after the step that crossed the budget; several ranks
    agree at their next progress, cross-validation or checkpoint point, so a multi-rank run needs one of those
    periodically (``check`` refuses one that has none).

    Args:
        max_time: seconds, or ``"HH:MM:SS"`` (``"D-HH:MM:SS"`` with days, as Slurm writes ``--time``).
    """

    def __init__(self, max_time: float | int | str):
        self.max_time = seconds_of(max_time)
        self._deadline: float | None = None

    def check(self, run) -> None:
        """Refuses a multi-rank run whose ranks meet only at its end: the limit could not stop it any earlier."""
        if run.world_size > 1 and all(run.evaluation_period(kind) in (0, sys.maxsize) for kind in ("train", "cv")) \
                and run.checkpoint_period in (0, sys.maxsize):
            raise ValueError(f"TimeLimit max_time={self.max_time:g}: on {run.world_size} ranks a stop is agreed where "
                             f"the ranks meet (progress, cross-validation, checkpoints), and this run has none before "
                             f"its end; expected session.progress_frequency (or a checkpoint frequency) set")

    def on_run_start(self, run) -> None:
        self._deadline = time.monotonic() + self.max_time

    def on_step_end(self, run, step) -> None:
        if self._deadline is not None and time.monotonic() >= self._deadline:
            self._deadline = None  # said once
            run.stop(f"time limit: {_clock(self.max_time)} of training passed (TimeLimit max_time)")


def _clock(seconds: float) -> str:
    whole = int(round(seconds))
    return f"{whole // 3600}:{whole % 3600 // 60:02d}:{whole % 60:02d}"
