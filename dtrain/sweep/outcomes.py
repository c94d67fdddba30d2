"""Which job of a sweep is running, how each job ended, and the sweep's summary and exit status.

``start_sweep(argv)`` runs before Hydra starts the sweep: it counts the jobs when the command line
says how many (the basic sweeper's combinations) and marks the sweep with an id, both through the
environment, so jobs that a launcher runs in other processes see them too. Each job's rank 0
records its outcome (``record_outcome``), in this process and as one line of
``<sweep dir>/.dtrain-sweep-jobs.jsonl``; ``finish_sweep`` prints the table of this sweep's jobs,
writes it to ``<sweep dir>/sweep_summary.csv`` and returns the sweep's exit status.
"""
from __future__ import annotations

import contextlib
import csv
import io
import json
import logging
import os
import sys
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback

from dtrain.safe_files import first_free_name, open_append, replace_file

#: the environment variable that carries the sweep's id, job count and command-line overrides to its jobs
ENVIRONMENT = "DTRAIN_SWEEP"

#: in the sweep directory: one JSON line per job, appended by the job (any process)
ROWS_FILE = ".dtrain-sweep-jobs.jsonl"

#: in the sweep directory: this sweep's table, written at its end
SUMMARY_FILE = "sweep_summary.csv"

#: exit code of a sweep whose failed jobs did not all fail with the same code
EXIT_JOBS_FAILED = 1


class JobFailed(Exception):
    """A job of a sweep failed after printing its one line; Hydra records the job as failed.

    ``kind`` is ``"diverged"`` for a training loss that diverged or collapsed, else ``"failed"``.
    """

    def __init__(self, message: str, code: int, kind: str = "failed"):
        super().__init__(message, code, kind)  # the same arguments: the exception pickles to a launcher's parent
        self.message, self.code, self.kind = message, code, kind

    def __str__(self) -> str:
        return self.message


@dataclass(frozen=True)
class SweepJob:
    """One job of the running sweep: its number (Hydra's, also its directory's name), the number of
    jobs when known, its overrides that differ from the sweep's command line, and where it runs."""

    number: int
    total: int | None
    overrides: str
    sweep_dir: str
    run_dir: str

    def describe(self) -> str:
        """``job 1/3: optimizer.lr=-1``."""
        return f"job {self.number}{f'/{self.total}' if self.total else ''}: {self.overrides}"


@dataclass(frozen=True)
class JobOutcome:
    """How one job ended: ``finished`` with its objective (``None``: nothing was measured), or
    ``failed``/``diverged`` with its exit code and one-line message."""

    job: int
    overrides: str
    run_dir: str
    status: str
    objective: float | None = None
    code: int = 0
    message: str = ""


#: the outcomes of the jobs this process ran, in order
_outcomes: list[JobOutcome] = []

#: the sweep directory, as Hydra resolved it when the sweep started (set by ``SweepStart``)
_sweep_dir: list[str] = []


class SweepStart(Callback):
    """Hydra callback (``hydra.callbacks`` in ``conf/config.yaml``): notes the sweep directory, where
    ``finish_sweep`` reads the outcomes of jobs that ran in other processes, and keeps a failed job's
    report to its own line (Hydra and the Optuna sweeper would each add one more)."""

    def on_multirun_start(self, config, **kwargs) -> None:
        _sweep_dir[:] = [os.path.abspath(str(config.hydra.sweep.dir))]
        logging.getLogger("hydra_plugins.hydra_optuna_sweeper._impl").setLevel(logging.ERROR)  # "Failed experiment"

    def on_job_end(self, config, job_return: JobReturn, **kwargs) -> None:
        if job_return.status == JobStatus.FAILED and isinstance(job_return._return_value, JobFailed):
            job_return.__class__ = _FailedJobReturn


class _FailedJobReturn(JobReturn):
    """A job that failed with :class:`JobFailed`: still Hydra's failed job, whose ``return_value``
    raises the failure, but without Hydra's ``Error executing job with overrides`` line (the job
    printed its own)."""

    @property
    def return_value(self):
        if self.status == JobStatus.COMPLETED:
            return self._return_value
        raise self._return_value

    @return_value.setter
    def return_value(self, value) -> None:
        self._return_value = value


def _sweep_info() -> dict:
    try:
        return json.loads(os.environ.get(ENVIRONMENT, "{}"))
    except ValueError:
        return {}


