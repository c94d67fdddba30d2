"""One run directory, one job: a lock held by rank 0 for the life of the job.

``RunDirectoryLock.acquire(run_dir)`` takes an exclusive ``fcntl.flock`` on the directory itself,
so taking it adds and changes nothing inside; ``record_holder()`` then writes who holds it (pid,
host, start time) to ``run_dir/.lock`` once the job has started, and ``release()`` removes that
file again, so a finished or failed job leaves the directory as it found it. The operating system releases
the lock when the holder exits or dies, so a lock left by a dead job is simply taken over; a
second live job into the same directory is refused with one line naming the holder. The
``.lock`` file is never written through a link: one that is not a regular file is refused with
one line, and the holder's line is written to a new file renamed over it.

The lock also notes what was there when it was taken (the directories it created, the files the
directory held), so that a job refused by its data can take back what it wrote
(:meth:`RunDirectoryLock.remove_this_jobs_files`) and never touch what was there before.
"""
from __future__ import annotations

import datetime
import fcntl
import os
import shutil
import socket
from pathlib import Path

from dtrain.safe_files import RunFileError, check_regular, read_no_follow, replace_file
from dtrain.session.checkpoint import CheckpointError

HOLDER_FILE = ".lock"


class RunDirectoryInUse(CheckpointError):
    """Another live job holds the run directory (one-line message naming it)."""


class RunDirectoryLock:
    """An exclusive lock on one run directory; release it (or exit) to let another job in."""

    def __init__(self, run_dir: Path, descriptor: int, created: Path | None = None):
        self.run_dir = run_dir
        self._descriptor: int | None = descriptor
        self._recorded = False  # state: this process wrote run_dir/.lock
        self.created = created  # the outermost directory that taking the lock created (None: run_dir existed)
        # what the directory held when locked, by path and inode: a job takes back only what is not in here (a
        # file renamed since, such as a damaged metrics log set aside, keeps its inode and stays)
        self._found = {} if created is not None else _entries(run_dir)

    @classmethod
    def acquire(cls, run_dir: str | Path) -> RunDirectoryLock:
        """Creates ``run_dir`` if needed and locks it for this process.

        Raises:
            RunDirectoryInUse: another live process holds the lock (the message names its pid, host and start).
            CheckpointError: the directory cannot be created, opened or locked, or its ``.lock`` is not a
                regular file (a link planted there would make the holder's line overwrite its target).
        """
        run_dir = Path(run_dir)
        created = _outermost_missing(run_dir)
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            descriptor = os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY)
        except OSError as error:
            raise CheckpointError(f"run directory {run_dir} cannot be used ({error.strerror or error})") from None
        try:
            check_regular(run_dir / HOLDER_FILE, "lock holder's line")
        except RunFileError as error:
            os.close(descriptor)
            raise CheckpointError(str(error)) from None
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(descriptor)
            try:
                holder = read_no_follow(run_dir / HOLDER_FILE).decode("utf-8", "replace").strip() or "a job starting up"
            except OSError:
                holder = "a job starting up"
            raise RunDirectoryInUse(f"run directory {run_dir} is in use by another dtrain job ({holder}); wait for "
                                    f"it to end, or choose another run_dir") from None
        except OSError as error:  # a file system without locks: say so rather than run unprotected
            os.close(descriptor)
            raise CheckpointError(f"run directory {run_dir} cannot be locked ({error.strerror or error}); "
                                  f"choose a run_dir on a file system with file locks") from None
        return cls(run_dir, descriptor, created)

    def record_holder(self) -> None:
        """Writes this process's pid, host and start time to ``run_dir/.lock`` for a refused job to name
        (a new file renamed over the name: a link there is replaced, never followed)."""
        started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        replace_file(self.run_dir / HOLDER_FILE,
                     f"pid {os.getpid()} on host {socket.gethostname()}, started {started}\n".encode())
        self._recorded = True

    def remove_this_jobs_files(self) -> None:
        """Removes what this job wrote into the run directory (every file and directory it did not hold
        when locked) and the directories taking the lock created, while still locked; what was there
        before is never touched. For a job that failed before writing anything worth keeping."""
        if self._descriptor is None:
            return
        if self.created is not None:
            shutil.rmtree(self.run_dir, ignore_errors=True)
            # the parents it created, while empty: another job may have started a run directory beside it
            for parent in self.run_dir.absolute().parents:
                if not parent.is_relative_to(self.created.absolute()):
                    break
                try:
                    parent.rmdir()
                except OSError:
                    break
            return
        inodes = set(self._found.values())
        now = _entries(self.run_dir)
        for path in sorted(set(now) - set(self._found), key=lambda entry: len(entry.parts), reverse=True):
            if (path.name == HOLDER_FILE and path.parent == self.run_dir) or now[path] in inodes:
                continue  # release() removes the holder's line; a file that was there, renamed, stays
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)

    def release(self) -> None:
        """Removes the ``.lock`` this process wrote, then unlocks (idempotent)."""
        if self._recorded:
            (self.run_dir / HOLDER_FILE).unlink(missing_ok=True)  # while still locked: no other job's file
            self._recorded = False
        if self._descriptor is not None:
            os.close(self._descriptor)  # closing the only descriptor releases the flock
            self._descriptor = None

    def __del__(self):  # a session dropped without train() must not keep its directory locked
        try:
            self.release()
        except Exception:  # at interpreter exit the os module may already be gone; exit releases it anyway
            pass


def _outermost_missing(path: Path) -> Path | None:
    """The outermost directory that ``path.mkdir(parents=True)`` would create (``None``: ``path`` exists)."""
    missing = None
    for candidate in (path, *path.absolute().parents):
        if os.path.lexists(candidate):
            return missing
        missing = candidate
    return missing


def _entries(directory: Path) -> dict[Path, tuple[int, int]]:
    """Every file and directory below ``directory`` with its ``(device, inode)`` (links are listed, never followed)."""
    found = {}
    for root, directories, files in os.walk(directory):
        for name in (*directories, *files):
            path = Path(root, name)
            try:
                status = path.lstat()
            except OSError:
                continue  # gone meanwhile
            found[path] = (status.st_dev, status.st_ino)
    return found
