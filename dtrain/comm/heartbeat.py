"""Liveness heartbeats: a stopped or unreachable rank ends the job within a bounded time.

Collectives alone cannot tell a slow step from a dead peer: a rank that is stopped
(``SIGSTOP``) or whose host is unreachable keeps its sockets open, so its peers wait for the
collective timeout and then, under MPI, block in ``MPI_Finalize`` forever. Here every rank
increments a counter in the job's rendezvous ``TCPStore`` (its own connection, never the
process group's) every ``interval_s``; rank 0 watches every other rank's counter and the other
ranks watch rank 0's. A counter that stops moving, or a store that stops answering (rank 0,
which serves it under ``mpiexec``, is stopped), ends the job through :meth:`Communicator.abort`
with one line naming the silent rank. A store operation against a stopped server blocks forever
(its timeout covers waiting for keys, not an unanswered request), so a second thread watches
that the beating completes a round in time.

The beats come from a small child process forked at start (no new interpreter to load), not
from a thread of the training process: a thread needs the interpreter lock, which the training
thread can hold for longer than the timeout (a C extension that keeps it; on a machine loaded
many times over its cores, any long stretch), and a healthy rank would look stopped. The child
beats while this rank's process exists and is not stopped (Linux: its state in ``/proc``),
watches, and reports a silent rank through a pipe, where a thread of this process waits without
the lock and ends the job with the one line. The child's output goes nowhere: torch's C++ store
client logs a stack when rank 0 disappears, and the one line already says it. Without ``fork``
the same loop runs in threads of this process.

Because the beats do not come from the training loop, a slow minibatch, a long evaluation or a
long checkpoint write is never taken for a hang. The bound: the job ends at most ``timeout_s``
seconds after a rank stops (``comm.heartbeat_timeout_s``, 60 by default). Traffic is O(size)
small store operations per interval, all through the store's host.
"""
from __future__ import annotations

import contextlib
import ctypes
import datetime
import gc
import os
import signal
import threading
import time
import warnings
from collections.abc import Callable

from dtrain.comm.base import Communicator, first_line

#: seconds the beating keeps quiet after losing the store, in case the job is ending normally
#: (rank 0 finished and closed the store while this rank was between its last beat and ``stop``)
LOST_STORE_GRACE_S = 1.0

#: how often the child process checks that this rank's process is still there (seconds)
PARENT_CHECK_S = 0.2

_KEY = "dtrain/heartbeat/{rank}"


def heartbeat_timings(timeout_s: float) -> tuple[float, float]:
    """``(interval_s, silence_s)`` for a bound of ``timeout_s``: beat ``interval_s`` apart and call a
    rank silent after ``silence_s`` without a beat, so that detection (up to one interval late),
    the store's own timeout and the grace period all fit inside ``timeout_s``."""
    interval = min(5.0, timeout_s / 10)
    silence = max(timeout_s / 2, timeout_s - 2 * interval - LOST_STORE_GRACE_S)
    return interval, silence


def process_is_stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (``SIGSTOP``, job control, a debugger): Linux's ``/proc`` state
    ``T`` or ``t``. False where ``/proc`` cannot tell."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read()
    except OSError:
        return False
    return fields[fields.rindex(b")") + 2:][:1] in (b"T", b"t")


