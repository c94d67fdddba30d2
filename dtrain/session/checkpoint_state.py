"""What a checkpoint holds and when it may be restored (the file format is ``checkpoint.py``).

A checkpoint is a dictionary with these entries (all plain containers and tensors):

- ``samples_seen``, ``minibatches``, ``cv_index``: the loop's counters (global samples);
- ``model``: ``model.state_dict()``;
- ``learner``: the learner's replicated state (``kind``, ``optimizer`` state dict, ``samples_seen``,
  and e.g. block momentum's global model);
- ``source``: the training source's position (``MinibatchSource.get_checkpoint_state()``);
- ``per_rank``: one entry per rank, ``{"rng": torch RNG state, "learner": per-rank learner state}``;
- ``world_size``, ``learner_kind``;
- ``identity``: the settings a checkpoint must match to be restored (model, data, learner,
  optimizer type, and what the caller adds, e.g. the seed);
- ``settings``: the settings that may change on resume, as the run that wrote it used them;
- ``config_fingerprint``, ``versions`` (dtrain and torch);
- ``loss_scaler``: fp16's ``torch.amp.GradScaler`` state dict (only when training in fp16).
- ``weight_ema``: the weight average's ``AveragedModel`` state dict and ``steps_since_update`` (only with
  ``session.ema_decay``).

A checkpoint of the retired quantized learner (``learner_kind`` ``quantized``) is read as the data-parallel
learner's with the k-bit exchange, which it was (:func:`from_the_quantized_learner`).

Restoring refuses a checkpoint whose identity differs (naming the first difference) and
re-applies the configured optimizer hyper-parameters after loading the optimizer state, so a
changed learning rate, momentum or weight decay takes effect while state such as momentum
buffers is kept.
"""
from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dtrain.data.user_source import UserMinibatchSource
from dtrain.session.configs import action_frequency
from dtrain.session.checkpoint import CheckpointError, CheckpointFiles, load, load_latest_valid

#: entries a checkpoint must have to be restored
REQUIRED_KEYS = ("model", "learner", "learner_kind", "source", "per_rank", "world_size", "samples_seen", "minibatches",
                 "cv_index")


def _qualified_name(value: Any) -> str:
    kind = type(value)
    return f"{kind.__module__}.{kind.__qualname__}"


def learner_identity(learner) -> dict[str, Any]:
    """What a learner's checkpoint must match: ``learner.checkpoint_identity()`` (its kind, and what the learner
    adds), plus the optimizer's type (optimizer state only fits the same optimizer)."""
    return {**learner.checkpoint_identity(), "optimizer": _qualified_name(learner.optimizer)}


def source_identity(source: UserMinibatchSource) -> dict[str, Any]:
    """What a training source's checkpoint must match: what the source declares
    (:meth:`~dtrain.data.UserMinibatchSource.checkpoint_identity`: by default its deserializer's type and
    sizes), else its type."""
    own = source.checkpoint_identity()
    return own if own is not None else {"source": _qualified_name(source)}


def _model_type(model: torch.nn.Module) -> str:
    """The model's class, as written; a model sharded by FSDP2 (its class ``FSDP<Name>``, made on the fly) by the
    class it was made from, so sharded and replicated runs of one model restore each other's checkpoints."""
    kind = type(model)
    if kind.__module__.startswith("torch.distributed.fsdp"):
        kind = kind.__bases__[-1]
    return f"{kind.__module__}.{kind.__qualname__}"


def identity(model: torch.nn.Module, learner, source, extra: dict | None) -> dict[str, Any]:
    """The settings a checkpoint must match: model type, learner, optimizer type, training data,
    and ``extra`` (the caller's own, e.g. the model's config and the seed)."""
    return {"model_type": _model_type(model), "learner": learner_identity(learner),
            "train_data": source_identity(source), **(extra or {})}


def optimizer_hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each parameter group's settings (lr, momentum, weight decay, ...) without its parameters."""
    return [{key: value for key, value in group.items() if key != "params"} for group in optimizer.param_groups]


