"""A training session's checkpoints: one saved at a step boundary (every rank synchronised first), and the
newest good one found and loaded at the start, with the run directory locked before any is read."""
from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from dtrain.session import checkpoint, checkpoint_state, sharded_checkpoint
from dtrain.session.configs import CheckpointConfig
from dtrain.session.results import TrainingDiverged


class Stateful(Protocol):
    """A part of the session whose state a checkpoint keeps (the loss scale, the weight EMA, the callbacks)."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


@runtime_checkable
class ShardedStateful(Stateful, Protocol):
    """A part that keeps tensors in shards (the weight EMA of a sharded model): those go in a sharded checkpoint's
    files, written by every rank; ``state_dict`` holds ``meta`` placeholders for them."""

    def sharded_state_dict(self) -> dict: ...

    def tensors_to_read(self, saved: dict) -> dict: ...


@dataclass(frozen=True)
class Restored:
    """What a run continues from: the checkpoint's file and the loop's counters in it."""

    path: Path
    samples_seen: int
    minibatches: int
    cv_index: int


class Checkpointing:
    """The checkpoints of one session: what goes in them, where, how many are kept, and what may be restored.

    Args:
        config: where and how often (``None``: no checkpoints, and none restored).
        run_dir: where a relative ``config.filename`` goes.
        model, learner, source, comm: what a checkpoint holds (the source's position, the learner's state).
        identity: what a checkpoint must match to be restored (``checkpoint_state.identity``).
        settings: the session's settings, stored so that a resumed run lists those that changed.
        fingerprint: a short hash of the config, stored.
        parts: the session's other stateful parts by their key in the checkpoint (``None`` where absent); a
            checkpoint without a part's key leaves that part as it is (an older checkpoint, another precision).
        advice: what to change after a divergence (called when the model to save holds NaN or infinity).
        stream: where the world-size change note goes (default: standard output).
    """

    def __init__(self, config: CheckpointConfig | None, run_dir: Path, *, model: torch.nn.Module, learner, source,
                 comm, identity: dict[str, Any], settings: dict[str, Any], fingerprint: str,
                 parts: Mapping[str, Stateful | None], advice: Callable[[], str], stream=None):
        self.config = config
        self.files: checkpoint.CheckpointFiles | None = None
        if config is not None:
            filename = Path(config.filename)
            self.files = checkpoint.CheckpointFiles(filename if filename.is_absolute() else Path(run_dir) / filename)
        self.model, self.learner, self.source, self.comm = model, learner, source, comm
        self.identity = identity
        self.settings = settings
        self.fingerprint = fingerprint
        self.parts = parts
        self.advice = advice
        self.stream = stream
        self.saved = False  # whether this run wrote a checkpoint (its run directory is then kept)
        self.note = ""  # which checkpoint the run starts from and why (or why none), for the start-up lines
        self.changed_settings: list[str] = []  # against the restored checkpoint

    def save(self, minibatches: int, cv_index: int, printer) -> Path:
        """Synchronises the learner and writes a checkpoint at the samples seen (a collective: every rank calls it,
        rank 0 writes); returns its path.

        Raises:
            TrainingDiverged: the model holds NaN or infinity (nothing is written; the last good checkpoint stays).
        """
        self.learner.synchronize()
        seen = self.learner.samples_seen
        sharded = self.learner.shards_model
        # every rank holds the same model now, so every rank reaches the same verdict (sharded: over every shard)
        if not self._finite(sharded):
            raise TrainingDiverged(
                f"training diverged: the model has NaN or infinite parameters at {seen} samples "
                f"(not saved; {checkpoint.kept_note(self.files.newest())}); {self.advice()}")
        parts = {name: part.state_dict() for name, part in self.parts.items() if part is not None}
        state = checkpoint_state.assemble(
            samples_seen=seen, minibatches=minibatches, cv_index=cv_index,
            model=self.model, learner=self.learner, source=self.source, comm=self.comm,
            expected_identity=self.identity, settings=self.settings, config_fingerprint=self.fingerprint,
            versions={"dtrain": _dtrain_version(), "torch": str(torch.__version__)},
            model_state=sharded_checkpoint.model_shapes(self.model) if sharded else None, **parts)
        path = self.files.path(seen)
        if sharded:  # every rank writes its shards into one directory, rank 0 the rest and the rename
            previous = self.files.newest() if self.comm.is_main else None
            tensors = {**self.learner.sharded_state_dict(),  # and the shards of the session's sharded parts
                       **{name: part.sharded_state_dict() for name, part in self.parts.items()
                          if isinstance(part, ShardedStateful)}}
            sharded_checkpoint.save(path, state, tensors, self.comm, previous)
            if self.comm.is_main:
                self.saved = True
                self.files.prune(0 if self.config.preserve_all else self.config.keep_last)
                printer.line(f"checkpoint saved at {seen} samples: {path} (sharded over {self.comm.size} ranks)")
            self.comm.barrier()
            return path
        if self.comm.is_main:
            self.saved = True
            checkpoint.save_atomic(state, path, previous=self.files.newest())
            self.files.prune(0 if self.config.preserve_all else self.config.keep_last)
            printer.line(f"checkpoint saved at {seen} samples: {path}")
        self.comm.barrier()
        return path

    def _finite(self, sharded: bool) -> bool:
        """Whether every parameter is finite (sharded: each rank looks at its shards, the verdict is agreed)."""
        if not sharded:
            return all(bool(torch.isfinite(parameter).all()) for parameter in self.model.parameters())
        local = all(bool(torch.isfinite(getattr(parameter, "_local_tensor", parameter)).all())
                    for parameter in self.model.parameters())
        flag = torch.tensor([0.0 if local else 1.0], device=self.comm.device)
        return not bool(self.comm.allreduce(flag, op="max").item())

    def restore(self, max_samples: int | None, lock_run_dir: Callable[[], None]) -> Restored | None:
        """Loads the newest good checkpoint when restore is on (``lock_run_dir()`` first, on rank 0), or refuses to
        overwrite one when it is off; ``None``: starting fresh. Settings that may change keep their configured
        values; ``changed_settings`` lists them against the checkpoint.

        Raises:
            CheckpointError: no checkpoint is readable, the newest belongs to another model or configuration, or it
                trained past ``max_samples``.
        """
        config = self.config
        start, same_world = checkpoint_state.restore_latest(
            self.files, config.restore if config else False, self.model, self.learner, self.source,
            self.comm, self.identity, prepare=lock_run_dir, restore_from=config.restore_from if config else None)
        self.note = start.note
        if start.state is None:
            return None
        path, state = start.path, start.state
        seen = self.learner.samples_seen
        # a model trained past max_samples would be reported as this run's, unless the checkpoint is the end of a
        # run to this same max_samples, which whole sequences overshoot: then there is nothing left to train
        if max_samples is not None and seen > max_samples and checkpoint_state.max_samples_of(state) != max_samples:
            raise checkpoint.CheckpointError(
                f"checkpoint {path} has trained on {seen:,} samples, past session.max_samples={max_samples}; "
                f"set session.max_samples to at least {seen:,} to continue it, or use a new run directory "
                f"(or session.checkpoint.restore_from= an earlier checkpoint)")
        if not same_world and self.comm.is_main:
            print(f"dtrain: restoring a checkpoint of {state['world_size']} workers on {self.comm.size}: the data "
                  f"position is re-partitioned, replicated state reused, per-rank state (random numbers, "
                  f"the exchange strategy's residuals and factors) reset", file=self.stream or sys.stdout, flush=True)
        self.changed_settings = checkpoint_state.changed_settings(state.get("settings"), self.settings)
        for name, part in self.parts.items():
            if part is not None and state.get(name) is not None:  # without it (an older checkpoint): a fresh part
                part.load_state_dict(self._with_sharded_tensors(name, part, state))
        return Restored(path, seen, int(state["minibatches"]), int(state["cv_index"]))

    @staticmethod
    def _with_sharded_tensors(name: str, part, state: dict[str, Any]) -> dict[str, Any]:
        """``state[name]``, with the tensors a sharded checkpoint keeps of that part in its files (``meta``
        placeholders in ``dtrain.pt``: the weight EMA of a sharded model) read into the part's own, whole or as
        this rank's shards (every rank: a collective)."""
        saved = state[name]
        placeholders = isinstance(saved, dict) and any(isinstance(value, torch.Tensor) and value.is_meta
                                                       for value in saved.values())
        if state.get("sharded") is None or not placeholders:
            return saved
        tensors = part.tensors_to_read(saved)
        sharded_checkpoint.load_tensors(state["sharded"]["directory"], {name: tensors})
        return {**saved, **tensors}


def _dtrain_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("dtrain")
    except PackageNotFoundError:
        return "unknown"
