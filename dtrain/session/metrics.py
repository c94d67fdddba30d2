"""Metric records to the run directory: JSON lines (``metrics.jsonl``), CSV (``metrics.csv``) and TensorBoard
events; and the time split of the training loop's phases."""
from __future__ import annotations

import contextlib
import csv
import importlib.util
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

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

    A resumed run appends to the JSON lines; the CSV is rewritten from them when this writer opens
    (and whenever a record brings a new key), so its rows always match ``metrics.jsonl`` one for
    one under one header. ``records`` holds every record, earlier runs' included.

    Args:
        run_dir: the run directory (created if missing).
        tensorboard: also write TensorBoard events under ``run_dir/tensorboard``.
        enabled: whether this process writes (rank 0 only); a disabled writer does nothing.
        metric_name: the key the training metric is recorded under (a CSV column after ``loss``).
    """

    def __init__(self, run_dir: Path, tensorboard: bool = True, enabled: bool = True, metric_name: str = "error"):
        self.enabled = enabled
        self.jsonl_path = Path(run_dir) / "metrics.jsonl"
        self.csv_path = Path(run_dir) / "metrics.csv"
        self.tensorboard_dir = Path(run_dir) / "tensorboard" if tensorboard else None
        self.records: list[dict] = []
        self._columns = _leading_columns(metric_name)
        self._jsonl = None
        self._csv = None
        self._csv_writer = None
        self._tensorboard = None
        if not enabled:
            return
        self.jsonl_path.parent.mkdir(parents=True, exist_ok=True)
        self.records = _read_records(self.jsonl_path)
        # unbuffered appends: a resumed run keeps its history, and each record is one write that
        # is taken back whole if the disk fills (no torn last line for the next run to append to)
        self._jsonl = open(self.jsonl_path, "ab", buffering=0)
        if self.jsonl_path.stat().st_size and not self.jsonl_path.read_bytes().endswith(b"\n"):
            self._append_whole(b"\n")  # a run killed mid-line: start the next record on its own line
        self._rewrite_csv()
        if self.tensorboard_dir is not None:
            from torch.utils.tensorboard import SummaryWriter  # imported lazily: it loads TensorBoard

            self._tensorboard = SummaryWriter(log_dir=str(self.tensorboard_dir))

    def write(self, kind: str, samples_seen: int, **values: float) -> None:
        """Records ``values`` of one ``kind`` (train, cv, test) at ``samples_seen`` global samples."""
        if not self.enabled:
            return
        record = {"kind": kind, "samples": samples_seen, "time": round(time.time(), 3), **values}
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
        """Writes ``metrics.csv`` from ``records`` (temporary file, then rename) and keeps it open to append."""
        if self._csv is not None:
            self._csv.close()
        for record in self.records:
            self._columns += [key for key in record if key not in self._columns]
        temporary = self.csv_path.with_name(f".{self.csv_path.name}.tmp")
        with open(temporary, "w", encoding="utf-8", newline="") as file:
            writer = csv.DictWriter(file, fieldnames=self._columns, restval="")
            writer.writeheader()
            writer.writerows(self.records)
        os.replace(temporary, self.csv_path)
        self._csv = open(self.csv_path, "a", encoding="utf-8", newline="")
        self._csv_writer = csv.DictWriter(self._csv, fieldnames=self._columns, restval="")

    def close(self) -> None:
        """Closes the files (records written so far stay readable)."""
        for name in ("_jsonl", "_csv", "_tensorboard"):
            handle = getattr(self, name)
            if handle is not None:
                handle.close()
                setattr(self, name, None)


def _leading_columns(metric_name: str) -> list[str]:
    """The CSV's first columns: the run's own metric after ``loss``, in place of ``error`` and ``accuracy``
    (which only classification error has)."""
    if metric_name == "error":
        return list(CSV_COLUMNS)
    columns = [column for column in CSV_COLUMNS if column not in ("error", "accuracy")]
    columns.insert(columns.index("loss") + 1, metric_name)
    return columns


def _read_records(path: Path) -> list[dict]:
    """The JSON objects of an existing ``metrics.jsonl`` (a line that does not parse is skipped)."""
    if not path.is_file():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


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