def session_settings(*, minibatch_size, max_samples: int | None, progress_frequency: int | None, checkpoint_config,
                     cv_config, lr_schedule, momentum_time_constant_schedule, optimizer: torch.optim.Optimizer,
                     micro_batch_size: int | None, clip_grad_norm: float | None, precision: str, compile: bool,  # noqa: A002
                     sync_batchnorm: bool, batchnorm_statistics: str, batchnorm_recompute_samples: int, lr_scaling,
                     ema_decay: float | None) -> dict[str, Any]:
    """The session's settings as a checkpoint stores them, plain values and reprs: what a resumed run may change,
    and lists when it did (:func:`changed_settings`)."""
    return {
        "minibatch_size": minibatch_size if isinstance(minibatch_size, int) else repr(minibatch_size),
        "max_samples": max_samples, "progress_frequency": progress_frequency,
        "checkpoint_frequency": action_frequency("CheckpointConfig.frequency", checkpoint_config.frequency)
        if checkpoint_config else None,
        "cv_frequency": cv_config.frequency if cv_config else None,
        "lr_schedule": repr(lr_schedule) if lr_schedule else None,
        "momentum_time_constant_schedule": repr(momentum_time_constant_schedule)
        if momentum_time_constant_schedule else None,
        "optimizer": optimizer_hyperparameters(optimizer),
        "micro_batch_size": micro_batch_size, "clip_grad_norm": clip_grad_norm, "precision": precision,
        "compile": compile, "sync_batchnorm": sync_batchnorm, "batchnorm_statistics": batchnorm_statistics,
        "batchnorm_recompute_samples": batchnorm_recompute_samples,
        "lr_scaling": repr(lr_scaling) if lr_scaling else None, "ema_decay": ema_decay,
    }


def reapply_hyperparameters(optimizer: torch.optim.Optimizer, configured: list[dict[str, Any]]) -> None:
    """Puts the configured hyper-parameters back after ``optimizer.load_state_dict`` (which
    restores the checkpoint's); per-parameter state such as momentum buffers is kept."""
    for group, settings in zip(optimizer.param_groups, configured):
        group.update(settings)


#: an identity entry holding the schemas' defaults, not compared itself: a key the checkpoint's config
#: lacks matches when the current value is its default (a setting added after the checkpoint was written)
DEFAULTS_KEY = "_schema_defaults"  # underscored, apart from the plain settings a caller passes as checkpoint_identity


def check_restorable(path, state: dict[str, Any], model: torch.nn.Module, learner,
                     expected_identity: dict[str, Any]) -> None:
    """Refuses a checkpoint that lacks an entry or belongs to another model, learner or configuration.

    Raises:
        CheckpointError: one line naming the file and the first problem.
    """
    for key in REQUIRED_KEYS:
        if key not in state:
            raise CheckpointError(f"checkpoint {path} lacks '{key}': it was not written by this dtrain")
    state = interchanged(state, learner)
    mismatch = describe_model_mismatch(model, state["model"])
    if mismatch:
        raise CheckpointError(f"checkpoint {path} does not fit this model: {mismatch}")
    if state["learner_kind"] != learner.kind:
        raise CheckpointError(
            f"checkpoint {path} was written by the {state['learner_kind']!r} learner, this run uses "
            f"{learner.kind!r}; restore with the same learner or use a new run directory")
    saved = state.get("identity", {})
    if (saved.get("learner") or {}).get("shard") and not (expected_identity.get("learner") or {}).get("shard"):
        raise CheckpointError(f"checkpoint {path} holds hosts sharded over their ranks (learner.shard=true), which "
                              f"this unsharded learner cannot read; restore it with learner.shard=true (any ranks per "
                              f"host), or use a new run directory")
    if "model_type" not in saved:  # written before the learner and source supplied their identity
        expected_identity = {key: value for key, value in expected_identity.items()
                             if key not in ("model_type", "learner", "train_data")}
        saved = {key: value for key, value in saved.items() if key not in ("learner", "optimizer", "train_data")}
    defaults = expected_identity.get(DEFAULTS_KEY, {})
    difference = describe_config_mismatch({key: value for key, value in saved.items() if key != DEFAULTS_KEY},
                                          {key: value for key, value in expected_identity.items() if key != DEFAULTS_KEY},
                                          defaults=defaults)
    if difference:
        shards = _changed_shards(saved.get("train_data"), expected_identity.get("train_data"))
        if shards:
            raise CheckpointError(f"checkpoint {path} was written for other training shards: {shards}; restore onto "
                                  f"the shards it read (the same files, rows and names), or start a new run directory "
                                  f"(run_dir=...) to train on these")
        raise CheckpointError(f"checkpoint {path} belongs to another configuration: {difference}; "
                              f"restore with the same settings or use a new run directory")


