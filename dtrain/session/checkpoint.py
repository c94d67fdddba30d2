"""Checkpoint files: checksummed, written atomically, loaded without running code, kept in rotation.

A checkpoint file is one header line
``DTRAIN-CHECKPOINT <version> sha256=<hex> bytes=<n> samples=<samples seen>`` followed by a
``torch.save`` payload of plain containers and tensors. The payload is verified against the
checksum and then read with ``torch.load(weights_only=True)``, so a damaged file is caught before
it is used and no file can execute code. ``load`` is public as ``dtrain.load_checkpoint``.

Files are numbered by the samples seen: ``checkpoint.pt`` in the config becomes
``checkpoint-<samples>.pt``. The number in the name is only a label: files are ordered, chosen
and pruned by the samples recorded inside (the header, checked against the payload), and a file
whose name and content disagree (a copy, a symlink, a rename) is skipped with a warning, never
restored and never counted when old checkpoints are pruned (``restore_from`` names such a file to
start a run from it). Restore takes the newest file that verifies, so a crash in the middle of a
write, or a file damaged later, falls back to the previous good checkpoint.
"""
from __future__ import annotations

import hashlib
import io
import os
import re
import shutil
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dtrain.safe_files import current_umask

MAGIC = b"DTRAIN-CHECKPOINT"
FORMAT_VERSION = 3  # 3: the header records the samples seen; 2 (no samples= field) is still read

_HEADER_LIMIT = 512  # bytes; a longer first line is not a dtrain header


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be read, written or does not belong to this run (one-line message)."""


@dataclass(frozen=True)
class Header:
    """The parsed first line of a checkpoint file."""

    version: int
    sha256: bytes            # hex digest of the payload
    payload_bytes: int
    samples_seen: int | None  # None in format 2 files
    size: int                # bytes of the header line itself


def _damaged(path: Path, why: str) -> CheckpointError:
    return CheckpointError(f"checkpoint {path} could not be read ({why})")


def _parse_header(line: bytes, path: Path) -> Header:
    fields = line.split()
    if len(fields) not in (4, 5) or fields[0] != MAGIC or not fields[2].startswith(b"sha256=") \
            or not fields[3].startswith(b"bytes=") or not line.endswith(b"\n"):
        raise _damaged(path, "not a dtrain checkpoint: no valid header")
    try:
        version = int(fields[1])
        size = int(fields[3][len(b"bytes="):])
        samples = None
        if len(fields) == 5:
            if not fields[4].startswith(b"samples="):
                raise ValueError
            samples = int(fields[4][len(b"samples="):])
    except ValueError:
        raise _damaged(path, "damaged header") from None
    if version > FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {path} has format version {version}; this dtrain reads up to "
                              f"{FORMAT_VERSION}: upgrade dtrain")
    if size < 0 or (samples is not None and samples < 0) or (version >= 3) != (samples is not None):
        raise _damaged(path, "damaged header")
    return Header(version, fields[2][len(b"sha256="):], size, samples, len(line))


def read_header(path: Path) -> Header:
    """The header of one checkpoint file (reads at most one short line); of a sharded checkpoint's directory, its
    ``dtrain.pt``'s.

    Raises:
        CheckpointError: unreadable, not a dtrain checkpoint, or a newer format.
    """
    if path.is_dir():
        path = path / _SHARDED_META
    try:
        with open(path, "rb") as stream:
            line = stream.readline(_HEADER_LIMIT)
    except OSError as error:
        raise _damaged(path, error.strerror or str(error)) from None
    return _parse_header(line, path)


def _number_in_name(base: Path, path: Path) -> int | None:
    pattern = re.escape(base.stem) + r"-(\d+)" + re.escape(base.suffix)
    match = re.fullmatch(pattern, path.name)
    return int(match.group(1)) if match else None


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
        """Every file named like a checkpoint, by the number in its name (oldest first), as ``(number, path)``.

        The number is only what the name says; ``by_content`` says what the files hold.
        """
        if not self.base.parent.is_dir():
            return []
        found = [(number, path) for path in self.base.parent.iterdir()
                 if (number := _number_in_name(self.base, path)) is not None and (path.is_file() or path.is_dir())]
        return sorted(found)

    def by_content(self, warn: bool = True) -> list[tuple[int, Path]]:
        """The checkpoint files whose header agrees with their name, oldest first by the samples inside.

        A file whose header records other samples than its name (a copy, a symlink or a rename of
        another checkpoint) is left out, with a warning when ``warn``. A file whose header cannot
        be read keeps its place by name, so that ``load_latest_valid`` can report or skip it.
        """
        agreed = []
        for number, path in self.existing():
            try:
                samples = read_header(path).samples_seen
            except CheckpointError:
                samples = None  # damaged: ordered by its name, verified (and skipped) when loaded
            if samples is not None and samples != number:
                if warn:
                    warnings.warn(f"checkpoint {path} holds the state at {samples} samples, not {number} as its name "
                                  f"says (a copy or link of another checkpoint?); skipped: move it away, or name it "
                                  f"in session.checkpoint.restore_from to start from it", RuntimeWarning, stacklevel=2)
                continue
            agreed.append((number, path))
        return agreed

    def newest(self) -> Path | None:
        """The newest checkpoint file by content (not verified beyond its header), ``None`` when there is none."""
        agreed = self.by_content(warn=False)
        return agreed[-1][1] if agreed else None

    def prune(self, keep_last: int) -> list[Path]:
        """Deletes all but the newest ``keep_last`` checkpoints by content (0 keeps every one).

        Files whose name and content disagree are neither counted nor deleted. Returns what was deleted.
        """
        if keep_last <= 0:
            return []
        doomed = [path for _, path in self.by_content(warn=False)[:-keep_last]]
        for path in doomed:
            _remove(path)
        return doomed

    def strays(self) -> list[Path]:
        """Files beside the checkpoints that hold a dtrain checkpoint under another name (``best.pt``,
        ``checkpoint.pt``): never restored by themselves, so the session names them in a warning."""
        if not self.base.parent.is_dir():
            return []
        numbered = {path for _, path in self.existing()}
        found = []
        for path in sorted(self.base.parent.iterdir()):
            if path in numbered or path.name.startswith(".") or not path.is_file():
                continue
            try:
                with open(path, "rb") as stream:
                    if stream.read(len(MAGIC) + 1) == MAGIC + b" ":
                        found.append(path)
            except OSError:
                continue
        return found

    def temporaries(self) -> list[Path]:
        """The temporary files that ``save_atomic`` leaves when it is killed before its rename."""
        if not self.base.parent.is_dir():
            return []
        pattern = re.compile(r"\." + re.escape(self.base.stem) + r"-\d+" + re.escape(self.base.suffix) + r"\..+\.tmp")
        return sorted(p for p in self.base.parent.iterdir() if pattern.fullmatch(p.name) and (p.is_file() or p.is_dir()))

    def remove_temporaries(self) -> list[Path]:
        """Deletes the temporaries of writes that were killed; call only while no write of this run is running."""
        removed = self.temporaries()
        for path in removed:
            _remove(path)
        return removed


def _remove(path: Path) -> None:
    """A checkpoint file, or a sharded checkpoint's directory, deleted."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def kept_note(previous: Path | None) -> str:
    """What a failed or refused checkpoint write leaves to fall back on, for its one-line message."""
    return f"the previous checkpoint {previous} is kept" if previous is not None \
        else "there is no earlier checkpoint to fall back on"


