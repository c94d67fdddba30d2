"""Metric records to the run directory: JSON lines (``metrics.jsonl``), CSV (``metrics.csv``) and TensorBoard
events; and the time split of the training loop's phases."""
from __future__ import annotations

import contextlib
import csv
import datetime
import importlib.util
import io
import json
import os
import secrets
import time
import warnings
from collections.abc import Callable
from pathlib import Path

from dtrain.session.safe_files import (check_directory, check_regular, open_append, open_replacement, read_no_follow,
                                       replace_file)

#: the one line a run explicitly asking for TensorBoard events gets when the package is missing
TENSORBOARD_MISSING = ("session.tensorboard=true needs the tensorboard package: pip install 'dtrain[tensorboard]' "
                       "(or set session.tensorboard=false)")


def tensorboard_available() -> bool:
    """Whether the ``tensorboard`` package (an optional extra) is importable."""
    return importlib.util.find_spec("tensorboard") is not None


def resolve_tensorboard(requested: bool | None) -> bool:
    """Whether to write TensorBoard events: ``None`` (the default) means when the package is installed.

    Raises:
        ValueError: ``requested`` is True but the package is missing (``TENSORBOARD_MISSING``).
    """
    if requested is None:
        return tensorboard_available()
    if requested and not tensorboard_available():
        raise ValueError(TENSORBOARD_MISSING)
    return bool(requested)


#: the CSV's leading columns, in this order; any other key of a record follows in first-seen order
CSV_COLUMNS = ("kind", "samples", "time", "loss", "error", "accuracy", "num_samples", "samples_per_second", "lr",
               "period_s", "data_s", "compute_s", "update_s", "exchange_s", "optimizer_s", "other_s",
               "bytes_sent_per_step")


class MetricsWriteError(RuntimeError):
    """A metrics file could not be written (a full disk, say); one line naming the file."""


