"""``logger=tensorboard``: the run's records as TensorBoard scalars (``pip install 'dtrain[tensorboard]'``;
``docs/callbacks-and-loggers.md#loggers``); every run writes them this way to ``run_dir/tensorboard`` when the
package is installed, unless ``session.tensorboard=false``."""
from __future__ import annotations

import secrets
from pathlib import Path

from dtrain.session.logger_requirements import check_writable_directory, require_package
from dtrain.safe_files import check_directory
from dtrain.session.record_files import RecordFile

#: a record's keys that say where it belongs rather than what was measured
_RECORD_FIELDS = ("kind", "samples", "time")


class TensorBoardLogger(RecordFile):
    """Writes every number of every record as the scalar ``<kind>/<key>`` (``train/loss``, ``cv/error``) at the
    record's global sample count, into one new event file per run (a resumed run adds its own beside the earlier
    ones; TensorBoard reads them as one run). A run whose records are taken back removes its event file.

    Args:
        log_dir: the directory: a name in the run directory (default ``tensorboard``) or an absolute path
            (several runs' directories below one ``tensorboard --logdir`` compare side by side).

    Raises:
        ValueError: the tensorboard package is not installed (naming the pip extra), or ``log_dir`` is not a name.
    """

    def __init__(self, log_dir: str | Path = "tensorboard"):
        require_package(self, "tensorboard", "tensorboard")
        if not isinstance(log_dir, (str, Path)) or Path(log_dir).name in ("", ".", ".."):
            raise ValueError(f"TensorBoardLogger log_dir={log_dir!r}: expected a directory name such as tensorboard")
        self.log_dir = Path(log_dir)
        self.directory: Path | None = None  # where it goes, once bound to a run directory
        self._writer = None
        self._suffix = f".{secrets.token_hex(4)}"  # an unguessable file name: nobody can plant a link there

    def bind(self, run_dir: Path, metric_name: str | None) -> None:
        self.directory = self.log_dir if self.log_dir.is_absolute() else Path(run_dir) / self.log_dir
        check_directory(self.directory, "TensorBoard events")
        if self.log_dir.is_absolute() or len(self.log_dir.parts) > 1:  # the run directory itself is checked by the run
            check_writable_directory(self.directory, "TensorBoardLogger log_dir")

    def open(self, records: list[dict]) -> None:
        if self._writer is not None:
            return
        from torch.utils.tensorboard import SummaryWriter  # imported lazily: it loads TensorBoard

        self._writer = SummaryWriter(log_dir=str(self.directory), filename_suffix=self._suffix)

    def write(self, record: dict) -> None:
        kind, samples = record["kind"], record["samples"]
        for name, value in record.items():
            if name not in _RECORD_FIELDS and isinstance(value, (int, float)):
                self._writer.add_scalar(f"{kind}/{name}", value, samples)

    def take_back(self) -> None:
        self.close()
        if self.directory is not None:
            for path in self.directory.glob(f"events.out.tfevents.*{self._suffix}"):
                path.unlink(missing_ok=True)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