def start_sweep(argv: list[str]) -> None:
    """Before Hydra runs the sweep of command line ``argv``: its id, job count and overrides, for its jobs."""
    _outcomes.clear()
    overrides = [argument for argument in argv if "=" in argument and not argument.startswith("-")]
    os.environ[ENVIRONMENT] = json.dumps({"id": uuid.uuid4().hex, "jobs": count_jobs(overrides),
                                          "swept": swept_keys(overrides)})


def swept_keys(overrides: list[str]) -> list[str]:
    """The keys the command line sweeps (``optimizer.lr=0.02,0.05``, ``interval(...)``, ``choice(...)``),
    which name a job; empty when Hydra's parser refuses the command line (Hydra then reports it)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except Exception:  # noqa: BLE001
        return []
    return [override.get_key_element().lstrip("+~") for override in parsed if override.is_sweep_override()]


def count_jobs(overrides: list[str]) -> int | None:
    """The basic sweeper's number of jobs for these command-line overrides (the product of the swept
    values' counts); ``None`` for another sweeper or a sweep it cannot count from the command line."""
    values = {argument.split("=", 1)[0].lstrip("+~"): argument.split("=", 1)[1] for argument in overrides}
    if values.get("hydra/sweeper", "basic") != "basic" or any(key.startswith("hydra.sweeper.params") for key in values):
        return None
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides([o for o in overrides if not o.startswith("hydra")])
        return len(BasicSweeper.split_arguments(parsed, None)[0])
    except Exception:  # noqa: BLE001 -- a glob or another sweep the command line alone does not resolve
        return None


def current_job() -> SweepJob | None:
    """The job of a sweep (``-m``) this process is running, ``None`` outside a sweep."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return None
    hydra = HydraConfig.get()
    info = _sweep_info()
    total = info.get("jobs") or hydra.sweeper.get("n_trials")
    swept = set(info.get("swept", []))
    own = [override for override in hydra.overrides.task if override.split("=", 1)[0].lstrip("+~") in swept]
    overrides = " ".join(own or hydra.overrides.task) or "(no overrides)"
    return SweepJob(int(hydra.job.num), int(total) if total else None, overrides,
                    os.path.abspath(hydra.sweep.dir), os.path.abspath(hydra.runtime.output_dir))


def record_outcome(job: SweepJob, status: str, *, objective: float | None = None, code: int = 0, message: str = "",
                   write: bool = True) -> JobOutcome:
    """Keeps how ``job`` ended; with ``write`` (rank 0) also appends it to the sweep directory's rows."""
    outcome = JobOutcome(job.number, job.overrides, job.run_dir, status, objective, code, message)
    _outcomes.append(outcome)
    if write:
        row = {"sweep": _sweep_info().get("id"), **asdict(outcome)}
        try:
            with open_append(Path(job.sweep_dir) / ROWS_FILE) as stream:
                stream.write((json.dumps(row) + "\n").encode())
        except OSError as error:  # the summary then misses a job run elsewhere; this process still has it
            print(f"dtrain: warning: {Path(job.sweep_dir) / ROWS_FILE} could not be written "
                  f"({error.strerror or error})", file=sys.stderr, flush=True)
    return outcome


def _recorded_elsewhere() -> list[JobOutcome]:
    """This sweep's outcomes written by jobs that ran in other processes (a launcher such as submitit)."""
    if not _sweep_dir:
        return []
    sweep_id, rows = _sweep_info().get("id"), []
    with contextlib.suppress(OSError):
        for line in (Path(_sweep_dir[0]) / ROWS_FILE).read_text(encoding="utf-8").splitlines():
            with contextlib.suppress(ValueError, TypeError):
                row = json.loads(line)
                if row.pop("sweep", None) == sweep_id:
                    rows.append(JobOutcome(**row))
    return sorted({row.job: row for row in rows}.values(), key=lambda row: row.job)


def sweep_outcomes() -> list[JobOutcome]:
    """How this sweep's jobs ended, in order: those this process ran, else those other processes recorded."""
    return list(_outcomes) or _recorded_elsewhere()


def exit_status(outcomes: list[JobOutcome]) -> int:
    """0 when every job finished; otherwise the failed jobs' exit code if they share one (2: every
    failure was a bad input or a divergence), else 1."""
    codes = {outcome.code for outcome in outcomes if outcome.status != "finished"}
    if not codes:
        return 0
    return codes.pop() if len(codes) == 1 else EXIT_JOBS_FAILED


