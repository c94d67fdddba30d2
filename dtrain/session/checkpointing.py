"""A training session's checkpoints: one saved at a step boundary (every rank synchronised first), and the
newest good one found and loaded at the start, with the run directory locked before any is read."""
from __future__ import annotations

import sys
from pathlib import Path

import torch

from dtrain.session import checkpoint, checkpoint_state
from dtrain.session.results import TrainingDiverged
from dtrain.session.rundir import RunDirectoryLock


class CheckpointHandling:
    """The checkpoints of :class:`~dtrain.session.TrainingSession` (mixed into it: it uses the session's model,
    learner, source, ``comm``, ``checkpoint_files``, ``checkpoint_config`` and periods)."""

    def _save_checkpoint(self, printer) -> Path:
        self.learner.synchronize()
        # every rank holds the same model now, so every rank reaches the same verdict
        if not all(bool(torch.isfinite(parameter).all()) for parameter in self.model.parameters()):
            raise TrainingDiverged(
                f"training diverged: the model has NaN or infinite parameters at {self.learner.samples_seen} samples "
                f"(not saved; {checkpoint.kept_note(self.checkpoint_files.newest())}); {self._advice()}")
        state = checkpoint_state.assemble(
            samples_seen=self.learner.samples_seen, minibatches=self.minibatches, cv_index=self.cv_index,
            model=self.model, learner=self.learner, source=self.source, comm=self.comm,
            expected_identity=self.checkpoint_identity, settings=self.settings,
            config_fingerprint=self.config_fingerprint,
            versions={"dtrain": _dtrain_version(), "torch": str(torch.__version__)},
            loss_scaler=self.loss_scaler.state_dict() if self.loss_scaler is not None else None,
            weight_ema=self.ema.state_dict() if self.ema is not None else None,
            callbacks=self.callbacks.state_dict() if self.callbacks.here else None)
        path = self.checkpoint_files.path(self.learner.samples_seen)
        if self.comm.is_main:
            self._saved_checkpoint = True  # from here on the run directory holds a run to resume: it is kept
            checkpoint.save_atomic(state, path, previous=self.checkpoint_files.newest())
            self.checkpoint_files.prune(0 if self.checkpoint_config.preserve_all else self.checkpoint_config.keep_last)
            printer.line(f"checkpoint saved at {self.learner.samples_seen} samples: {path}")
        self.comm.barrier()
        self.callbacks.fire("on_checkpoint_save", self.run_view, path)
        return path

    def restore(self) -> Path | None:
        """Locks the run directory (rank 0), then loads the newest good checkpoint when restore is on,
        or refuses to overwrite one when it is off.

        Called by ``train()``; call it earlier to find a bad checkpoint or a busy run directory before
        anything is written. Settings that may change (optimizer hyper-parameters, sizes, frequencies,
        schedules) keep their configured values; ``changed_settings`` lists them against the checkpoint.
        Returns the file restored from (``None``: starting fresh). Idempotent.

        Raises:
            CheckpointError: another job holds the run directory, no checkpoint is readable, or the newest
                belongs to another model or configuration.
        """
        if self._restore_attempted:
            return self._restored_from
        self._restore_attempted = True
        try:
            self._restored_from = self._load_latest()
        except BaseException as error:
            self._abandon_run_dir(error)  # a directory the lock created goes again
            self.release_run_dir()
            raise
        return self._restored_from

    def _load_latest(self) -> Path | None:
        def lock_run_dir() -> None:  # rank 0, before any checkpoint is read
            self._run_dir_lock = RunDirectoryLock.acquire(self.run_dir)

        config = self.checkpoint_config
        start, same_world = checkpoint_state.restore_latest(
            self.checkpoint_files, config.restore if config else False, self.model, self.learner, self.source,
            self.comm, self.checkpoint_identity, prepare=lock_run_dir, restore_from=config.restore_from if config else None)
        self._restore_note = start.note
        if start.state is None:
            return None
        path, state = start.path, start.state
        seen = self.learner.samples_seen
        # a model trained past max_samples would be reported as this run's, unless the checkpoint is the end of a
        # run to this same max_samples, which whole sequences overshoot: then there is nothing left to train
        if self.max_samples is not None and seen > self.max_samples \
                and checkpoint_state.max_samples_of(state) != self.max_samples:
            raise checkpoint.CheckpointError(
                f"checkpoint {path} has trained on {seen:,} samples, past session.max_samples={self.max_samples}; "
                f"set session.max_samples to at least {seen:,} to continue it, or use a new run directory "
                f"(or session.checkpoint.restore_from= an earlier checkpoint)")
        if not same_world and self.comm.is_main:
            print(f"dtrain: restoring a checkpoint of {state['world_size']} workers on {self.comm.size}: the data "
                  f"position is re-partitioned, replicated state reused, per-rank state (random numbers, "
                  f"the exchange strategy's residuals and factors) reset", file=self.stream or sys.stdout, flush=True)
        self.changed_settings = checkpoint_state.changed_settings(state.get("settings"), self.settings)
        if self.loss_scaler is not None and state.get("loss_scaler") is not None:
            self.loss_scaler.load_state_dict(state["loss_scaler"])  # a checkpoint of a float32/bf16 run: a fresh scale
        if self.ema is not None and state.get("weight_ema") is not None:
            self.ema.load_state_dict(state["weight_ema"])  # a checkpoint without one: the average starts afresh
        self.callbacks.load_state_dict(state.get("callbacks"))
        self.minibatches = int(state["minibatches"])
        self.cv_index = int(state["cv_index"])
        for period in (self.progress_period, self.checkpoint_period, self.cv_period):
            period.reset(seen)
        return path


def _dtrain_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("dtrain")
    except PackageNotFoundError:
        return "unknown"