class HeartbeatLoop:
    """The beating and watching of one rank, run by :meth:`run` until it reports once or ``alive()``
    turns false: beats this rank's counter while ``beating()`` (this rank's process is not stopped),
    watches the others' counters, and a watchdog thread reports a store that stops answering.
    ``report(message)`` gets the one line's text."""

    def __init__(self, host: str, port: int, rank: int, size: int, timeout_s: float,
                 report: Callable[[str], None], alive: Callable[[], bool], beating: Callable[[], bool]) -> None:
        self.host, self.port, self.rank, self.size = host, port, rank, size
        self.timeout_s = float(timeout_s)
        self.interval_s, self.silence_s = heartbeat_timings(self.timeout_s)
        self._report_once, self._alive, self._beating = report, alive, beating
        self._done = threading.Event()  # set once reported, or when alive() turned false
        self._reporting = threading.Lock()  # a report is written whole before run() returns
        self._last_round = time.monotonic()  # when the beating finished a round (or lost the store)

    def run(self) -> None:
        """Beats and watches in this thread (the watchdog in another) until done."""
        watchdog = threading.Thread(target=self._watch, name="dtrain-heartbeat-watch", daemon=True)
        watchdog.start()
        try:
            self._beat()
        finally:
            with self._reporting:
                self._done.set()

    def _report(self, message: str) -> None:
        with self._reporting:
            if not self._done.is_set():
                self._report_once(message)
                self._done.set()

    def _wait(self, seconds: float) -> bool:
        """Waits ``seconds``, checking ``alive()`` often; returns False when done meanwhile."""
        deadline = time.monotonic() + seconds
        while not self._done.wait(min(PARENT_CHECK_S, max(deadline - time.monotonic(), 0.0))):
            if not self._alive():
                self._done.set()
            elif time.monotonic() >= deadline:
                return True
        return False

    def _beat(self) -> None:
        import torch.distributed as dist

        try:
            store = dist.TCPStore(self.host, self.port, is_master=False, wait_for_workers=False,
                                  timeout=datetime.timedelta(seconds=self.silence_s))
        except Exception as error:  # noqa: BLE001 -- the store is gone: the job is ending or rank 0 died
            self._lost_store(error)
            return
        watched = list(range(1, self.size)) if self.rank == 0 else [0]
        last_value: dict[int, int | None] = {rank: None for rank in watched}
        last_change = {rank: time.monotonic() for rank in watched}
        own_key = _KEY.format(rank=self.rank)
        while not self._done.is_set():
            try:
                if self._beating():
                    store.add(own_key, 1)
                for rank in watched:
                    value = store.add(_KEY.format(rank=rank), 0)  # read without waiting for the key
                    now = time.monotonic()
                    if value != last_value[rank]:
                        last_value[rank], last_change[rank] = value, now
                    elif now - last_change[rank] > self.silence_s:
                        self._report(f"rank {rank} of {self.size} has sent no heartbeat for "
                                     f"{now - last_change[rank]:.0f} s (stopped, or its host is unreachable); "
                                     f"ending the job (comm.heartbeat_timeout_s={self.timeout_s:g})")
                        return
            except Exception as error:  # noqa: BLE001 -- a store that stops answering is the signal
                self._lost_store(error)
                return
            self._last_round = time.monotonic()
            if not self._wait(self.interval_s):
                return

    def _watch(self) -> None:
        while self._wait(self.interval_s):
            silent = time.monotonic() - self._last_round
            if silent > self.silence_s:
                who = "rank 0, which serves it," if self.rank != 0 else "this rank's store thread"
                self._report(f"the job's heartbeat store at {self.host}:{self.port} has not answered for "
                             f"{silent:.0f} s ({who} is stopped or hung); ending the job "
                             f"(comm.heartbeat_timeout_s={self.timeout_s:g})")
                return

    def _lost_store(self, error: BaseException) -> None:
        self._last_round = time.monotonic()  # an answer (an error), not a hang: the watchdog keeps quiet
        if not self._wait(LOST_STORE_GRACE_S):
            return
        who = "rank 0 (which serves it) is stopped or gone" if self.rank != 0 else "it failed"
        self._report(f"lost contact with the job's heartbeat store at {self.host}:{self.port}: {who} "
                     f"({first_line(error)}); ending the job (comm.heartbeat_timeout_s={self.timeout_s:g})")


