"""What the W&B and MLflow loggers share: one tracking run per job, kept across resumes (``docs/callbacks-and-loggers.md#loggers``).

A tracking logger is a :class:`~dtrain.session.callbacks.Callback` on rank 0. At ``on_run_start`` it starts a
tracking run, or, for a run resumed from its own checkpoint, continues the one whose id it kept in the run
directory (``run_dir/<client>_run_id``); every ``metrics.jsonl`` record it is given is logged at the record's
global sample count under ``<kind>/<key>`` (``train/loss``, ``cv/error``); at the end it logs the run's outputs
(:data:`OUTPUT_FILES`) and ends the tracking run as finished, failed,
or (preempted) left to be continued.
"""
from __future__ import annotations

import os
import warnings
from pathlib import Path

from dtrain.comm.base import first_line
from dtrain.session.logger_requirements import require_package
from dtrain.safe_files import check_regular, read_no_follow, replace_file
from dtrain.session.callbacks import Callback, RunView

#: the run's outputs logged as files of the tracking run when it ends (those that exist)
OUTPUT_FILES = ("report.png", "model.safetensors", "model_ema.safetensors", "best.safetensors")

#: how a tracking run ends: training finished, it failed, or it was preempted (to be continued)
FINISHED, FAILED, PREEMPTED = "finished", "failed", "preempted"

#: a record's keys that say where it belongs rather than what was measured
_RECORD_FIELDS = ("kind", "samples", "time")


class TrackingLogger(Callback):
    """Base of a logger writing to an experiment tracker; a subclass talks to its client library.

    Subclasses set ``package`` (what is imported), ``extra`` (the pip extra installing it), ``id_file`` and
    ``tracker`` (its name in lines), and implement ``_start``, ``_log``, ``_log_files`` and ``_end``.

    Raises:
        ValueError: the client package is not installed (naming the pip extra).
    """

    package: str
    extra: str
    id_file: str
    tracker: str

    def __init__(self):
        require_package(self, self.package, self.extra)
        self.run_id: str | None = None  # the tracking run's id, while it is open
        self._held: dict[str, int] = {}  # by record kind: the last step the continued tracking run already holds

    # -- the client's part ----------------------------------------------------------------------
    def _start(self, run: RunView, resume_id: str | None) -> str:
        """Starts a tracking run (continues ``resume_id`` when given) and returns its id."""
        raise NotImplementedError

    def _log(self, values: dict[str, float], step: int, timestamp: float) -> None:
        """Logs ``values`` at ``step`` (global samples); ``timestamp`` is the record's time in seconds."""
        raise NotImplementedError

    def _log_files(self, paths: list[Path]) -> None:
        """Attaches the run's output files to the tracking run."""
        raise NotImplementedError

    def _end(self, status: str) -> None:
        """Ends the tracking run as ``FINISHED``, ``FAILED`` or ``PREEMPTED``."""
        raise NotImplementedError

    # -- the events -----------------------------------------------------------------------------
    def check(self, run: RunView) -> None:
        check_regular(run.run_dir / self.id_file, f"{self.extra} run id")

    def on_run_start(self, run: RunView) -> None:
        id_path = run.run_dir / self.id_file
        # the tracking run follows the checkpoint: a run continuing its own checkpoint continues its tracking run,
        # a fresh start (or one that failed before its first checkpoint and starts again) gets a new one
        resume_id = None
        if run.restored_from is not None and os.path.lexists(id_path):
            resume_id = read_no_follow(id_path).decode("utf-8", "replace").strip() or None
        self.run_id = self._start(run, resume_id)
        replace_file(id_path, f"{self.run_id}\n".encode())
        self._held = held_steps(run.records, run.start_samples) if self.run_id == resume_id else {}
        if self._held:
            run.line(f"dtrain: {self.tracker} run {self.run_id} already holds records up to "
                     f"{max(self._held.values()):,} samples, logged before the restart from {run.start_samples:,}; "
                     f"this run's records up to there are kept in metrics.jsonl only")

    def on_progress(self, run: RunView, record: dict) -> None:
        self._log_record(record)

    def on_cross_validation(self, run: RunView, record: dict) -> None:
        self._log_record(record)

    def on_test(self, run: RunView, record: dict) -> None:
        self._log_record(record)

    def on_run_end(self, run: RunView, result) -> None:
        if self.run_id is None:
            return
        if not result.preempted:
            outputs = [run.run_dir / name for name in OUTPUT_FILES if (run.run_dir / name).is_file()]
            self._tolerate(self._log_files, outputs, what="the run's outputs (report.png, the weights) are not "
                                                          "attached; the run directory has them")
        self._tolerate(self._finish, PREEMPTED if result.preempted else FINISHED, what="its end is not recorded")

    def on_exception(self, run: RunView, error: BaseException) -> None:
        if self.run_id is not None:
            self._finish(FAILED)

    # -- helpers --------------------------------------------------------------------------------
    def _log_record(self, record: dict) -> None:
        if self.run_id is None or int(record["samples"]) <= self._held.get(record["kind"], -1):
            return  # trained again after a restart: the tracking run keeps the values it holds (held_steps)
        values = metric_values(record)
        if values:
            self._tolerate(self._log, values, int(record["samples"]), float(record.get("time", 0.0)),
                           what=f"the record at {record['samples']} samples is missing there (metrics.jsonl has it)")

    def _tolerate(self, action, *args, what: str) -> None:
        """Runs ``action``; a tracker that fails once training runs (a server gone, a full disk) costs a warning
        naming what is missing, not the training run: ``metrics.jsonl`` stays the record of the run."""
        try:
            action(*args)
        except Exception as error:  # noqa: BLE001 - see the docstring
            warnings.warn(f"{type(self).__name__}: {type(error).__name__}: {first_line(error)}; {what}",
                          RuntimeWarning, stacklevel=2)

    def _finish(self, status: str) -> None:
        try:
            self._end(status)
        finally:
            self.run_id = None


