"""What the shard readers share: finding the shard files, naming them, and an optional library's import."""
from __future__ import annotations

import glob
import importlib
import os
from collections.abc import Iterable
from pathlib import Path

from dtrain.data.errors import DataError

__all__ = ["expand_shards", "require", "shard_names"]


def require(module: str, extra: str, what: str):
    """``import module``, or one line saying which extra to install for ``what``."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise DataError(f"{what} needs the {module} package: pip install 'dtrain[{extra}]'") from None


def expand_shards(paths: str | os.PathLike | Iterable[str | os.PathLike], suffixes: tuple[str, ...],
                  what: str) -> list[Path]:
    """The shard files that ``paths`` names, in order: a file, a directory (its files ending in one of
    ``suffixes``, sorted by name) or a glob pattern (sorted), or a list of these (in the list's order).

    Raises:
        DataError: a path that does not exist, a directory or pattern without shards, or no shard at all.
    """
    items = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    if not items:
        raise DataError(f"{what}: no shard paths given; expected files, a directory or a glob pattern")
    files: list[Path] = []
    for item in items:
        text = os.fspath(item)
        path = Path(text).expanduser()
        if path.is_dir():
            found = sorted(child for child in path.iterdir() if child.is_file() and child.name.endswith(suffixes))
            if not found:
                raise DataError(f"{what}: directory {path} holds no {' or '.join(suffixes)} shards")
            files.extend(found)
        elif glob.has_magic(text):
            found = sorted(Path(match) for match in glob.glob(os.path.expanduser(text)))
            if not found:
                raise DataError(f"{what}: pattern {text} matches no file")
            files.extend(found)
        elif path.is_file():
            files.append(path)
        else:
            raise DataError(f"{what}: shard {path} does not exist; expected a file, a directory or a glob pattern")
    duplicates = sorted({str(file) for file in files if files.count(file) > 1})
    if duplicates:
        raise DataError(f"{what}: shard {duplicates[0]} is named twice; every shard may be read once per sweep")
    return files


def shard_names(files: list[Path]) -> list[str]:
    """Each shard's path relative to the shards' common directory: what a checkpoint records (the data may
    move; its shards' names and lengths may not change)."""
    root = Path(os.path.commonpath([str(file.resolve().parent) for file in files]))
    return [str(file.resolve().relative_to(root)) for file in files]