def interchanged(state: dict[str, Any], learner) -> dict[str, Any]:
    """``state`` as ``learner`` reads it where the two learners' checkpoints hold the same thing (one model and the
    optimizer state of the global minibatch's update: ``fsdp``, ``data_parallel`` with the float32 all-reduce,
    ``local``; ``dtrain.learners.fsdp.INTERCHANGEABLE_KINDS``): its learner kind becomes ``learner``'s, so a
    sharded checkpoint is restored by a replicated learner and the other way round. Any other is returned as is."""
    from dtrain.learners.fsdp import INTERCHANGEABLE_KINDS

    kind = state.get("learner_kind")
    if kind == learner.kind:
        return _unsharded_into_shards(state, learner)
    if kind not in INTERCHANGEABLE_KINDS or learner.kind not in INTERCHANGEABLE_KINDS:
        return state
    identity = dict(state.get("identity") or {})
    saved_learner = identity.get("learner")
    if isinstance(saved_learner, dict):
        if set(saved_learner) - {"kind", "optimizer"}:  # e.g. data_parallel with a compressing exchange: its state
            return state
        identity["learner"] = {**saved_learner, "kind": learner.kind}
    return {**state, "learner_kind": learner.kind, "identity": identity,
            "learner": {**state["learner"], "kind": learner.kind}}


def _unsharded_into_shards(state: dict[str, Any], learner) -> dict[str, Any]:
    """``state`` as a two-level learner with sharded hosts (``learner.shard=true``) reads an unsharded checkpoint of
    its kind: the identity's ``shard`` (present only when true) becomes this learner's, as the learner cuts the
    whole state into its slices (``TwoLevel.load_state_dict``). Any other is returned as is."""
    saved_learner = (state.get("identity") or {}).get("learner")
    if state.get("sharded") is not None or not isinstance(saved_learner, dict) or saved_learner.get("shard") \
            or not learner.checkpoint_identity().get("shard"):
        return state
    return {**state, "identity": {**state["identity"], "learner": {**saved_learner, "shard": True}}}


def _changed_shards(saved: Any, current: Any) -> str:
    """The shards whose rows differ between two identities of sharded data (``ParquetShards``, ``TarShards``), as
    ``part-1.parquet: 48 rows then, 47 now; part-9.parquet: missing now``; "" when the shards did not change."""
    saved = saved.get("shards") if isinstance(saved, dict) else None
    current = current.get("shards") if isinstance(current, dict) else None
    if not isinstance(saved, dict) or not isinstance(current, dict) or saved == current:
        return ""
    changes = []
    for name in sorted(set(saved) | set(current)):
        if name not in current:
            changes.append(f"{name}: {saved[name]:,} rows then, missing now")
        elif name not in saved:
            changes.append(f"{name}: new, {current[name]:,} rows")
        elif saved[name] != current[name]:
            changes.append(f"{name}: {saved[name]:,} rows then, {current[name]:,} now")
    shown = "; ".join(changes[:5]) + (f"; and {len(changes) - 5} more" if len(changes) > 5 else "")
    return f"{len(changes)} shard{'s' if len(changes) != 1 else ''} changed ({shown})"


def describe_model_mismatch(model: torch.nn.Module, saved: dict[str, torch.Tensor]) -> str | None:
    """One line naming how a saved model state differs from ``model``; ``None`` when they match."""
    current = model.state_dict()
    missing = sorted(set(current) - set(saved))
    unexpected = sorted(set(saved) - set(current))
    if missing or unexpected:
        return f"parameters missing from checkpoint {missing[:3]}, unexpected in checkpoint {unexpected[:3]}"
    for name, tensor in current.items():
        if tuple(saved[name].shape) != tuple(tensor.shape):
            return f"parameter {name} has shape {tuple(saved[name].shape)} in the checkpoint, {tuple(tensor.shape)} in the model"
    return None


