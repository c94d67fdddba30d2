"""Fail fast: an uncaught exception or a termination signal on any rank ends the whole job.

Without this, a rank that dies of an exception leaves its peers blocked in the next
collective (until the collective timeout at best). :func:`install_fail_fast` makes every
rank print one line, ``[rank r/size] ExceptionType: message``, and abort the job
(``MPI_Abort`` under MPI). ``DTRAIN_DEBUG=1`` adds the traceback.

SIGTERM and SIGINT end the job with exit code 143 or 130 and a line naming the signal,
unless a callback registered with :func:`add_signal_callback` claims the signal (the
hook for preemption checkpoints). Signals are handled on a small watcher thread woken
through ``signal.set_wakeup_fd``, so they act at once even while the main thread is
blocked inside a collective (Python runs its own signal handlers only between
bytecodes of the main thread).

Reading the output: when one rank aborts, ``mpiexec`` sends SIGTERM to the others,
which then print ``received SIGTERM`` lines; the first ``[rank r/size]`` line is the
cause. A forked child (e.g. a DataLoader worker) gets Python's default hooks back.
"""
from __future__ import annotations

import dataclasses
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Iterable
from types import TracebackType
from typing import Any

from dtrain.comm.base import Communicator, first_line

SignalCallback = Callable[[int], bool]
"""``callback(signum) -> claimed``: return True to take over the signal (the job is not ended)."""

DEFAULT_SIGNALS = (signal.SIGTERM, signal.SIGINT)

_callbacks: list[SignalCallback] = []
_lock = threading.Lock()


@dataclasses.dataclass
class _State:
    """What :func:`install_fail_fast` changed, so it can be updated or undone."""

    comm: Communicator | None = None
    signals: frozenset[int] = frozenset()
    previous_excepthook: Any = None
    previous_threading_excepthook: Any = None
    previous_handlers: dict[int, Any] = dataclasses.field(default_factory=dict)
    watcher: _SignalWatcher | None = None


_installed = _State()


def install_fail_fast(comm: Communicator, signals: Iterable[int] = DEFAULT_SIGNALS) -> None:
    """Make an uncaught exception (any thread) or one of ``signals`` on this rank end the whole job.

    Call once per process, from the main thread, right after creating ``comm``; calling
    again switches to the new ``comm``. Raises RuntimeError off the main thread.
    """
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("install_fail_fast must be called from the main thread (signal handlers live there)")
    with _lock:
        if _installed.comm is None:
            _installed.previous_excepthook = sys.excepthook
            _installed.previous_threading_excepthook = threading.excepthook
        _installed.comm = comm
    sys.excepthook = _excepthook
    threading.excepthook = _threading_excepthook
    install_signal_handlers(signals)


def install_signal_handlers(signals: Iterable[int] = DEFAULT_SIGNALS) -> frozenset[int]:
    """Route ``signals`` to :func:`handle_signal` through the watcher thread (main thread only).

    Separate from :func:`install_fail_fast` so later code can add signals (e.g. SIGUSR1
    for a preemption warning) without touching the exception hooks. Returns the signals this call
    routed (those not routed already), for :func:`release_signal_handlers`.
    """
    wanted = frozenset(int(signum) for signum in signals)
    if _installed.watcher is None:
        _installed.watcher = _SignalWatcher()
    _installed.watcher.attach()
    added = wanted - _installed.signals
    for signum in added:
        _installed.previous_handlers.setdefault(signum, signal.getsignal(signum))
        signal.signal(signum, _python_handler)
    _installed.signals = _installed.signals | wanted
    return added


def release_signal_handlers(signals: Iterable[int]) -> None:
    """Give ``signals`` back the handlers they had before :func:`install_signal_handlers` routed them
    (main thread only), so a training session run from a notebook or a script leaves no handler behind."""
    released = frozenset(int(signum) for signum in signals) & _installed.signals
    for signum in released:
        signal.signal(signum, _installed.previous_handlers.pop(signum, signal.SIG_DFL))
    _installed.signals = _installed.signals - released
    if released and not _installed.signals and _installed.watcher is not None:
        _installed.watcher.detach()


def uninstall_fail_fast() -> None:
    """Restore the exception hooks and signal handlers that were in place before installation."""
    if _installed.comm is None:
        return
    sys.excepthook = _installed.previous_excepthook
    threading.excepthook = _installed.previous_threading_excepthook
    release_signal_handlers(_installed.signals)
    if _installed.watcher is not None:
        _installed.watcher.detach()
    _installed.comm, _installed.signals, _installed.previous_handlers = None, frozenset(), {}


