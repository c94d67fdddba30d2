"""``BestCheckpoint``: keeps the model's weights at its best value of a monitored metric (``best.safetensors``)."""
from __future__ import annotations

from pathlib import Path

from dtrain.callbacks.monitor import Monitor, samples
from dtrain.learners.replicated import ReplicatedLearner
from dtrain.session.callbacks import Callback

#: the files of the run directory that the run itself writes at its end (the best weights must not be one)
_RUN_OUTPUTS = ("model.safetensors", "model_ema.safetensors", "report.png", "metrics.jsonl", "metrics.csv")


class BestCheckpoint(Callback):
    """Writes the model's weights to ``run_dir/filename`` whenever ``monitor`` improves on its best.

    The file is written as ``model.safetensors`` is (load it the same way) and its metadata names the monitor,
    its value and the samples trained (``monitor``, ``value``, ``samples_seen``). It is written only where every
    rank holds the one model: cross-validation evaluates it, so ``cv.*`` monitors suit every learner; a
    ``train.*`` monitor is taken only where every step leaves one model (one process, or a learner that
    replicates the model: data_parallel and its kin). The best so far is kept in checkpoints, and a resumed run
    also reads the file's metadata, so a worse value after a restart never replaces a better file.

    Args:
        monitor: ``cv.KEY`` or ``train.KEY`` of ``metrics.jsonl`` (see ``EarlyStopping``).
        mode: ``"min"`` or ``"max"``; by default from the key.
        filename: the file's name in the run directory (or an absolute path).
    """

    def __init__(self, monitor: str = "cv.error", mode: str | None = None, filename: str = "best.safetensors"):
        self.monitor = Monitor("BestCheckpoint", monitor, mode)
        if not isinstance(filename, str) or filename.endswith("/") or Path(filename).name in ("", ".", ".."):
            raise ValueError(f"BestCheckpoint filename={filename!r}: expected a file name such as best.safetensors")
        if not Path(filename).is_absolute() and filename in _RUN_OUTPUTS:
            raise ValueError(f"BestCheckpoint filename={filename!r}: the run writes its own {filename} there at its "
                             f"end; expected another name, such as best.safetensors")
        self.filename = filename
        self.best: float | None = None
        self.best_samples: int | None = None

    def path(self, run) -> Path:
        """Where the best weights go: ``filename`` in the run directory."""
        filename = Path(self.filename)
        return filename if filename.is_absolute() else Path(run.run_dir) / filename

    def check(self, run) -> None:
        self.monitor.check(run)
        if self.monitor.kind == "train" and run.world_size > 1 and not isinstance(run.learner, ReplicatedLearner):
            raise ValueError(
                f"BestCheckpoint monitor={self.monitor.name!r}: the ranks of {type(run.learner).__name__} hold "
                f"different models between their synchronisations, so a progress report has no one model to keep; "
                f"expected a cv.* monitor (cross-validation evaluates the synchronised model)")

    def on_checkpoint_restore(self, run, path) -> None:
        """A better value in the file than in the checkpoint (written after it, by the run that was cut short)
        stays the best."""
        written = self._written(run)
        if written is not None and self.monitor.improves(written[0], self.best):
            self.best, self.best_samples = written

    def on_progress(self, run, record: dict) -> None:
        self._observe(run, record)

    def on_cross_validation(self, run, record: dict) -> None:
        self._observe(run, record)

    def _observe(self, run, record: dict) -> None:
        value = self.monitor.value(record)
        if value is None or not self.monitor.improves(value, self.best):
            return
        self.best, self.best_samples = value, int(record["samples"])
        run.save_weights(self.path(run), metadata={"monitor": self.monitor.name, "value": repr(value),
                                                   "mode": self.monitor.mode})

    def on_run_end(self, run, result) -> None:
        if self.best is None:
            run.line(f"best: no {self.monitor.name} value was recorded, so no {self.path(run)} was written")
        else:
            run.line(f"best: {self.monitor.name} {self.monitor.format(self.best, run)} at "
                     f"{samples(self.best_samples)} samples: {self.path(run)}")

    def _written(self, run) -> tuple[float, int] | None:
        """The value and samples of the file already written for this monitor (``None``: none, or another's)."""
        path = self.path(run)
        if not path.is_file():
            return None
        from safetensors import safe_open  # imported here: only a resumed run with a best file reads one

        with safe_open(str(path), framework="pt") as weights:
            metadata = weights.metadata() or {}
        if (metadata.get("monitor"), metadata.get("mode")) != (self.monitor.name, self.monitor.mode) \
                or "value" not in metadata:
            return None
        return float(metadata["value"]), int(metadata["samples_seen"])

    def state_dict(self) -> dict:
        return {"monitor": self.monitor.name, "mode": self.monitor.mode, "best": self.best,
                "best_samples": self.best_samples}

    def load_state_dict(self, state: dict) -> None:
        if (state.get("monitor"), state.get("mode")) == (self.monitor.name, self.monitor.mode):  # else: start afresh
            self.best, self.best_samples = state["best"], state["best_samples"]
