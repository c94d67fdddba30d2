"""Heartbeats in one process: each rank's beating process (forked by its Heartbeat) beats into a real
TCPStore; silence is reported once, and never because this process holds the interpreter lock."""
from __future__ import annotations

import ctypes
import datetime
import gc
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch.distributed as dist

from dtrain.comm.heartbeat import Heartbeat, heartbeat_timings


class Reports:
    def __init__(self) -> None:
        self.messages: list[str] = []
        self.arrived = threading.Event()

    def __call__(self, message: str) -> None:
        self.messages.append(message)
        self.arrived.set()


@pytest.fixture
def store():
    server = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=10), wait_for_workers=False)
    yield server


def test_timings_fit_the_bound():
    for timeout in (4, 10, 60, 600):
        interval, silence = heartbeat_timings(timeout)
        assert 0 < interval <= 5 and silence + interval <= timeout and silence >= timeout / 2


def test_ranks_that_beat_are_never_reported(store):
    reports = Reports()
    beats = [Heartbeat("127.0.0.1", store.port, rank, 2, 2.0, reports).start() for rank in (0, 1)]
    assert not reports.arrived.wait(4.0), reports.messages
    for beat in beats:
        beat.stop()
    assert reports.messages == []


def test_a_silent_rank_is_reported_once_by_rank_0_within_the_bound(store):
    reports = Reports()
    started = time.monotonic()
    beat = Heartbeat("127.0.0.1", store.port, 0, 3, 2.0, reports).start()  # ranks 1 and 2 never beat
    assert reports.arrived.wait(5.0)
    assert time.monotonic() - started <= 2.0 + 0.5
    time.sleep(0.5)
    beat.stop()
    assert len(reports.messages) == 1
    assert reports.messages[0].startswith("rank 1 of 3 has sent no heartbeat") and "comm.heartbeat_timeout_s=2" in reports.messages[0]


@pytest.mark.slow
def test_a_store_that_never_answers_is_reported_by_the_watchdog():
    server = subprocess.Popen([sys.executable, "-c", (
        "import datetime, time, torch.distributed as d\n"
        "s = d.TCPStore('127.0.0.1', 0, 1, True, timeout=datetime.timedelta(seconds=5), wait_for_workers=False)\n"
        "print(s.port, flush=True)\ntime.sleep(120)\n")], stdout=subprocess.PIPE, text=True)
    try:
        port = int(server.stdout.readline())
        reports = Reports()
        beat = Heartbeat("127.0.0.1", port, 1, 2, 2.0, reports).start()
        time.sleep(0.5)
        os.kill(server.pid, signal.SIGSTOP)  # rank 0 stopped: its store blocks every request
        stopped = time.monotonic()
        assert reports.arrived.wait(6.0), "a stopped store was never reported"
        assert time.monotonic() - stopped <= 2.0 + 0.5
        assert "has not answered" in reports.messages[0] and "rank 0, which serves it," in reports.messages[0]
        beat.stop()
        os.kill(server.pid, signal.SIGCONT)  # let the blocked request finish before the store goes away
        time.sleep(0.5)
    finally:
        server.kill()
        server.wait()


def test_beats_go_on_while_this_process_holds_the_interpreter_lock(store):
    """The beats come from a child process: a training thread holding the lock for longer than the timeout
    (here C's sleep called through ctypes.PyDLL, 2.5 s against a 1 s bound) is not taken for a stopped rank."""
    reports = Reports()
    beats = [Heartbeat("127.0.0.1", store.port, rank, 2, 1.0, reports).start() for rank in (0, 1)]
    time.sleep(0.3)
    ctypes.PyDLL(None).sleep(2)  # not even this process's other threads run meanwhile
    time.sleep(0.5)
    for beat in beats:
        beat.stop()
    assert reports.messages == []


def test_losing_rank_0s_store_is_one_line_without_torchs_cpp_stack(capfd):
    """Rank 0 dies and its store with it: the other ranks report it in their one line, and torch's C++
    client, which logs the socket error with a stack, prints nothing of it."""
    server = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=10), wait_for_workers=False)
    reports = Reports()
    beat = Heartbeat("127.0.0.1", server.port, 1, 2, 2.0, reports).start()
    time.sleep(0.5)
    del server  # its server closes every connection
    gc.collect()
    assert reports.arrived.wait(6.0), "a lost store was never reported"
    beat.stop()
    assert reports.messages[0].startswith("lost contact with the job's heartbeat store") and \
        "rank 0 (which serves it) is stopped or gone" in reports.messages[0], reports.messages
    printed = capfd.readouterr()
    assert "TCPStore" not in printed.err + printed.out and "Exception raised from" not in printed.err, printed.err