def _after_fork_in_child() -> None:
    """A forked child (e.g. a DataLoader worker) is not a rank: give it Python's defaults back.

    Otherwise its signals would be written into the parent's watcher pipe (the parent
    would end the job for a worker's SIGTERM) and its exceptions would abort the job.
    """
    try:
        uninstall_fail_fast()
        if _installed.watcher is not None:
            _installed.watcher.close()
            _installed.watcher = None
    except Exception as error:  # never break a fork
        sys.stderr.write(f"dtrain fail-fast: reset after fork failed: {error}\n")


os.register_at_fork(after_in_child=_after_fork_in_child)


def add_signal_callback(callback: SignalCallback) -> None:
    """Run ``callback(signum)`` when a handled signal arrives, before the job would be ended.

    Callbacks run in registration order; the first returning True claims the signal and
    the job goes on (its owner must then finish it, e.g. checkpoint at the next step
    and exit). They run on the watcher thread, not the main thread: keep them short and
    thread-safe, e.g. set a ``threading.Event``. A callback that raises is reported and
    treated as not claiming.
    """
    with _lock:
        _callbacks.append(callback)


def remove_signal_callback(callback: SignalCallback) -> None:
    """Unregister ``callback``; does nothing if it is not registered."""
    with _lock:
        if callback in _callbacks:
            _callbacks.remove(callback)


def handle_signal(signum: int) -> None:
    """Offer ``signum`` to the callbacks; if none claims it, abort the job with code 128 + signum."""
    with _lock:
        callbacks = list(_callbacks)
    for callback in callbacks:
        try:
            if callback(signum):
                return
        except Exception as error:  # a broken hook must not keep the job alive
            sys.stderr.write(f"signal callback {callback!r} failed: {type(error).__name__}: {first_line(error)}\n")
    comm = _installed.comm
    message = f"received {signal.Signals(signum).name}; ending the job"
    if comm is None:
        sys.stderr.write(message + "\n")
        os._exit(128 + signum)
    comm.abort(message, 128 + signum)


def exception_message(exc_type: type[BaseException], exc: BaseException | None, thread: str | None = None) -> str:
    """Return ``ExceptionType: first line of its message`` (plus `` (in thread NAME)``) for an abort line."""
    text = first_line(exc) if exc is not None else ""
    message = f"{exc_type.__name__}: {text}" if text else exc_type.__name__
    return f"{message} (in thread {thread})" if thread else message


def _debug() -> bool:
    return os.environ.get("DTRAIN_DEBUG", "").strip().lower() in ("1", "true", "yes", "on")


def _excepthook(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
    if _debug():
        traceback.print_exception(exc_type, exc, tb)
    code = 128 + signal.SIGINT if issubclass(exc_type, KeyboardInterrupt) else 1
    _abort(exception_message(exc_type, exc), code)


def _threading_excepthook(args: threading.ExceptHookArgs) -> None:
    if issubclass(args.exc_type, SystemExit):  # as threading's default hook: a thread may exit quietly
        return
    if _debug():
        traceback.print_exception(args.exc_type, args.exc_value, args.exc_traceback)
    name = args.thread.name if args.thread is not None else "?"
    _abort(exception_message(args.exc_type, args.exc_value, thread=name), 1)


def _abort(message: str, code: int) -> None:
    comm = _installed.comm
    if comm is None:  # uninstalled between the raise and the hook: behave like Python
        sys.stderr.write(message + "\n")
        os._exit(code)
    comm.abort(message, code)


def _python_handler(signum: int, frame: Any) -> None:
    """Python-level handler: normally the watcher thread acts; this only covers a stolen wakeup fd."""
    watcher = _installed.watcher
    if watcher is None or not watcher.owns_wakeup_fd():
        handle_signal(signum)


class _SignalWatcher:
    """A daemon thread that reads signal numbers from Python's wakeup fd and handles them."""

    def __init__(self) -> None:
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._write_fd, False)  # required by signal.set_wakeup_fd
        self._thread = threading.Thread(target=self._run, name="dtrain-signal-watcher", daemon=True)
        self._thread.start()

    def attach(self) -> None:
        """Point Python's C-level signal handler at this watcher (main thread only)."""
        signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)

    def detach(self) -> None:
        """Stop receiving signal numbers, if this watcher still owns the wakeup fd."""
        if self.owns_wakeup_fd():
            signal.set_wakeup_fd(-1)

    def close(self) -> None:
        """Close the pipe (in a forked child, where the thread does not exist)."""
        self.detach()
        os.close(self._read_fd)
        os.close(self._write_fd)

    def owns_wakeup_fd(self) -> bool:
        """True when signals are still written to this watcher's pipe (main thread only)."""
        current = signal.set_wakeup_fd(-1)  # Python offers no getter: swap out and back
        if current != -1:
            signal.set_wakeup_fd(current, warn_on_full_buffer=False)
        return current == self._write_fd

    def _run(self) -> None:
        while True:
            try:
                data = os.read(self._read_fd, 64)
            except InterruptedError:
                continue
            for signum in data:
                if signum in _installed.signals:
                    handle_signal(signum)
