"""The manifest of a sharded checkpoint's files (``dtrain.session.sharded_checkpoint``): each DCP file's byte count
and SHA-256, and their check when the checkpoint is read (``dtrain.session.checkpoint``, which reads and verifies
checkpoints of both formats without importing the writer)."""
from __future__ import annotations

import hashlib
from pathlib import Path

#: the file of a sharded checkpoint's directory that holds everything but the tensors (the one-file format)
META = "dtrain.pt"


def file_digest(path: Path) -> tuple[int, str]:
    """``(bytes, sha256 hex)`` of one file, read in 1 MiB pieces."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as stream:
        while piece := stream.read(1 << 20):
            digest.update(piece)
            size += len(piece)
    return size, digest.hexdigest()


def manifest(directory: Path) -> dict[str, list]:
    """``{name: [bytes, sha256]}`` of every file DCP wrote into ``directory``."""
    return {path.name: list(file_digest(path)) for path in sorted(directory.iterdir())
            if path.is_file() and path.name != META}


def verify(directory: Path, files: dict[str, list]) -> str | None:
    """What is wrong with the DCP files of a sharded checkpoint against its manifest; None when all verify."""
    for name, (size, digest) in sorted(files.items()):
        path = directory / name
        if not path.is_file():
            return f"{name} is missing"
        actual_size, actual_digest = file_digest(path)
        if actual_size != size:
            return f"{name} has {actual_size} bytes, {size} were written"
        if actual_digest != digest:
            return f"{name} fails its checksum: the file is damaged"
    return None
