"""Metric records to the run directory: JSON lines (``metrics.jsonl``) and TensorBoard events."""
from __future__ import annotations

import importlib.util
import json
import time
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


class MetricsWriter:
    """Appends one JSON object per record to ``run_dir/metrics.jsonl`` and mirrors scalars to TensorBoard.

    Args:
        run_dir: the run directory (created if missing).
        tensorboard: also write TensorBoard events under ``run_dir/tensorboard``.
        enabled: whether this process writes (rank 0 only); a disabled writer does nothing.
    """

    def __init__(self, run_dir: Path, tensorboard: bool = True, enabled: bool = True):
        self.enabled = enabled
        self.jsonl_path = Path(run_dir) / "metrics.jsonl"
        self.tensorboard_dir = Path(run_dir) / "tensorboard" if tensorboard else None
        self._jsonl = None
        self._tensorboard = None
        if not enabled:
            return
        self.jsonl_path.parent.mkdir(parents=True, exist_ok=True)
        self._jsonl = open(self.jsonl_path, "a", encoding="utf-8")  # append: a resumed run keeps its history
        if self.tensorboard_dir is not None:
            from torch.utils.tensorboard import SummaryWriter  # imported lazily: it loads TensorBoard

            self._tensorboard = SummaryWriter(log_dir=str(self.tensorboard_dir))

    def write(self, kind: str, samples_seen: int, **values: float) -> None:
        """Records ``values`` of one ``kind`` (train, cv, test) at ``samples_seen`` global samples."""
        if not self.enabled:
            return
        record = {"kind": kind, "samples": samples_seen, "time": round(time.time(), 3), **values}
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        if self._tensorboard is not None:
            for name, value in values.items():
                if isinstance(value, (int, float)):
                    self._tensorboard.add_scalar(f"{kind}/{name}", value, samples_seen)

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None