class MetricsWriter:
    """Appends one record per progress period, cross-validation and test to ``run_dir/metrics.jsonl``,
    the same rows to ``run_dir/metrics.csv``, and scalars to TensorBoard.

    Creating a writer only reads: ``records`` holds every record of earlier runs (a resumed run
    directory), and the names are checked (a link or a directory named ``metrics.jsonl``, which is
    appended to, or ``tensorboard`` is refused with one line; ``metrics.csv`` is replaced whole). Nothing in the run directory changes until ``open()`` (or the first ``write``), which
    the session calls once the run's checks have passed, so a refused run leaves it as it was.
    A resumed run then appends to the JSON lines; the CSV is rewritten from them (and whenever a
    record brings a new key), so its rows always match ``metrics.jsonl`` one for one under one
    header. A ``metrics.jsonl`` with lines that are not JSON objects (a damaged disk, a foreign
    write) is only a log: ``open()`` moves it aside to ``metrics.jsonl.damaged-<time>`` with a
    one-line warning and continues with a fresh file holding its readable records.

    Args:
        run_dir: the run directory (created if missing).
        tensorboard: also write TensorBoard events under ``run_dir/tensorboard``.
        enabled: whether this process writes (rank 0 only); a disabled writer does nothing.
        metric_name: the key the training metric is recorded under (a CSV column after ``loss``; ``None``: none).
        listener: called with every record after it is written (on every rank, also where nothing is written):
            the session gives records to its callbacks and loggers this way.

    Raises:
        RunFileError: ``metrics.jsonl`` is not a regular file, or ``tensorboard`` is not a directory.
    """

    def __init__(self, run_dir: Path, tensorboard: bool = True, enabled: bool = True,
                 metric_name: str | None = "error", listener: Callable[[dict], None] | None = None):
        self.enabled = enabled
        self.listener = listener
        self.jsonl_path = Path(run_dir) / "metrics.jsonl"
        self.csv_path = Path(run_dir) / "metrics.csv"
        self.tensorboard_dir = Path(run_dir) / "tensorboard" if tensorboard else None
        self.records: list[dict] = []
        self._columns = _leading_columns(metric_name)
        self._jsonl = None
        self._csv = None
        self._csv_writer = None
        self._tensorboard = None
        self._opened = False
        self._damage: str | None = None  # why metrics.jsonl cannot be appended to as it is
        if not enabled:
            return
        check_regular(self.jsonl_path, "metric records")  # appended to; metrics.csv is replaced whole
        if self.tensorboard_dir is not None:
            check_directory(self.tensorboard_dir, "TensorBoard events")
        self.records, self._damage = read_records(self.jsonl_path)

    def open(self) -> None:
        """Starts writing (idempotent): sets a damaged ``metrics.jsonl`` aside, opens it to append,
        rewrites ``metrics.csv`` from the records and starts TensorBoard's event file.

        Raises:
            MetricsWriteError: a file could not be written (one line naming it).
        """
        if not self.enabled or self._opened:
            return
        self._opened = True
        # what the files held before this run, for take_back()
        self._jsonl_bytes_before = self.jsonl_path.stat().st_size \
            if self._damage is None and self.jsonl_path.is_file() else None  # a damaged log is set aside whole
        self._csv_before = self.csv_path.read_bytes() if self.csv_path.is_file() else None
        self.jsonl_path.parent.mkdir(parents=True, exist_ok=True)
        try:
            if self._damage is not None:
                self._set_damaged_aside()
            # unbuffered appends: a resumed run keeps its history, and each record is one write that
            # is taken back whole if the disk fills (no torn last line for the next run to append to)
            self._jsonl = open_append(self.jsonl_path)
        except OSError as error:
            raise MetricsWriteError(f"{self.jsonl_path} could not be written ({error.strerror or error})") from None
        self._rewrite_csv()
        if self.tensorboard_dir is not None:
            from torch.utils.tensorboard import SummaryWriter  # imported lazily: it loads TensorBoard

            # an unguessable file name: nobody can plant a link where the events will go
            self._tensorboard = SummaryWriter(log_dir=str(self.tensorboard_dir),
                                              filename_suffix=f".{secrets.token_hex(4)}")

    def write(self, kind: str, samples_seen: int, **values: float) -> None:
        """Records ``values`` of one ``kind`` (train, cv, test) at ``samples_seen`` global samples."""
        record = {"kind": kind, "samples": samples_seen, "time": round(time.time(), 3), **values}
        if self.enabled:
            self._write(record)
        if self.listener is not None:
            self.listener(record)

    def _write(self, record: dict) -> None:
        self.open()
        kind, samples_seen = record["kind"], record["samples"]
        values = {key: value for key, value in record.items() if key not in ("kind", "samples", "time")}
        self.records.append(record)
        self._append_whole((json.dumps(record) + "\n").encode("utf-8"))
        try:
            if any(key not in self._columns for key in record):
                self._rewrite_csv()  # a new column: one header for every row
            else:
                self._csv_writer.writerow(record)
                self._csv.flush()
        except OSError as error:  # metrics.csv is rebuilt from metrics.jsonl when a run opens it
            raise MetricsWriteError(f"{self.csv_path} could not be written ({error.strerror or error}); "
                                    f"{self.jsonl_path.name} has every record so far") from None
        if self._tensorboard is not None:
            for name, value in values.items():
                if isinstance(value, (int, float)):
                    self._tensorboard.add_scalar(f"{kind}/{name}", value, samples_seen)

    def _set_damaged_aside(self) -> None:
        """Renames the damaged ``metrics.jsonl`` to ``metrics.jsonl.damaged-<time>`` (never over another
        file) and writes a fresh one with its readable records, saying so in one warning line."""
        stamp = datetime.datetime.now().strftime("%Y%m%dT%H%M%S")
        aside = self.jsonl_path.with_name(f"{self.jsonl_path.name}.damaged-{stamp}")
        number = 1
        while os.path.lexists(aside):
            aside = self.jsonl_path.with_name(f"{self.jsonl_path.name}.damaged-{stamp}-{number}")
            number += 1
        os.rename(self.jsonl_path, aside)
        replace_file(self.jsonl_path, b"".join((json.dumps(record) + "\n").encode("utf-8") for record in self.records))
        warnings.warn(f"{self.jsonl_path} is damaged ({self._damage}); moved it aside to {aside.name} and continuing "
                      f"with a fresh {self.jsonl_path.name} holding its {len(self.records)} readable records",
                      RuntimeWarning, stacklevel=3)
        self._damage = None

    def _append_whole(self, data: bytes) -> None:
        """Appends ``data`` to metrics.jsonl, or on a write error cuts the file back to before it and raises."""
        descriptor = self._jsonl.fileno()
        size = os.fstat(descriptor).st_size
        try:
            view = memoryview(data)
            while view:
                view = view[self._jsonl.write(view):]
        except OSError as error:
            with contextlib.suppress(OSError):
                os.ftruncate(descriptor, size)
            raise MetricsWriteError(f"{self.jsonl_path} could not be written ({error.strerror or error}); the records "
                                    f"before this one are kept") from None

    def _rewrite_csv(self) -> None:
        """Writes ``metrics.csv`` from ``records`` (a new temporary file renamed over it, so a link at its
        name is replaced, not followed) and keeps it open to append.

        Raises:
            MetricsWriteError: it could not be written (a full disk); the temporary is removed and the
                earlier ``metrics.csv`` left as it was.
        """
        if self._csv is not None:
            self._csv.close()
            self._csv = None
        for record in self.records:
            self._columns += [key for key in record if key not in self._columns]
        temporary = None
        try:
            stream, temporary = open_replacement(self.csv_path)
            text = io.TextIOWrapper(stream, encoding="utf-8", newline="")
            try:
                writer = csv.DictWriter(text, fieldnames=self._columns, restval="")
                writer.writeheader()
                writer.writerows(self.records)
                text.flush()
                os.replace(temporary, self.csv_path)  # the open file is now metrics.csv: appends go on into it
            except BaseException:
                with contextlib.suppress(OSError):
                    text.close()
                raise
        except OSError as error:
            if temporary is not None:
                temporary.unlink(missing_ok=True)
            raise MetricsWriteError(f"{self.csv_path} could not be written ({error.strerror or error}); "
                                    f"{self.jsonl_path.name} has every record so far") from None
        self._csv = text
        self._csv_writer = csv.DictWriter(self._csv, fieldnames=self._columns, restval="")

    def take_back(self) -> None:
        """Closes the files and puts ``metrics.jsonl`` and ``metrics.csv`` back as they were before ``open()``
        (a run refused by its data leaves no records); files this run created are left to the caller."""
        self.close()
        if not self._opened:
            return
        if self._jsonl_bytes_before is not None:
            descriptor = os.open(self.jsonl_path, os.O_WRONLY | os.O_NOFOLLOW)  # never through a link
            try:
                os.ftruncate(descriptor, self._jsonl_bytes_before)
            finally:
                os.close(descriptor)
        if self._csv_before is not None:
            replace_file(self.csv_path, self._csv_before)

    def close(self) -> None:
        """Closes the files (records written so far stay readable)."""
        for name in ("_jsonl", "_csv", "_tensorboard"):
            handle = getattr(self, name)
            if handle is not None:
                handle.close()
                setattr(self, name, None)


