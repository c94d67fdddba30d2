"""Writing into a run directory that others may share, never through a link planted there.

A team shares run directories, so a name in one may be a symbolic link that someone else put
there (``metrics.csv -> ~/thesis.tex``). dtrain therefore writes each file in one of three ways,
none of which follows a link at that name:

- replaced whole (``replace_file``, ``write_through_temporary``): written to a new temporary file
  and renamed over the name; a rename replaces a link itself, never the file it points to;
- created new (``create_new``): ``O_CREAT | O_EXCL``, which refuses any existing name, links included;
- appended to (``open_append``): ``O_NOFOLLOW``, after ``check_regular`` refused anything but a
  regular file with one line.

New files get ``0666`` less the umask, as any other output, so a team can read them.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO


class RunFileError(ValueError):
    """A name in the run directory that dtrain will not write through (a link, a directory); one line."""


def current_umask() -> int:
    """This process's umask (read without changing it for longer than the call)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _describe(path: Path, mode: int) -> str:
    if stat.S_ISLNK(mode):
        try:
            return f"a symbolic link (to {os.readlink(path)})"
        except OSError:
            return "a symbolic link"
    return "a directory" if stat.S_ISDIR(mode) else "not a regular file"


def check_regular(path: str | Path, what: str = "file") -> None:
    """Refuses a ``path`` that exists but is not a regular file (a link is not followed to decide).

    Raises:
        RunFileError: one line naming the path, what it is, and what to do.
    """
    path = Path(path)
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISREG(mode):
        raise RunFileError(f"{path} is {_describe(path, mode)}, not a regular file; dtrain writes its {what} there "
                           f"and never through a link: remove it, or choose another run_dir")


def check_directory(path: str | Path, what: str = "directory") -> None:
    """Refuses a ``path`` that exists but is not a real directory (a link to one included).

    Raises:
        RunFileError: one line naming the path and what it is.
    """
    path = Path(path)
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(mode):
        kind = _describe(path, mode) if stat.S_ISLNK(mode) else "a file"
        raise RunFileError(f"{path} is {kind}, not a directory; dtrain writes its {what} there and never through "
                           f"a link: remove it, or choose another run_dir")


def first_free_name(path: Path) -> Path:
    """``path`` if nothing is at that name (not even a link), else the first free ``<stem>.<n><suffix>``
    beside it (n = 1, 2, ...): where a file goes that must not replace an earlier one."""
    candidate, number = path, 1
    while os.path.lexists(candidate):
        candidate = path.with_name(f"{path.stem}.{number}{path.suffix}")
        number += 1
    return candidate


def create_new(path: str | Path) -> IO[bytes]:
    """Opens a new file at ``path`` for writing; FileExistsError if the name exists (even as a link)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    return os.fdopen(os.open(path, flags, 0o666), "wb")


def open_append(path: str | Path) -> IO[bytes]:
    """Opens ``path`` to append unbuffered, creating it if missing; OSError (ELOOP) for a link."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    return os.fdopen(os.open(path, flags, 0o666), "ab", buffering=0)


def read_no_follow(path: str | Path) -> bytes:
    """The bytes of the regular file at ``path``; OSError for a link or anything else."""
    with os.fdopen(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC), "rb") as stream:
        return stream.read()


def open_replacement(path: str | Path) -> tuple[IO[bytes], Path]:
    """A new temporary file beside ``path`` (hidden, umask permissions) and its name; ``os.replace``
    it onto ``path`` when complete. The caller removes it on failure."""
    path = Path(path)
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(handle, 0o666 & ~current_umask())
    except OSError:
        os.close(handle)
        Path(temporary).unlink(missing_ok=True)
        raise
    return os.fdopen(handle, "wb"), Path(temporary)


def replace_file(path: str | Path, data: bytes) -> Path:
    """Writes ``data`` to ``path`` whole: a temporary file renamed over it (see the module docstring).

    Raises:
        OSError: it could not be written; the temporary is removed and ``path`` left as it was.
    """
    path = Path(path)
    stream, temporary = open_replacement(path)
    try:
        with stream:
            stream.write(data)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    return path


def write_through_temporary(path: str | Path, write: Callable[[str], None]) -> Path:
    """Has ``write(name)`` create the file at a temporary name, then renames it onto ``path``.

    For writers that take a file name (safetensors, matplotlib): the name lies in a new private
    directory beside ``path`` (mode 0700), where nobody else can plant a link; the file then gets
    the umask's permissions, whatever mode the writer gave it.

    Raises:
        OSError: it could not be written; nothing is left behind and ``path`` is as it was.
    """
    path = Path(path)
    private = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    try:
        temporary = private / path.name
        write(str(temporary))
        os.chmod(temporary, 0o666 & ~current_umask())
        os.replace(temporary, path)
    finally:
        with contextlib.suppress(OSError):
            shutil.rmtree(private)
    return path


class Originals:
    """The files a run replaced, each as it was before the run first replaced it, to put back when the run's writes
    are taken back (a failed run loses nothing it found). Each is held open, not copied: the replaced file lives on
    as long as this holds it, costing neither memory nor a file left behind if the process dies."""

    def __init__(self):
        self._held: dict[Path, int | None] = {}  # None: nothing was there; this run created the file

    def keep(self, path: str | Path) -> None:
        """Holds the file at ``path`` as it is now, unless already held (call it before replacing the file)."""
        path = Path(path).absolute()
        if path in self._held:
            return
        try:
            self._held[path] = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            self._held[path] = None
        except OSError:  # a link or something unreadable: replaced as ever, not put back
            pass

    def put_back(self) -> None:
        """Puts every held file back as it was (whole, through a temporary file); removes the ones this run created."""
        for path, descriptor in self._held.items():
            if descriptor is None:
                path.unlink(missing_ok=True)
                continue
            stream, temporary = open_replacement(path)
            try:
                with stream, os.fdopen(os.dup(descriptor), "rb") as original:
                    original.seek(0)
                    shutil.copyfileobj(original, stream)
                os.replace(temporary, path)
            except BaseException:
                temporary.unlink(missing_ok=True)
                raise
        self.release()

    def release(self) -> None:
        """Lets the held files go (the run's replacements stay)."""
        for descriptor in self._held.values():
            if descriptor is not None:
                os.close(descriptor)
        self._held.clear()