#: characters of a failure's message the table shows (the CSV and the job's own line have all of it)
_SHOWN_MESSAGE = 80


def _shown(outcome: JobOutcome) -> str:
    if outcome.status == "finished":
        return f"objective {outcome.objective:.6g}" if outcome.objective is not None else "finished (no objective)"
    message = outcome.message if len(outcome.message) <= _SHOWN_MESSAGE else outcome.message[:_SHOWN_MESSAGE - 3] + "..."
    return f"{outcome.status} (exit {outcome.code}): {message}"


def summary_table(outcomes: list[JobOutcome]) -> str:
    """The sweep's jobs as an aligned text table: job, overrides, objective or failure, run directory."""
    rows = [("job", "overrides", "outcome", "run directory")]
    rows += [(str(o.job), o.overrides, _shown(o), o.run_dir) for o in outcomes]
    widths = [max(len(row[column]) for row in rows) for column in range(3)]
    return "\n".join("  " + "  ".join(cell.ljust(width) for cell, width in zip(row[:3], widths)) + "  " + row[3]
                     for row in rows)


def _summary_csv(outcomes: list[JobOutcome]) -> bytes:
    text = io.StringIO(newline="")
    writer = csv.writer(text)
    writer.writerow(["job", "overrides", "status", "objective", "exit_code", "message", "run_dir"])
    for o in outcomes:
        writer.writerow([o.job, o.overrides, o.status, "" if o.objective is None else o.objective, o.code, o.message,
                         o.run_dir])
    return text.getvalue().encode()


def keep_earlier_summary(where: Path) -> Path | None:
    """Renames an earlier run's summary at ``where`` (the same sweep directory, run again) to the first free
    ``sweep_summary.N.csv`` and returns that path (``None`` when there was none): a sweep run again, e.g. to
    continue its jobs, writes its own table and keeps the one before."""
    if not os.path.lexists(where):
        return None
    kept = first_free_name(where)
    os.replace(where, kept)
    return kept


def finish_sweep(is_main: bool, stopped_by: str | None = None) -> int:
    """After the sweep: rank 0 prints the table of its jobs and writes it to ``sweep_summary.csv``
    (with a last line on stderr when jobs failed); every rank returns the sweep's exit status.

    ``stopped_by`` is the one line of an error that ended the sweep before all its jobs ran (a
    sweeper giving up); the status is then non-zero even if every job that ran finished.
    """
    outcomes = sweep_outcomes()
    status = exit_status(outcomes)
    if stopped_by is not None and status == 0:
        status = EXIT_JOBS_FAILED
    if not is_main or not outcomes:
        return status
    failed = [outcome for outcome in outcomes if outcome.status != "finished"]
    sweep_dir = Path(_sweep_dir[0]) if _sweep_dir else Path(outcomes[0].run_dir).parent
    where, kept = sweep_dir / SUMMARY_FILE, None
    try:
        kept = keep_earlier_summary(where)
        replace_file(where, _summary_csv(outcomes))
    except OSError as error:
        where = None
        print(f"dtrain: warning: {sweep_dir / SUMMARY_FILE} could not be written ({error.strerror or error})",
              file=sys.stderr, flush=True)
    counts = f"{len(outcomes) - len(failed)} finished" + (f", {len(failed)} failed" if failed else "")
    earlier = f"; the earlier run's kept as {kept.name}" if where and kept else ""
    print(f"dtrain: sweep of {len(outcomes)} job{'s' if len(outcomes) != 1 else ''}: {counts}"
          + (f" (summary in {where}{earlier})" if where else ""), flush=True)
    print(summary_table(outcomes), flush=True)
    if failed or stopped_by:
        jobs = ", ".join(str(outcome.job) for outcome in failed)
        what = f"{len(failed)} of {len(outcomes)} jobs failed (job{'s' if len(failed) > 1 else ''} {jobs})" \
            if failed else f"all {len(outcomes)} jobs that ran finished"
        line = f"dtrain: error: sweep: {what}" + (f"; the sweep stopped: {stopped_by}" if stopped_by else "")
        sys.stdout.flush()
        print(line, file=sys.stderr, flush=True)
    return status
