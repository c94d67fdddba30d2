"""Metric records to the run directory: JSON lines (``metrics.jsonl``), CSV (``metrics.csv``) and TensorBoard
events; and the time split of the training loop's phases."""
from __future__ import annotations

import contextlib
import datetime
import importlib.util
import json
import os
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

from dtrain.session.csv_logger import CsvLogger
from dtrain.session.tensorboard_logger import TensorBoardLogger
from dtrain.safe_files import check_regular, open_append, read_no_follow, replace_file
from dtrain.session.record_files import CSV_COLUMNS, MetricsWriteError, RecordFile  # noqa: F401 - re-exported

#: the one line a run explicitly asking for TensorBoard events gets when the package is missing
TENSORBOARD_MISSING = ("session.tensorboard=true needs the tensorboard package: pip install 'dtrain[tensorboard]' "
                       "(or set session.tensorboard=false)")


def tensorboard_available() -> bool:
    """Whether the ``tensorboard`` package (an optional extra) is importable."""
    return importlib.util.find_spec("tensorboard") is not None


def resolve_tensorboard(requested: bool | None, logger: bool = False) -> bool:
    """Whether to write TensorBoard events: ``None`` (the default) means when the package is installed;
    ``logger``: a ``TensorBoardLogger`` was given (``logger=tensorboard``), which asks for them.

    Raises:
        ValueError: ``requested`` is True but the package is missing (``TENSORBOARD_MISSING``), or False beside
            a ``TensorBoardLogger``.
    """
    if logger:
        if requested is False:
            raise ValueError("session.tensorboard=false and logger=tensorboard contradict each other; expected one "
                             "of them (session.tensorboard=false writes no TensorBoard events)")
        return True
    if requested is None:
        return tensorboard_available()
    if requested and not tensorboard_available():
        raise ValueError(TENSORBOARD_MISSING)
    return bool(requested)


class MetricsWriter:
    """Appends one record per progress period, cross-validation and test to ``run_dir/metrics.jsonl``,
    and the same records to the run's record files: the CSV (``metrics.csv``) and TensorBoard events.

    Creating a writer only reads: ``records`` holds every record of earlier runs (a resumed run
    directory), and the names are checked (a link or a directory named ``metrics.jsonl``, which is
    appended to, or ``tensorboard`` is refused with one line; ``metrics.csv`` is replaced whole). Nothing in the run
    directory changes until ``open()`` (or the first ``write``), which
    the session calls once the run's checks have passed, so a refused run leaves it as it was.
    A resumed run then appends to the JSON lines; the CSV is rewritten from them (and whenever a
    record brings a new key), so its rows always match ``metrics.jsonl`` one for one under one
    header. A ``metrics.jsonl`` with lines that are not JSON objects (a damaged disk, a foreign
    write) is only a log: ``open()`` moves it aside to ``metrics.jsonl.damaged-<time>`` with a
    one-line warning and continues with a fresh file holding its readable records.

    Args:
        run_dir: the run directory (created if missing).
        tensorboard: also write TensorBoard events (a default ``TensorBoardLogger``: ``run_dir/tensorboard``).
        enabled: whether this process writes (rank 0 only); a disabled writer does nothing.
        metric_name: the key the training metric is recorded under (a CSV column after ``loss``; ``None``: none).
        listener: called with every record after it is written (on every rank, also where nothing is written):
            the session gives records to its callbacks and loggers this way.
        files: the record files given as loggers (``logger=csv``, ``logger=tensorboard``, one of your own); a
            ``CsvLogger`` replaces the writer's own (``metrics.csv``), a ``TensorBoardLogger`` its own
            (``tensorboard``), so nothing is written twice.

    Raises:
        RunFileError: ``metrics.jsonl`` is not a regular file, or the TensorBoard directory is not a directory.
    """

    def __init__(self, run_dir: Path, tensorboard: bool = True, enabled: bool = True,
                 metric_name: str | None = "error", listener: Callable[[dict], None] | None = None,
                 files: Sequence[RecordFile] = ()):
        self.enabled = enabled
        self.listener = listener
        self.jsonl_path = Path(run_dir) / "metrics.jsonl"
        self.files: list[RecordFile] = list(files)
        if _given(files, CsvLogger) is None:
            self.files.append(CsvLogger())
        if tensorboard and _given(files, TensorBoardLogger) is None:
            self.files.append(TensorBoardLogger())
        self.csv = _given(self.files, CsvLogger)
        self.tensorboard = _given(self.files, TensorBoardLogger)
        self.records: list[dict] = []
        self._jsonl = None
        self._opened = False
        self._damage: str | None = None  # why metrics.jsonl cannot be appended to as it is
        if not enabled:
            return
        for file in self.files:
            file.bind(Path(run_dir), metric_name)
        check_regular(self.jsonl_path, "metric records")  # appended to; metrics.csv is replaced whole
        self.records, self._damage = read_records(self.jsonl_path)

    @property
    def csv_path(self) -> Path:
        """Where the CSV rows go (``run_dir/metrics.csv`` unless ``logger=csv`` says otherwise)."""
        return self.csv.file

    @property
    def tensorboard_dir(self) -> Path | None:
        """Where TensorBoard events go (``None``: none are written)."""
        return self.tensorboard.directory if self.tensorboard is not None else None

    def open(self) -> None:
        """Starts writing (idempotent): sets a damaged ``metrics.jsonl`` aside, opens it to append,
        and opens the record files (the CSV rewritten from the records, a new TensorBoard event file).

        Raises:
            MetricsWriteError: a file could not be written (one line naming it).
        """
        if not self.enabled or self._opened:
            return
        self._opened = True
        # what metrics.jsonl held before this run, for take_back()
        self._jsonl_bytes_before = self.jsonl_path.stat().st_size \
            if self._damage is None and self.jsonl_path.is_file() else None  # a damaged log is set aside whole
        self.jsonl_path.parent.mkdir(parents=True, exist_ok=True)
        try:
            if self._damage is not None:
                self._set_damaged_aside()
            # unbuffered appends: a resumed run keeps its history, and each record is one write that
            # is taken back whole if the disk fills (no torn last line for the next run to append to)
            self._jsonl = open_append(self.jsonl_path)
        except OSError as error:
            raise MetricsWriteError(f"{self.jsonl_path} could not be written ({error.strerror or error})") from None
        for file in self.files:
            file.open(self.records)

    def write(self, kind: str, samples_seen: int, **values: float) -> None:
        """Records ``values`` of one ``kind`` (train, cv, test) at ``samples_seen`` global samples."""
        record = {"kind": kind, "samples": samples_seen, "time": round(time.time(), 3), **values}
        if self.enabled:
            self._write(record)
        if self.listener is not None:
            self.listener(record)

    def _write(self, record: dict) -> None:
        self.open()
        self.records.append(record)  # the record files read the records from here too
        self._append_whole((json.dumps(record) + "\n").encode("utf-8"))
        for file in self.files:
            file.write(record)

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

    def take_back(self) -> None:
        """Closes the files and puts ``metrics.jsonl`` and the record files back as they were before ``open()``
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
        for file in self.files:
            file.take_back()

    def close(self) -> None:
        """Closes the files (records written so far stay readable)."""
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        for file in self.files:
            file.close()


def _given(files: Sequence[RecordFile], kind: type) -> RecordFile | None:
    """The record file of ``kind`` among ``files`` (``None``: none; ``split_record_files`` allows one of each)."""
    return next((file for file in files if isinstance(file, kind)), None)


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
