"""``logger=csv``: the run's records as CSV rows (``docs/callbacks-and-loggers.md#loggers``); every run writes
``run_dir/metrics.csv`` this way unless ``logger=csv`` says where else."""
from __future__ import annotations

import contextlib
import csv
import io
import os
from pathlib import Path

from dtrain.session.logger_requirements import check_writable_directory
from dtrain.safe_files import open_replacement, replace_file
from dtrain.session.record_files import CSV_COLUMNS, MetricsWriteError, RecordFile


class CsvLogger(RecordFile):
    """Writes every record of ``metrics.jsonl`` as a row of one CSV file, under one header.

    The file is rewritten from ``metrics.jsonl`` when a run opens it (a resumed run's rows included) and whenever a
    record brings a new key, so its rows always match ``metrics.jsonl`` one for one; each rewrite is a new file
    renamed over the old one (a link at its name is replaced, not followed). A run whose records are taken back
    (refused by its data) puts the file back as it was.

    Args:
        path: the file: a name in the run directory (default ``metrics.csv``) or an absolute path; it must end in
            ``.csv``.

    Raises:
        ValueError: ``path`` is not a ``.csv`` file name.
    """

    def __init__(self, path: str | Path = "metrics.csv"):
        if not isinstance(path, (str, Path)) or str(path).endswith("/") or Path(path).suffix != ".csv":
            raise ValueError(f"CsvLogger path={path!r}: expected a file name ending in .csv, such as metrics.csv")
        self.path = Path(path)
        self.file: Path | None = None  # where it goes, once bound to a run directory
        self._columns: list[str] = []
        self._records: list[dict] = []
        self._stream = None
        self._writer = None
        self._before: bytes | None = None
        self._opened = False

    def bind(self, run_dir: Path, metric_name: str | None) -> None:
        self.file = self.path if self.path.is_absolute() else Path(run_dir) / self.path
        if self.path.is_absolute() or len(self.path.parts) > 1:  # the run directory itself is checked by the run
            check_writable_directory(self.file.parent, "CsvLogger path")
        self._columns = leading_columns(metric_name)

    def open(self, records: list[dict]) -> None:
        if self._opened:
            return
        self._opened = True
        self._before = self.file.read_bytes() if self.file.is_file() else None  # for take_back()
        self.file.parent.mkdir(parents=True, exist_ok=True)
        self._records = records
        self._rewrite()

    def write(self, record: dict) -> None:
        try:
            if any(key not in self._columns for key in record):
                self._rewrite()  # a new column: one header for every row
            else:
                self._writer.writerow(record)
                self._stream.flush()
        except OSError as error:  # rebuilt from metrics.jsonl when a run opens it
            raise MetricsWriteError(f"{self.file} could not be written ({error.strerror or error}); "
                                    f"metrics.jsonl has every record so far") from None

    def _rewrite(self) -> None:
        """Writes the file from the records (a new temporary file renamed over it) and keeps it open to append.

        Raises:
            MetricsWriteError: it could not be written (a full disk); the temporary is removed and the earlier
                file left as it was.
        """
        self.close()
        for record in self._records:
            self._columns += [key for key in record if key not in self._columns]
        temporary = None
        try:
            stream, temporary = open_replacement(self.file)
            text = io.TextIOWrapper(stream, encoding="utf-8", newline="")
            try:
                writer = csv.DictWriter(text, fieldnames=self._columns, restval="")
                writer.writeheader()
                writer.writerows(self._records)
                text.flush()
                os.replace(temporary, self.file)  # the open file is now the CSV: appends go on into it
            except BaseException:
                with contextlib.suppress(OSError):
                    text.close()
                raise
        except OSError as error:
            if temporary is not None:
                temporary.unlink(missing_ok=True)
            raise MetricsWriteError(f"{self.file} could not be written ({error.strerror or error}); "
                                    f"metrics.jsonl has every record so far") from None
        self._stream = text
        self._writer = csv.DictWriter(text, fieldnames=self._columns, restval="")

    def take_back(self) -> None:
        self.close()
        if not self._opened:
            return
        if self._before is not None:
            replace_file(self.file, self._before)
        else:
            self.file.unlink(missing_ok=True)  # this run created it

    def close(self) -> None:
        if self._stream is not None:
            self._stream.close()
            self._stream = None


def leading_columns(metric_name: str | None) -> list[str]:
    """The CSV's first columns: the run's own metric after ``loss``, in place of ``error`` and ``accuracy``
    (which only classification error has); ``None`` (an objective's run): no metric column (its figures
    follow as columns of their own)."""
    if metric_name == "error":
        return list(CSV_COLUMNS)
    columns = [column for column in CSV_COLUMNS if column not in ("error", "accuracy")]
    if metric_name is not None:
        columns.insert(columns.index("loss") + 1, metric_name)
    return columns