def _leading_columns(metric_name: str | None) -> list[str]:
    """The CSV's first columns: the run's own metric after ``loss``, in place of ``error`` and ``accuracy``
    (which only classification error has); ``None`` (an objective's run): no metric column (its figures
    follow as columns of their own)."""
    if metric_name == "error":
        return list(CSV_COLUMNS)
    columns = [column for column in CSV_COLUMNS if column not in ("error", "accuracy")]
    if metric_name is not None:
        columns.insert(columns.index("loss") + 1, metric_name)
    return columns


def read_records(path: Path) -> tuple[list[dict], str | None]:
    """The JSON objects of an existing ``metrics.jsonl``, and why it is damaged (``None``: it is not).

    Every line must be UTF-8 text holding one JSON object; the lines that are not are left out and
    described (the first one's number and what is wrong, and how many more).
    """
    if not os.path.lexists(path):
        return [], None
    lines = read_no_follow(path).split(b"\n")
    if lines[-1] == b"":
        lines.pop()  # the newline that ends the last record
    records, bad = [], []
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line.decode("utf-8"))
        except UnicodeDecodeError:
            bad.append(f"line {number} is not UTF-8 text")
            continue
        except json.JSONDecodeError:
            bad.append(f"line {number} is not JSON")
            continue
        if isinstance(record, dict):
            records.append(record)
        else:
            bad.append(f"line {number} is not a JSON object")
    if not bad:
        return records, None
    return records, bad[0] + (f", and {len(bad) - 1} more line{'s' if len(bad) > 2 else ''}" if len(bad) > 1 else "")


