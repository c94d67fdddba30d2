"""What the run writes its records to beside ``metrics.jsonl``: the CSV and TensorBoard files (``logger=csv``,
``logger=tensorboard``; ``docs/callbacks-and-loggers.md#loggers``), written by the session's metrics writer."""
from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from dtrain.session.callbacks import Callback

#: the CSV's leading columns, in this order; any other key of a record follows in first-seen order
CSV_COLUMNS = ("kind", "samples", "time", "loss", "error", "accuracy", "num_samples", "samples_per_second", "lr",
               "period_s", "data_s", "compute_s", "update_s", "exchange_s", "optimizer_s", "other_s",
               "bytes_sent_per_step")


class MetricsWriteError(RuntimeError):
    """A metrics file could not be written (a full disk, say); one line naming the file."""


class RecordFile(Callback):
    """A file of the run's records that the session's metrics writer keeps with ``metrics.jsonl``, one record at a
    time as it writes them: unlike a tracking logger it takes part in the run directory's rules (checked before
    anything is written, rewritten on resume, taken back with ``metrics.jsonl`` when a run is refused). Given as a
    logger (``logger=csv``), it replaces the session's own file of its kind, so nothing is written twice.

    The metrics writer calls ``bind`` when it is made (only reads), then ``open``, ``write`` for each record,
    ``close``, and ``take_back`` when the run's records are taken back.
    """

    def bind(self, run_dir: Path, metric_name: str | None) -> None:
        """Resolves where this file goes for ``run_dir`` and refuses a bad name (nothing is written).

        Raises:
            RunFileError: a link or a file of the wrong kind is at that name.
        """
        raise NotImplementedError

    def open(self, records: list[dict]) -> None:
        """Starts writing; ``records`` are those of ``metrics.jsonl`` so far (a resumed run's)."""
        raise NotImplementedError

    def write(self, record: dict) -> None:
        """Writes one record (as written to ``metrics.jsonl``)."""
        raise NotImplementedError

    def take_back(self) -> None:
        """Closes and puts what this run changed back as it was before ``open``."""
        raise NotImplementedError

    def close(self) -> None:
        """Closes the file (what was written stays)."""
        raise NotImplementedError


def split_record_files(callbacks: Iterable | None) -> tuple[list[RecordFile], list]:
    """The record files among a run's callbacks and loggers (written with ``metrics.jsonl``) and the other callbacks.

    Raises:
        ValueError: two record files of one kind (both would write every record).
    """
    files, others = [], []
    for callback in callbacks or ():
        (files if isinstance(callback, RecordFile) else others).append(callback)
    for file in files:
        twins = [other for other in files if type(other) is type(file)]
        if len(twins) > 1:
            raise ValueError(f"{len(twins)} {type(file).__name__}s were given; expected at most one (each writes "
                             f"every record of the run)")
    return files, others