def metric_values(record: dict) -> dict[str, float]:
    """A ``metrics.jsonl`` record's measured numbers, keyed ``<kind>/<key>`` (``train/loss``, ``cv/error``)."""
    kind = record["kind"]
    return {f"{kind}/{key}": float(value) for key, value in record.items()
            if key not in _RECORD_FIELDS and isinstance(value, (int, float)) and not isinstance(value, bool)}


def recipe_name(run: RunView) -> str:
    """The run's recipe (``dtrain`` for a Python API run without a config): the default project/experiment."""
    config = run.config or {}
    return str(config.get("recipe_name") or "dtrain")


def held_steps(records: list[dict], start_samples: int) -> dict[str, int]:
    """What a continued tracking run already holds past the checkpoint its run resumes from (at ``start_samples``),
    by record kind: the last step of the earlier records (``metrics.jsonl``'s) of each kind beyond it.

    A run cut short (killed, or failed) after records past its last checkpoint were logged trains those steps again
    when it resumes. A tracker keeps one value per step (W&B drops a step it already has, MLflow would keep both and
    draw a zigzag), so the logger leaves the records of steps the tracking run already holds out of it, deliberately
    and for every tracker alike: its curves are the run as first logged, and ``metrics.jsonl`` has both.
    """
    held: dict[str, int] = {}
    for record in records:
        samples, kind = record.get("samples"), record.get("kind")
        if isinstance(samples, int) and isinstance(kind, str) and samples > start_samples:
            held[kind] = max(held.get(kind, samples), samples)
    return held


def sweep_dir() -> Path | None:
    """The directory of the sweep (``-m``) this job belongs to, ``None`` outside a sweep."""
    from dtrain.sweep import current_job

    job = current_job()
    return Path(job.sweep_dir) if job is not None else None


def run_name(run: RunView) -> str:
    """The tracking run's default name: the run directory's (a sweep job: the sweep's name and the job's number)."""
    sweep = sweep_dir()
    return f"{sweep.name}/{run.run_dir.name}" if sweep is not None else run.run_dir.name