#: ``save_atomic``'s default ``previous``: the caller did not say which checkpoint came before
_UNKNOWN = object()


def save_atomic(state: dict[str, Any], path: Path, previous: Path | None | object = _UNKNOWN) -> None:
    """Writes ``state`` to ``path`` so that a crash leaves either no new file or a complete one.

    The bytes go to a temporary file in the same directory, are flushed to disk (fsync), and the
    file is renamed to ``path``; the directory is fsynced so the rename itself is durable. The file
    gets the permissions of any other new file (``0666`` less the umask), so a team can share a run
    directory. ``state["samples_seen"]`` (when present) is recorded in the header. ``previous``
    (the checkpoint before this one, or ``None``) lets a failure say what is left to fall back on.

    Raises:
        CheckpointError: the file could not be written (e.g. the disk is full); the temporary
            file is removed and any earlier checkpoint is left as it was.
    """
    payload = io.BytesIO()
    torch.save(state, payload)
    data = payload.getvalue()
    samples = int(state.get("samples_seen", 0))
    header = b"%s %d sha256=%s bytes=%d samples=%d\n" % (
        MAGIC, FORMAT_VERSION, hashlib.sha256(data).hexdigest().encode(), len(data), samples)
    temporary = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        os.fchmod(handle, 0o666 & ~current_umask())
        with os.fdopen(handle, "wb") as stream:
            stream.write(header)
            stream.write(data)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temporary, path)
        temporary = None
        directory = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)
    except OSError as error:
        kept = "; " + kept_note(previous) if previous is not _UNKNOWN else ""
        raise CheckpointError(f"checkpoint {path} could not be written ({error.strerror or error}){kept}") from None
    finally:
        if temporary is not None:
            Path(temporary).unlink(missing_ok=True)


_GLOBAL_NAME = re.compile(r"GLOBAL ([A-Za-z_][\w.]*)")