class Heartbeat:
    """This rank's heartbeat; see the module docstring. Start with :func:`start_heartbeat`.

    ``abort(message)`` is called (from a thread of this process) when a rank falls silent; it must
    end the job. :meth:`start` forks the child process that beats (threads where ``fork`` is missing).
    """

    def __init__(self, host: str, port: int, rank: int, size: int, timeout_s: float,
                 abort: Callable[[str], None]) -> None:
        self.host, self.port, self.rank, self.size = host, port, rank, size
        self.timeout_s = float(timeout_s)
        self.interval_s, self.silence_s = heartbeat_timings(self.timeout_s)
        self._abort = abort
        self._stopped = threading.Event()
        self._ended = threading.Event()  # set once this heartbeat has reported (only one report)
        self._child: int | None = None  # pid of the beating process
        self._threads: list[threading.Thread] = []

    def start(self) -> Heartbeat:
        """Starts beating (a child process, or threads without ``fork``); returns ``self``."""
        if not hasattr(os, "fork"):
            loop = self._loop(self._report, alive=lambda: not self._stopped.is_set(), beating=lambda: True)
            self._threads = [threading.Thread(target=loop.run, name="dtrain-heartbeat", daemon=True)]
        else:
            read_end, write_end = os.pipe()
            from_main_thread = threading.current_thread() is threading.main_thread()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads: the child only runs the loop
                pid = os.fork()
            if pid == 0:
                os.close(read_end)
                self._run_child(write_end, parent=os.getppid(), die_with_parent=from_main_thread)  # never returns
            os.close(write_end)
            self._child = pid
            self._threads = [threading.Thread(target=self._listen, args=(read_end,), name="dtrain-heartbeat",
                                              daemon=True)]
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> None:
        """Stops beating and watching (call when the job ends normally, before the store goes away)."""
        self._stopped.set()
        if self._child is not None:
            with contextlib.suppress(OSError):
                os.kill(self._child, signal.SIGKILL)
                os.waitpid(self._child, 0)
            self._child = None
        for thread in self._threads:
            if thread.is_alive() and threading.current_thread() is not thread:
                thread.join(timeout=0.2)  # a thread may sit in a store call or a read; it is a daemon

    def _loop(self, report: Callable[[str], None], alive: Callable[[], bool],
              beating: Callable[[], bool]) -> HeartbeatLoop:
        return HeartbeatLoop(self.host, self.port, self.rank, self.size, self.timeout_s, report, alive, beating)

    def _report(self, message: str) -> None:
        if self._stopped.is_set() or self._ended.is_set():
            return
        self._ended.set()
        self._abort(message)

    def _listen(self, read_end: int) -> None:
        """Waits (without the interpreter lock) for the child's one report, and passes it on; a child
        that ends without one leaves this rank beatless, which is reported too."""
        with os.fdopen(read_end, "rb") as pipe:
            line = pipe.readline()
        if line:
            self._report(line.decode("utf-8", "replace").rstrip("\n"))
        elif not self._stopped.is_set():
            self._report(f"this rank's heartbeat process (pid {self._child}) ended unexpectedly, so its peers would "
                         f"take it for stopped; ending the job (comm.heartbeat_timeout_s={self.timeout_s:g})")

    def _run_child(self, write_end: int, parent: int, die_with_parent: bool) -> None:
        """The forked child: detaches from everything the rank holds, beats until the rank is gone or a
        report is written, then exits without any clean-up of the rank's."""
        try:
            _detach_from_parent(keep=write_end, die_with_parent=die_with_parent)

            def report(message: str) -> None:
                os.write(write_end, message.encode("utf-8", "replace") + b"\n")

            self._loop(report, alive=lambda: os.getppid() == parent,
                       beating=lambda: not process_is_stopped(parent)).run()
        finally:
            os._exit(0)


def _detach_from_parent(keep: int, die_with_parent: bool) -> None:
    """In the heartbeat's child: its own session (no terminal signals), output to ``/dev/null`` (the
    C++ store client's stacks), every other descriptor closed (a rank's sockets must close when the
    rank dies), no garbage collection (it would copy the rank's memory), and, when forked by the
    main thread, killed with the rank where Linux can (``PR_SET_PDEATHSIG`` follows the forking
    thread); otherwise it leaves within ``PARENT_CHECK_S`` of the rank."""
    gc.disable()
    os.setsid()
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(signum, signal.SIG_DFL)
    null = os.open(os.devnull, os.O_RDWR)
    for descriptor in (0, 1, 2):
        os.dup2(null, descriptor)
    os.closerange(3, keep)
    os.closerange(keep + 1, os.sysconf("SC_OPEN_MAX") if hasattr(os, "sysconf") else 65536)
    if die_with_parent:
        with contextlib.suppress(Exception):
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def start_heartbeat(comm: Communicator, timeout_s: float) -> Heartbeat | None:
    """Starts this rank's heartbeat for ``comm``'s job and ties it to ``comm.finalize()``.

    Returns None for a single process or a communicator without a rendezvous store. Every rank
    must call it. ``timeout_s`` (seconds) bounds how long a stopped rank can hold the job.
    Raises ValueError for a ``timeout_s`` below 1 second.
    """
    if not timeout_s >= 1:
        raise ValueError(f"heartbeat timeout_s={timeout_s!r}: expected at least 1 second")
    endpoint = getattr(comm, "store_endpoint", None)
    if comm.size == 1 or endpoint is None:
        return None
    heartbeat = Heartbeat(endpoint[0], endpoint[1], comm.rank, comm.size, timeout_s,
                          abort=lambda message: comm.abort(f"dtrain: error: {message}", 1))
    comm.heartbeat = heartbeat  # finalize() stops it once every rank has arrived
    return heartbeat.start()
