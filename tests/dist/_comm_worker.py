"""Worker run by tests/dist/test_comm.py under mpiexec (or torchrun): ``python _comm_worker.py SCENARIO``.

``ops`` runs the named checks ``collectives``, ``signal_callback`` and ``finalize`` on every rank
(``tests.helpers.checks``: each its own test id). The failure scenarios (``raise``,
``thread_raise``, ``sigkill``, ``sigterm``, ``stall``) end the job instead; one that did not would
print ``PASS <scenario> rank r/size`` and exit 0, which their tests refuse.
"""
from __future__ import annotations

import importlib
import os
import signal
import sys
import threading
import time

import torch

from dtrain.comm import add_signal_callback, create_communicator, install_fail_fast, remove_signal_callback

from tests.helpers.checks import run_checks


def check_ops(comm) -> None:
    """Every collective against the value computed by hand."""
    rank, size = comm.rank, comm.size
    assert 0 <= rank < size and comm.is_main == (rank == 0)
    assert comm.device == torch.device("cpu"), comm.device
    expected_local_size = int(os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", size)))
    assert (comm.local_rank, comm.local_size) == (rank, expected_local_size), (comm.local_rank, comm.local_size)
    if size == 1:
        assert "mpi4py" not in sys.modules, "a single process imported mpi4py"
        assert comm.backend == "local"
    else:
        assert comm.backend == os.environ.get("WORKER_BACKEND", "gloo"), comm.backend

    ranks_sum = size * (size - 1) / 2
    value = torch.tensor([rank + 1.0, -rank, 2.0 * rank])
    assert comm.allreduce(value.clone(), op="sum").tolist() == [size + ranks_sum, -ranks_sum, 2 * ranks_sum]
    assert torch.allclose(comm.allreduce(value.clone(), op="mean"),
                          torch.tensor([(size + ranks_sum) / size, -ranks_sum / size, 2 * ranks_sum / size]))
    assert comm.allreduce(value.clone(), op="max").tolist() == [size, 0.0, 2.0 * (size - 1)]
    assert comm.allreduce(value.clone(), op="min").tolist() == [1.0, -(size - 1.0), 0.0]
    counts = torch.tensor([rank], dtype=torch.int64)
    assert comm.allreduce(counts, op="sum") is counts and counts.item() == ranks_sum

    # Several async reductions in flight at once, waited in reverse (bucketed gradients).
    buckets = [torch.full((1000,), float(rank + bucket)) for bucket in range(3)]
    handles = [comm.allreduce_async(bucket, op="mean") for bucket in buckets]
    for bucket_index in reversed(range(3)):
        reduced = handles[bucket_index].wait()
        assert reduced is buckets[bucket_index]
        assert torch.allclose(reduced, torch.full((1000,), ranks_sum / size + bucket_index))
    assert handles[0].wait() is buckets[0]  # a second wait is harmless and does not divide again
    assert torch.allclose(buckets[0], torch.full((1000,), ranks_sum / size))

    for root in range(size):
        data = torch.arange(4.0) + 10 * rank
        assert comm.broadcast(data, root=root) is data and data.tolist() == (torch.arange(4.0) + 10 * root).tolist()

    gathered = comm.allgather(torch.tensor([rank, rank * rank]))
    assert [tensor.tolist() for tensor in gathered] == [[r, r * r] for r in range(size)]

    assert comm.allgather_object({"rank": rank}) == [{"rank": r} for r in range(size)]
    assert comm.broadcast_object(f"from {rank}", root=size - 1) == f"from {size - 1}"
    root = size - 1
    collected = comm.gather_object(("r", rank), root=root)
    assert collected == ([("r", r) for r in range(size)] if rank == root else None), collected

    # barrier: nobody leaves before the slowest rank has arrived.
    time.sleep(0.2 * rank)
    before = time.time()
    comm.barrier()
    arrival = comm.allgather_object(before)
    assert time.time() >= max(arrival) - 0.05


def check_signal_callback(comm) -> None:
    """A callback that claims SIGTERM keeps the job alive (the preemption hook point)."""
    claimed = threading.Event()

    def claim(signum: int) -> bool:
        claimed.set()
        return signum == signal.SIGTERM

    add_signal_callback(claim)
    os.kill(os.getpid(), signal.SIGTERM)
    assert claimed.wait(10), "the SIGTERM callback did not run"
    remove_signal_callback(claim)
    comm.barrier()


def check_finalize(comm) -> None:
    """``finalize()`` twice is harmless and leaves no Gloo thread running (threads left running
    would be torn down mid-work at interpreter exit: SIGABRT)."""
    comm.barrier()
    comm.finalize()
    comm.finalize()  # idempotent
    assert not gloo_worker_threads(), f"finalize() left Gloo threads running: {gloo_worker_threads()}"


def gloo_worker_threads() -> list[str]:
    """Names of this process's Gloo threads still running (Linux ``/proc``; empty elsewhere)."""
    tasks = "/proc/self/task"
    if not os.path.isdir(tasks):
        return []
    names = []
    for task in os.listdir(tasks):
        try:
            with open(f"{tasks}/{task}/comm") as name:
                names.append(name.read().strip())
        except OSError:  # the thread ended while listing
            continue
    return [name for name in names if name.startswith(("pt_gloo", "gloo_"))]


def mark_event() -> None:
    """Print the wall-clock time of the failure, so the test can measure how fast the job ended."""
    print(f"EVENT {time.time():.3f}", flush=True)


def blocked_in_allreduce(comm) -> None:
    """Rank 0 waits in an allreduce that the other ranks never join."""
    comm.allreduce(torch.ones(4))
    raise AssertionError("allreduce returned although a peer never joined")


def main() -> None:
    scenario = sys.argv[1]
    timeout_s = float(os.environ.get("WORKER_TIMEOUT_S", "60"))
    comm = create_communicator(backend=os.environ.get("WORKER_BACKEND", "gloo"), timeout_s=timeout_s)
    install_fail_fast(comm)
    rank = comm.rank
    if scenario == "ops":
        # the late import torch._dynamo makes when the first optimizer is built; it must not keep
        # the process group (and Gloo's threads) alive past finalize()
        importlib.import_module("torch.distributed.nn.functional")
        run_checks(comm, {"collectives": check_ops, "signal_callback": check_signal_callback,
                          "finalize": check_finalize})
        return
    if scenario == "raise":  # rank 1 raises while rank 0 waits in a collective
        if rank == 1:
            time.sleep(0.5)
            mark_event()
            raise ValueError("boom from rank 1")
        blocked_in_allreduce(comm)
    elif scenario == "thread_raise":  # an exception in a non-main thread: MPI_Abort from that thread
        if rank == 1:
            threading.Timer(0.5, lambda: (mark_event(), 1 / 0)).start()
            time.sleep(120)
        blocked_in_allreduce(comm)
    elif scenario == "sigkill":  # rank 1 is killed outright while rank 0 waits
        if rank == 1:
            time.sleep(0.5)
            mark_event()
            os.kill(os.getpid(), signal.SIGKILL)
        blocked_in_allreduce(comm)
    elif scenario == "sigterm":  # SIGTERM reaches rank 1 while it is blocked inside Gloo
        if rank == 1:
            threading.Timer(0.5, lambda: (mark_event(), os.kill(os.getpid(), signal.SIGTERM))).start()
            blocked_in_allreduce(comm)
        time.sleep(120)
    elif scenario == "stall":  # rank 1 hangs (alive, silent): rank 0 must time out, not hang
        if rank == 1:
            time.sleep(120)
        mark_event()
        blocked_in_allreduce(comm)
    else:
        raise ValueError(f"unknown scenario {scenario!r}")
    check_finalize(comm)
    sys.stdout.write(f"PASS {scenario} rank {rank}/{comm.size}\n")  # one write: lines from ranks stay whole
    sys.stdout.flush()


if __name__ == "__main__":
    main()