class PhaseTimer:
    """Wall time of the training loop's phases over one progress period (``time.perf_counter``).

    The loop calls ``mark()`` at the top of a step, ``lap("data")`` when the minibatch is read,
    ``lap("compute")`` after forward and backward, and ``lap_update(exchange_seconds)`` after the
    learner's step, whose time is split into ``exchange`` (what the learner reports as spent on the
    gradient exchange that did not overlap backward, ``Learner.exchange_seconds_last_step``) and
    ``optimizer`` (the rest of the step). On a GPU, ``synchronize`` (e.g. ``torch.cuda.synchronize``)
    runs before a ``compute`` or update lap, so queued kernels count where they were issued; on the
    CPU nothing extra runs.
    """

    PHASES = ("data", "compute", "exchange", "optimizer")

    def __init__(self, synchronize: Callable[[], None] | None = None):
        self._synchronize = synchronize
        self._last = time.perf_counter()
        self.seconds = dict.fromkeys(self.PHASES, 0.0)

    def mark(self) -> None:
        """Starts timing the next phase from now."""
        self._last = time.perf_counter()

    def lap(self, phase: str) -> None:
        """Adds the time since the last ``mark``/``lap`` to ``phase``."""
        if self._synchronize is not None and phase != "data":
            self._synchronize()
        now = time.perf_counter()
        self.seconds[phase] += now - self._last
        self._last = now

    def lap_update(self, exchange_seconds: float = 0.0) -> None:
        """Adds the time since the last lap, the learner's step, as ``exchange_seconds`` of exchange (at
        most the whole step; a value that is not a finite number counts as 0) and the rest as optimizer."""
        if self._synchronize is not None:
            self._synchronize()
        now = time.perf_counter()
        step = now - self._last
        self._last = now
        if not isinstance(exchange_seconds, (int, float)) or not exchange_seconds > 0:  # also NaN
            exchange_seconds = 0.0
        exchange = min(float(exchange_seconds), step)
        self.seconds["exchange"] += exchange
        self.seconds["optimizer"] += step - exchange

    def take(self, period_seconds: float) -> dict[str, float]:
        """``period_s``, ``data_s``, ``compute_s``, ``update_s`` (= ``exchange_s`` + ``optimizer_s``),
        ``exchange_s``, ``optimizer_s`` and ``other_s`` (the rest of the period: progress, evaluation,
        checkpoints), rounded to microseconds; starts a new period."""
        seconds = self.seconds
        split = {"data_s": seconds["data"], "compute_s": seconds["compute"],
                 "update_s": seconds["exchange"] + seconds["optimizer"]}
        split["other_s"] = max(0.0, period_seconds - sum(split.values()))
        split["exchange_s"] = seconds["exchange"]
        split["optimizer_s"] = seconds["optimizer"]
        self.seconds = dict.fromkeys(self.PHASES, 0.0)
        return {key: round(value, 6) for key, value in {"period_s": period_seconds, **split}.items()}