def describe_config_mismatch(saved: Any, current: Any, path: str = "", defaults: Any = None) -> str | None:
    """The first key whose value differs between two plain config trees, as one line; ``None`` if equal.
    A key only one side has matches when its value there is its default in ``defaults`` (the same tree
    shape): the setting did not exist when the other side was written, and its default is what ran."""
    if isinstance(saved, dict) and isinstance(current, dict):
        defaults = defaults if isinstance(defaults, dict) else {}
        for key in sorted(set(saved) | set(current), key=str):
            where = f"{path}.{key}" if path else str(key)
            if key not in saved or key not in current:
                present = current[key] if key in current else saved[key]
                if key in defaults and not isinstance(present, dict) and present == defaults[key]:
                    continue
                return f"{where} is {'missing from' if key not in saved else 'only in'} the checkpoint's config"
            difference = describe_config_mismatch(saved[key], current[key], where, defaults.get(key))
            if difference:
                return difference
        return None
    if saved != current:
        return f"{path} was {saved!r} in the checkpoint's run and is {current!r} now"
    return None


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        flat: dict[str, Any] = {}
        for key, value in tree.items():
            flat.update(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
        return flat
    if isinstance(tree, (list, tuple)) and tree and all(isinstance(item, dict) for item in tree):
        flat = {}
        for index, value in enumerate(tree):
            flat.update(_flatten(value, f"{prefix}[{index}]"))
        return flat
    return {prefix: tree}


def changed_settings(saved: dict[str, Any] | None, current: dict[str, Any]) -> list[str]:
    """``key: old -> new`` for every setting that differs from the checkpoint's run (sorted by key).

    Only trees of the same kind are compared: a run described by a config (the command line)
    against the config stored in the checkpoint, else the session's own settings.
    """
    if not saved:
        return []
    which = "config" if "config" in saved and "config" in current else "session"
    old, new = _flatten(saved.get(which, {})), _flatten(current.get(which, {}))
    changes = []
    for key in sorted(set(old) | set(new)):
        before, after = old.get(key, "(unset)"), new.get(key, "(unset)")
        if before != after:
            changes.append(f"{key}: {before!r} -> {after!r}")
    return changes


def max_samples_of(state: dict[str, Any]) -> int | None:
    """The ``max_samples`` the run that wrote ``state`` trained to (``None``: until its data ended, or not recorded).

    A checkpoint past it is that run's end: its last minibatch of whole sequences overshot it."""
    session = (state.get("settings") or {}).get("session") or {}
    return session.get("max_samples") if isinstance(session, dict) else None


def assemble(*, samples_seen: int, minibatches: int, cv_index: int, model: torch.nn.Module, learner, source, comm,
             expected_identity: dict[str, Any], settings: dict[str, Any], config_fingerprint: str,
             versions: dict[str, str], loss_scaler: dict[str, Any] | None = None,
             weight_ema: dict[str, Any] | None = None, callbacks: dict[str, Any] | None = None,
             model_state: dict[str, Any] | None = None) -> dict[str, Any]:
    """Everything a bit-exact resume needs, in the layout above; per-rank parts are gathered (a
    collective: every rank calls it, rank 0 gets the whole dictionary). ``model_state`` replaces
    ``model.state_dict()`` (a sharded checkpoint: the shapes alone, its tensors are written apart)."""
    per_rank = comm.gather_object({"rng": torch.get_rng_state(), "learner": learner.local_state_dict()})
    state = {
        "samples_seen": samples_seen,
        "minibatches": minibatches,
        "cv_index": cv_index,
        "model": model.state_dict() if model_state is None else model_state,
        "learner": learner.state_dict(),
        "source": source.get_checkpoint_state(),
        "per_rank": per_rank,
        "world_size": comm.size,
        "learner_kind": learner.kind,
        "identity": expected_identity,
        "settings": settings,
        "config_fingerprint": config_fingerprint,
        "versions": versions,
    }
    if loss_scaler is not None:
        state["loss_scaler"] = loss_scaler
    if weight_ema is not None:
        state["weight_ema"] = weight_ema
    if callbacks:
        state["callbacks"] = callbacks  # rank 0's (the rank that saves), plain values: loaded with weights_only
    return state


@dataclass(frozen=True)
class StartingPoint:
    """What a run starts from: the checkpoint read (``path``, ``state``; both ``None`` when starting
    fresh) and ``note``, the start-up line's words for why this file or why none."""

    path: Path | None
    state: dict[str, Any] | None
    note: str


def from_the_quantized_learner(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` as today's learners read it: a checkpoint of the retired quantized learner (kind
    ``quantized``, its bits beside the optimizer's state) is the data-parallel learner's with the k-bit
    exchange, which that learner was (same optimizer state, same residuals); any other is returned as is."""
    if state.get("learner_kind") != "quantized" or not isinstance(state.get("learner"), dict):
        return state
    learner = {**state["learner"], "kind": "data_parallel"}
    bits = learner.pop("num_quantization_bits", None)
    identity = dict(state.get("identity") or {})
    if isinstance(identity.get("learner"), dict):
        saved = {key: value for key, value in identity["learner"].items() if key != "num_quantization_bits"}
        bits = identity["learner"].get("num_quantization_bits", bits)
        identity["learner"] = {**saved, "kind": "data_parallel", "exchange": {"name": "quantized", "num_bits": bits}}
    return {**state, "learner_kind": "data_parallel", "learner": learner, "identity": identity}


def read_newest(files: CheckpointFiles, restore: bool, model: torch.nn.Module, learner,
                expected_identity: dict[str, Any], restore_from: str | Path | None = None) -> StartingPoint:
    """Rank 0: the checkpoint this run starts from, checked against this run.

    The run directory's newest readable checkpoint continues the run; with none there,
    ``restore_from`` (any dtrain checkpoint file, whatever its name) starts it. So the same command
    continues a run begun from ``restore_from`` after a preemption. Files in the directory that hold
    a dtrain checkpoint under another name are named in a warning (they are never restored).

    Raises:
        CheckpointError: restore is off but a checkpoint exists (it would be overwritten), no
            checkpoint is readable, or the chosen one belongs to another model, learner or configuration.
    """
    if not restore:
        existing = files.existing()
        if existing:
            raise CheckpointError(
                f"checkpoint {existing[-1][1]} already exists and restore is off; set session.checkpoint.restore=true "
                f"to continue it, or use a new run directory so it is not overwritten")
        return StartingPoint(None, None, "starting fresh: session.checkpoint.restore is off")
    chosen = Path(restore_from) if restore_from is not None else None
    for path in files.strays():
        if chosen is None or not _same_file(path, chosen):
            warnings.warn(f"{path} holds a dtrain checkpoint but is not named {files.base.stem}-<samples>"
                          f"{files.base.suffix}, so it is not restored; to start from it, name it in "
                          f"session.checkpoint.restore_from", RuntimeWarning, stacklevel=2)
    found = load_latest_valid(files)
    if found is not None:
        path, state = found[0], from_the_quantized_learner(found[1])
        check_restorable(path, state, model, learner, expected_identity)
        note = ""
        if chosen is not None and not _same_file(path, chosen):
            note = (f"session.checkpoint.restore_from={chosen} not used: {files.base.parent} has checkpoints of its own, "
                    f"which continue the run; to start from {chosen.name}, use a new run_dir")
        return StartingPoint(path, state, note)
    if chosen is not None:
        state = from_the_quantized_learner(load(chosen))
        check_restorable(chosen, state, model, learner, expected_identity)
        return StartingPoint(chosen, state, f"session.checkpoint.restore_from: {files.base.parent} has no checkpoint "
                                            f"of its own yet")
    return StartingPoint(None, None, f"starting fresh: no checkpoint in {files.base.parent}")


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def apply(state: dict[str, Any], model: torch.nn.Module, learner, source, comm) -> bool:
    """Loads a checked checkpoint into the model, learner and source on this rank.

    The optimizer's configured hyper-parameters (learning rate, momentum, weight decay, ...) are
    put back after its state is loaded, so settings changed since the checkpoint take effect.
    Per-rank state (random numbers, e.g. quantization residuals) is restored only at the same world
    size. Returns whether it was (``False``: re-partitioned onto another number of ranks).
    """
    configured = optimizer_hyperparameters(learner.optimizer)
    state = interchanged(state, learner)
    if state.get("sharded") is not None:
        _load_sharded(state, model, learner, state["per_rank"][comm.rank]["learner"]
                      if state["world_size"] == comm.size else None)
    elif getattr(learner, "shards_model", False):  # a replicated checkpoint into a sharded model
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(model, state["model"], options=StateDictOptions(full_state_dict=True))
        learner.load_state_dict(state["learner"])
    else:
        model.load_state_dict(state["model"])
        learner.load_state_dict(state["learner"])
    reapply_hyperparameters(learner.optimizer, configured)
    source.restore_from_checkpoint(state["source"])
    if state["world_size"] != comm.size:
        return False
    own = state["per_rank"][comm.rank]
    torch.set_rng_state(own["rng"])
    learner.load_local_state_dict(own["learner"])
    return True


def _load_sharded(state: dict[str, Any], model: torch.nn.Module, learner, local_state: dict[str, Any] | None) -> None:
    """A sharded checkpoint's tensors into ``model`` and ``learner`` (every rank reads what it needs with DCP, at
    any world size): into the shards of a sharded learner, or whole into a replicated one, whose optimizer state
    then goes through its own ``load_state_dict`` as a replicated checkpoint's would."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from dtrain.session.sharded_checkpoint import load_tensors

    directory = state["sharded"]["directory"]
    if getattr(learner, "shards_model", False):
        learner.load_state_dict(state["learner"])  # first: what the learner's shards are to be read into may depend on it
        tensors = learner.sharded_state_dict(local_state=local_state)  # this rank's per-rank tensors too, if any
        load_tensors(directory, tensors)
        learner.load_sharded_state_dict(tensors)
        return
    model_state, optimizer_state = get_state_dict(model, learner.optimizer)  # the optimizer's state allocated
    tensors = {"model": model_state, "optimizer": optimizer_state}
    load_tensors(directory, tensors)
    set_state_dict(model, learner.optimizer, model_state_dict=tensors["model"], optim_state_dict=tensors["optimizer"])
    learner.load_state_dict({**state["learner"], "optimizer": learner.optimizer.state_dict()})


def restore_latest(files: CheckpointFiles | None, restore: bool, model: torch.nn.Module, learner, source, comm,
                   expected_identity: dict[str, Any], prepare: Callable[[], None] | None = None,
                   restore_from: str | Path | None = None) -> tuple[StartingPoint, bool]:
    """Rank 0 calls ``prepare()`` (e.g. to lock the run directory) and chooses and reads the checkpoint
    (``read_newest``); every rank receives it and applies it (no shared file system needed, and one
    error for all).

    Returns ``(starting_point, same_world_size)``; ``starting_point.path`` is ``None`` when starting fresh.

    Raises:
        CheckpointError: on every rank, with rank 0's one-line message.
    """
    outcome: StartingPoint | str = StartingPoint(None, None, "starting fresh: checkpoints are off")
    if comm.is_main:
        try:
            if prepare is not None:
                prepare()
            if files is not None:
                files.remove_temporaries()  # of writes killed before their rename; the run is locked now
                outcome = read_newest(files, restore, model, learner, expected_identity, restore_from)
        except CheckpointError as error:
            outcome = str(error)
    outcome = comm.broadcast_object(outcome, root=0)
    if isinstance(outcome, str):
        raise CheckpointError(outcome)
    if outcome.state is None:
        return outcome, True
    try:
        return outcome, apply(outcome.state, model, learner, source, comm)
    except (ValueError, TypeError) as error:  # the same on every rank: they all apply the same state
        # e.g. the data counted differently (another target, defining stream or length bucketing)
        raise CheckpointError(f"checkpoint {outcome.path} does not fit this run's training data: "
                              f"{str(error).splitlines()[0]}; keep the data settings the checkpoint was written "
                              f"with, or use a new run directory") from error
