"""What the shard readers share: finding the shard files, naming them, and an optional library's import."""
from __future__ import annotations

import collections
import glob
import importlib
import os
import threading
from collections.abc import Callable, Hashable, Iterable
from pathlib import Path

from dtrain.data.errors import DataError

__all__ = ["RecentlyUsed", "expand_shards", "require", "shard_names"]


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


class RecentlyUsed:
    """The values of the last ``capacity`` keys asked for, made on first use: what a shard reader keeps of the
    shards being read (decoded row groups, tar indexes, open files). Thread-safe (the source's read-ahead thread
    reads); a value is made outside the lock, and ``close`` is called on each value dropped. Pickles empty."""

    def __init__(self, capacity: int, close: Callable | None = None):
        self.capacity, self.close = capacity, close
        self._values: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Hashable, make: Callable):
        with self._lock:
            if key in self._values:
                self._values.move_to_end(key)
                return self._values[key]
        value = make()
        with self._lock:
            self._values[key] = value
            while len(self._values) > self.capacity:
                dropped = self._values.popitem(last=False)[1]
                if self.close is not None:
                    self.close(dropped)
        return value

    def __len__(self) -> int:
        return len(self._values)

    def __getstate__(self) -> dict:
        return {"capacity": self.capacity, "close": self.close}

    def __setstate__(self, state: dict) -> None:
        self.__init__(**state)
