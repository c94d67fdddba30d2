"""Checkpoint files: checksummed, written atomically, loaded without running code, kept in rotation.

A checkpoint file is one header line ``DTRAIN-CHECKPOINT <version> sha256=<hex> bytes=<n>``
followed by a ``torch.save`` payload of plain containers and tensors. The payload is verified
against the checksum and then read with ``torch.load(weights_only=True)``, so a damaged file is
caught before it is used and no file can execute code.

Files are numbered by the samples seen: ``checkpoint.pt`` in the config becomes
``checkpoint-<samples>.pt``. Restore takes the newest file that verifies, so a crash in the
middle of a write, or a file damaged later, falls back to the previous good checkpoint.
"""
from __future__ import annotations

import hashlib
import io
import os
import re
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

MAGIC = b"DTRAIN-CHECKPOINT"
FORMAT_VERSION = 2


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be read or does not belong to this run (one-line message)."""


@dataclass(frozen=True)
class CheckpointFiles:
    """The numbered files that belong to one configured checkpoint name.

    Args:
        base: the configured name, e.g. ``run/checkpoint.pt``; files are ``run/checkpoint-<samples>.pt``.
    """

    base: Path

    def path(self, samples_seen: int) -> Path:
        """The file of the checkpoint taken after ``samples_seen`` global samples."""
        return self.base.with_name(f"{self.base.stem}-{samples_seen}{self.base.suffix}")

    def existing(self) -> list[tuple[int, Path]]:
        """Every numbered checkpoint file, oldest first, as ``(samples_seen, path)``."""
        if not self.base.parent.is_dir():
            return []
        pattern = re.compile(re.escape(self.base.stem) + r"-(\d+)" + re.escape(self.base.suffix) + "$")
        found = [(int(m.group(1)), p) for p in self.base.parent.iterdir() if (m := pattern.match(p.name)) and p.is_file()]
        return sorted(found)

    def prune(self, keep_last: int) -> list[Path]:
        """Deletes all but the newest ``keep_last`` files (0 keeps every one); returns what was deleted."""
        if keep_last <= 0:
            return []
        doomed = [path for _, path in self.existing()[:-keep_last]]
        for path in doomed:
            path.unlink(missing_ok=True)
        return doomed


def save_atomic(state: dict[str, Any], path: Path) -> None:
    """Writes ``state`` to ``path`` so that a crash leaves either no new file or a complete one.

    The bytes go to a temporary file in the same directory, are flushed to disk (fsync), and the
    file is renamed to ``path``; the directory is fsynced so the rename itself is durable.
    """
    payload = io.BytesIO()
    torch.save(state, payload)
    data = payload.getvalue()
    header = b"%s %d sha256=%s bytes=%d\n" % (MAGIC, FORMAT_VERSION, hashlib.sha256(data).hexdigest().encode(), len(data))
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(handle, "wb") as stream:
            stream.write(header)
            stream.write(data)
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
    """Reads and verifies one checkpoint file without executing code from it.

    Raises:
        CheckpointError: unreadable, not a dtrain checkpoint, truncated, checksum mismatch, or newer format.
    """
    try:
        with open(path, "rb") as stream:
            header = stream.readline(512)
            data = stream.read()
    except OSError as error:
        raise CheckpointError(f"checkpoint {path} could not be read ({error.strerror or error})") from None
    fields = header.split()
    if len(fields) != 4 or fields[0] != MAGIC or not fields[2].startswith(b"sha256=") or not fields[3].startswith(b"bytes="):
        raise CheckpointError(f"checkpoint {path} could not be read (not a dtrain checkpoint: no valid header)")
    try:
        version, expected_size = int(fields[1]), int(fields[3][len(b"bytes="):])
    except ValueError:
        raise CheckpointError(f"checkpoint {path} could not be read (damaged header)") from None
    if version > FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {path} has format version {version}; this dtrain reads up to "
                              f"{FORMAT_VERSION}: upgrade dtrain")
    if len(data) != expected_size:
        raise CheckpointError(f"checkpoint {path} could not be read (truncated: {len(data)} of {expected_size} bytes)")
    if hashlib.sha256(data).hexdigest().encode() != fields[2][len(b"sha256="):]:
        raise CheckpointError(f"checkpoint {path} could not be read (checksum mismatch: the file is damaged)")
    try:
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as error:  # torch raises many types for content it refuses
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise CheckpointError(f"checkpoint {path} could not be read ({reason[:200]})") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint {path} could not be read (payload is not a dictionary)")
    return state


def load_latest_valid(files: CheckpointFiles) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint that verifies, falling back over damaged ones with a warning each.

    Returns ``None`` when there is no checkpoint at all.

    Raises:
        CheckpointError: checkpoints exist but none of them can be read (naming the newest one's problem).
    """
    candidates = list(reversed(files.existing()))
    if not candidates:
        return None
    errors = []
    for _, path in candidates:
        try:
            state = load(path)
        except CheckpointError as error:
            errors.append(error)
            continue
        for error in errors:
            warnings.warn(f"{error}; using the previous checkpoint {path.name}", RuntimeWarning, stacklevel=2)
        return path, state
    raise CheckpointError(f"{errors[0]}; no earlier checkpoint is readable either: move the damaged files "
                          f"away to start afresh, or pick another run_dir")


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


def describe_config_mismatch(saved: Any, current: Any, path: str = "") -> str | None:
    """The first key whose value differs between two plain config trees, as one line; ``None`` if equal."""
    if isinstance(saved, dict) and isinstance(current, dict):
        for key in sorted(set(saved) | set(current), key=str):
            where = f"{path}.{key}" if path else str(key)
            if key not in saved or key not in current:
                return f"{where} is {'missing from' if key not in saved else 'only in'} the checkpoint's config"
            difference = describe_config_mismatch(saved[key], current[key], where)
            if difference:
                return difference
        return None
    if saved != current:
        return f"{path} was {saved!r} in the checkpoint's run and is {current!r} now"
    return None
