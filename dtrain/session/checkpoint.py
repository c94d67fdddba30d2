"""Checkpoint files: atomic writes, safe loads (no code runs from the file), finding the latest.

A checkpoint is one ``torch.save`` file of plain containers and tensors, loaded back with
``torch.load(weights_only=True)`` so a file can never execute code.
"""
from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path
from typing import Any

import torch

FORMAT = "dtrain-checkpoint"
FORMAT_VERSION = 1


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be read or does not belong to this run (one-line message)."""


def checkpoint_path(base: Path, samples_seen: int, preserve_all: bool) -> Path:
    """The file a checkpoint at ``samples_seen`` goes to: ``base``, or ``base.<samples>`` to keep all."""
    return base.with_name(f"{base.name}.{samples_seen}") if preserve_all else base


def find_latest(base: Path) -> Path | None:
    """The checkpoint to restore: ``base`` itself if present, else ``base.<N>`` with the largest N."""
    if base.is_file():
        return base
    if not base.parent.is_dir():
        return None
    pattern = re.compile(re.escape(base.name) + r"\.(\d+)$")
    numbered = [(int(m.group(1)), p) for p in base.parent.iterdir() if (m := pattern.match(p.name)) and p.is_file()]
    return max(numbered)[1] if numbered else None


def save_atomic(state: dict[str, Any], path: Path) -> None:
    """Writes ``state`` to ``path`` so that a crash leaves either the old file or the new one.

    The data goes to a temporary file in the same directory, is flushed to disk (fsync), and
    is renamed over ``path``; the directory entry is fsynced too.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {"format": FORMAT, "format_version": FORMAT_VERSION, **state}
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(handle, "wb") as stream:
            torch.save(state, stream)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def load(path: Path) -> dict[str, Any]:
    """Reads a checkpoint without executing code from it.

    Raises:
        CheckpointError: the file is unreadable, truncated, not a dtrain checkpoint, or of a newer format.
    """
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # torch raises many types for damaged files
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise CheckpointError(
            f"checkpoint {path} could not be read ({reason[:200]}); delete or move it, "
            f"or set session.checkpoint.restore=false with a new run directory"
        ) from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a dtrain checkpoint (no '{FORMAT}' header)")
    if state.get("format_version", 0) > FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint {path} has format version {state['format_version']}, this dtrain reads up to "
            f"{FORMAT_VERSION}; upgrade dtrain"
        )
    return state


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
