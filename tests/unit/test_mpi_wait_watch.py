"""The MPI communicator's wait watch: MPI collectives have no timeout, so a watch thread ends the job."""
from __future__ import annotations

import threading
import time

from dtrain.comm.mpi_tensors import _WaitWatch


def test_a_wait_longer_than_the_timeout_ends_the_job_with_one_line() -> None:
    reported: list[str] = []
    done = threading.Event()
    watch = _WaitWatch(0.3, lambda message: (reported.append(message), done.set()))
    started = time.monotonic()
    watch.begin("all-reduce")
    assert done.wait(5), "the watch never reported the stuck wait"
    assert 0.3 <= time.monotonic() - started < 2
    assert reported == ["RuntimeError: MPI all-reduce timed out: no answer from the other ranks for 0.3 s "
                        "(comm.timeout_s); a rank has stopped calling collectives"]
    watch.stop()


def test_waits_that_end_in_time_are_never_reported() -> None:
    reported: list[str] = []
    watch = _WaitWatch(0.3, reported.append)
    for _ in range(10):  # 10 short waits spanning more than the timeout in all
        watch.begin("broadcast")
        time.sleep(0.05)
        watch.end()
    time.sleep(0.4)  # idle between collectives is not a wait either
    watch.stop()
    assert reported == []
