"""Liveness heartbeats: a stopped or unreachable rank ends the job within a bounded time.

Collectives alone cannot tell a slow step from a dead peer: a rank that is stopped
(``SIGSTOP``), swapped out or stuck in uninterruptible I/O keeps its sockets open, so its
peers wait for the collective timeout and then, under MPI, block in ``MPI_Finalize``
forever. Here every rank runs a daemon thread that increments a counter in the job's
rendezvous ``TCPStore`` (its own connection, never the process group's) every
``interval_s``; rank 0's thread watches every other rank's counter and the other ranks watch
rank 0's. A counter that stops moving, or a store that stops answering (rank 0, which serves
it under ``mpiexec``, is stopped), ends the job through :meth:`Communicator.abort` with one
line naming the silent rank. A store operation against a stopped server blocks forever (its
timeout covers waiting for keys, not an unanswered request), so a second thread watches
that the beating thread completes a round in time.

Because the beats come from a thread, not from the training loop, a slow minibatch, a long
evaluation or a long checkpoint write is never taken for a hang. The bound: the job ends at
most ``timeout_s`` seconds after a rank stops (``comm.heartbeat_timeout_s``, 60 by default).
Traffic is O(size) small store operations per interval, all through the store's host.
"""
from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Callable

from dtrain.comm.base import Communicator, first_line

#: seconds the thread keeps quiet after losing the store, in case the job is ending normally
#: (rank 0 finished and closed the store while this rank was between its last beat and ``stop``)
LOST_STORE_GRACE_S = 1.0

_KEY = "dtrain/heartbeat/{rank}"


def heartbeat_timings(timeout_s: float) -> tuple[float, float]:
    """``(interval_s, silence_s)`` for a bound of ``timeout_s``: beat ``interval_s`` apart and call a
    rank silent after ``silence_s`` without a beat, so that detection (up to one interval late),
    the store's own timeout and the grace period all fit inside ``timeout_s``."""
    interval = min(5.0, timeout_s / 10)
    silence = max(timeout_s / 2, timeout_s - 2 * interval - LOST_STORE_GRACE_S)
    return interval, silence


class Heartbeat:
    """This rank's heartbeat thread; see the module docstring. Start with :func:`start_heartbeat`.

    ``abort(message)`` is called (from the thread) when a rank falls silent; it must end the job.
    """

    def __init__(self, host: str, port: int, rank: int, size: int, timeout_s: float,
                 abort: Callable[[str], None]) -> None:
        self.host, self.port, self.rank, self.size = host, port, rank, size
        self.timeout_s = float(timeout_s)
        self.interval_s, self.silence_s = heartbeat_timings(self.timeout_s)
        self._abort = abort
        self._stopped = threading.Event()
        self._ended = threading.Event()  # set once this heartbeat has reported (only one report)
        self._last_round = time.monotonic()  # when the beating thread last finished a round
        self._threads = [threading.Thread(target=self._beat, name="dtrain-heartbeat", daemon=True),
                         threading.Thread(target=self._watch, name="dtrain-heartbeat-watch", daemon=True)]

    def start(self) -> Heartbeat:
        """Starts the threads; returns ``self``."""
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> None:
        """Stops beating and watching (call when the job ends normally, before the store goes away)."""
        self._stopped.set()
        for thread in self._threads:
            if thread.is_alive() and threading.current_thread() is not thread:
                thread.join(timeout=0.2)  # the beating thread may sit in a store call; it is a daemon

    def _report(self, message: str) -> None:
        if self._stopped.is_set() or self._ended.is_set():
            return
        self._ended.set()
        self._abort(message)

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
        while not self._stopped.is_set():
            try:
                store.add(own_key, 1)
                for rank in watched:
                    value = store.add(_KEY.format(rank=rank), 0)  # read without waiting for the key
                    now = time.monotonic()
                    if value != last_value[rank]:
                        last_value[rank], last_change[rank] = value, now
                    elif now - last_change[rank] > self.silence_s:
                        self._report(f"rank {rank} of {self.size} has sent no heartbeat for "
                                     f"{now - last_change[rank]:.0f} s (stopped, swapped out, or its host is "
                                     f"unreachable); ending the job (comm.heartbeat_timeout_s={self.timeout_s:g})")
                        return
            except Exception as error:  # noqa: BLE001 -- a store that stops answering is the signal
                self._lost_store(error)
                return
            self._last_round = time.monotonic()
            self._stopped.wait(self.interval_s)

    def _watch(self) -> None:
        while not self._stopped.wait(self.interval_s):
            silent = time.monotonic() - self._last_round
            if silent > self.silence_s:
                who = "rank 0, which serves it," if self.rank != 0 else "this rank's store thread"
                self._report(f"the job's heartbeat store at {self.host}:{self.port} has not answered for "
                             f"{silent:.0f} s ({who} is stopped or hung); ending the job "
                             f"(comm.heartbeat_timeout_s={self.timeout_s:g})")
                return

    def _lost_store(self, error: BaseException) -> None:
        if self._stopped.wait(LOST_STORE_GRACE_S):
            return
        who = "rank 0 (which serves it) is stopped or gone" if self.rank != 0 else "it failed"
        self._report(f"lost contact with the job's heartbeat store at {self.host}:{self.port}: {who} "
                     f"({first_line(error)}); ending the job (comm.heartbeat_timeout_s={self.timeout_s:g})")


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