def load(path: str | Path) -> dict[str, Any]:
    """Reads and verifies one checkpoint file without executing code from it.

    The file's size is compared with the header's byte count before anything else is read, and
    exactly the declared bytes are read, so a huge or junk file costs no more memory than a real
    checkpoint of the declared size.

    Raises:
        CheckpointError: unreadable, not a dtrain checkpoint, truncated or longer than declared,
            checksum mismatch, newer format, or a payload that holds objects other than tensors
            and plain containers (refused as unsafe).
    """
    path = Path(path)
    if path.is_dir():
        return _load_sharded(path)
    try:
        with open(path, "rb") as stream:
            header = _parse_header(stream.readline(_HEADER_LIMIT), path)
            available = os.fstat(stream.fileno()).st_size - header.size
            if available < header.payload_bytes:
                raise _damaged(path, f"truncated: {available} of {header.payload_bytes} bytes")
            if available > header.payload_bytes:
                raise _damaged(path, f"damaged: {available} bytes after the header, which declares "
                                     f"{header.payload_bytes}")
            data = stream.read(header.payload_bytes)
    except OSError as error:
        raise _damaged(path, error.strerror or str(error)) from None
    if len(data) != header.payload_bytes:  # the file shrank while it was read
        raise _damaged(path, f"truncated: {len(data)} of {header.payload_bytes} bytes")
    if hashlib.sha256(data).hexdigest().encode() != header.sha256:
        raise _damaged(path, "checksum mismatch: the file is damaged")
    try:
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as error:  # torch raises many types for content it refuses
        text = str(error)
        if "Weights only load failed" in text or "Unsupported global" in text:
            found = _GLOBAL_NAME.search(text)
            what = f" (such as {found.group(1)})" if found else ""
            raise CheckpointError(f"checkpoint {path} holds objects other than tensors and plain containers{what} "
                                  f"and was refused as unsafe: loading it could run code; dtrain only writes "
                                  f"tensors and plain values, so this file was not written by dtrain") from None
        reason = text.strip().splitlines()[0] if text.strip() else type(error).__name__
        raise _damaged(path, re.sub(r"\x1b\[[0-9;]*m", "", reason)[:200]) from None
    if not isinstance(state, dict):
        raise _damaged(path, "payload is not a dictionary")
    if header.samples_seen is not None and state.get("samples_seen") != header.samples_seen:
        raise _damaged(path, f"the header records {header.samples_seen} samples, the content "
                             f"{state.get('samples_seen')!r}")
    return state


#: a sharded checkpoint's file of everything but the tensors (``dtrain.session.shard_manifest.META``)
_SHARDED_META = "dtrain.pt"


def _load_sharded(directory: Path) -> dict[str, Any]:
    """A sharded checkpoint's ``dtrain.pt``, read and verified as one file is, after every DCP file it lists is
    checked against its byte count and checksum; ``state["sharded"]["directory"]`` says where the tensors are."""
    from dtrain.session.shard_manifest import verify

    if not (directory / _SHARDED_META).is_file():
        raise _damaged(directory, f"a sharded checkpoint without its {_SHARDED_META}: not completely written")
    state = load(directory / _SHARDED_META)
    sharded = state.get("sharded")
    if not isinstance(sharded, dict) or not isinstance(sharded.get("files"), dict):
        raise _damaged(directory, f"its {_SHARDED_META} lists no sharded files")
    problem = verify(directory, sharded["files"])
    if problem is not None:
        raise _damaged(directory, problem)
    sharded["directory"] = str(directory.resolve())
    return state


def load_latest_valid(files: CheckpointFiles) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint that verifies, by the samples recorded inside, falling back over
    damaged ones with a warning each; a file whose name and content disagree is skipped.

    Returns ``None`` when there is no checkpoint at all.

    Raises:
        CheckpointError: checkpoints exist but none of them can be read (naming the newest one's problem).
    """
    candidates = list(reversed(files.by_content()))
    if not candidates:
        return None
    errors = []
    for number, path in candidates:
        try:
            state = load(path)
        except CheckpointError as error:
            errors.append(error)
            continue
        if state.get("samples_seen") != number:  # a format 2 file has no samples in its header
            warnings.warn(f"checkpoint {path} holds the state at {state.get('samples_seen')} samples, not {number} "
                          f"as its name says (a copy or link of another checkpoint?); skipped: move it away",
                          RuntimeWarning, stacklevel=2)
            continue
        for error in errors:
            warnings.warn(f"{error}; using the previous checkpoint {path.name}", RuntimeWarning, stacklevel=2)
        return path, state
    if not errors:
        return None
    raise CheckpointError(f"{errors[0]}; no earlier checkpoint is readable either: move the damaged files "
                          f"away to start afresh, or pick another run_dir")
