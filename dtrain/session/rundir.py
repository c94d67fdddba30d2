"""One run directory, one job: a lock held by rank 0 for the life of the job.

``RunDirectoryLock.acquire(run_dir)`` takes an exclusive ``fcntl.flock`` on ``run_dir/.lock`` and
writes who holds it (pid, host, start time). The operating system releases the lock when the
holder exits or dies, so a lock left by a dead job is simply taken over; a second live job into
the same directory is refused with one line naming the holder.
"""
from __future__ import annotations

import datetime
import fcntl
import os
import socket
from pathlib import Path

from dtrain.session.checkpoint import CheckpointError

LOCK_NAME = ".lock"


class RunDirectoryInUse(CheckpointError):
    """Another live job holds the run directory (one-line message naming it)."""


class RunDirectoryLock:
    """An exclusive lock on one run directory; release it (or exit) to let another job in."""

    def __init__(self, run_dir: Path, handle):
        self.run_dir = run_dir
        self._handle = handle

    @classmethod
    def acquire(cls, run_dir: str | Path) -> RunDirectoryLock:
        """Creates ``run_dir`` if needed and locks it for this process.

        Raises:
            RunDirectoryInUse: another live process holds the lock (the message names its pid, host and start).
            CheckpointError: the directory cannot be created or the lock file cannot be opened.
        """
        run_dir = Path(run_dir)
        path = run_dir / LOCK_NAME
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            handle = open(path, "a+", encoding="utf-8")
        except OSError as error:
            raise CheckpointError(f"run directory {run_dir} cannot be used ({error.strerror or error})") from None
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "an unknown process"
            handle.close()
            raise RunDirectoryInUse(f"run directory {run_dir} is in use by another dtrain job ({holder}); wait for "
                                    f"it to end, or choose another run_dir") from None
        except OSError as error:  # a file system without locks: say so rather than run unprotected
            handle.close()
            raise CheckpointError(f"run directory {run_dir} cannot be locked ({error.strerror or error}); "
                                  f"choose a run_dir on a file system with file locks") from None
        started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()} on host {socket.gethostname()}, started {started}\n")
        handle.flush()
        return cls(run_dir, handle)

    def release(self) -> None:
        """Unlocks (idempotent); the lock file stays, holding the last holder's line."""
        if self._handle is not None:
            fcntl.flock(self._handle, fcntl.LOCK_UN)
            self._handle.close()
            self._handle = None
