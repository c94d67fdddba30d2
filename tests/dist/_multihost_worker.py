"""Worker for test_multihost.py: one dtrain communicator per rank, across namespace "hosts".

Every rank prints one ``RESULT {json}`` line: where it runs (host name, rank, local rank and
size as the communicator sees them), the rendezvous address rank 0 announced, whether a sum
allreduce came out right, and the best of three timed allreduces of ``DTRAIN_TEST_PAYLOAD_BYTES``
float32 bytes (seconds), so the test can check that the traffic really went over the shaped links.
"""
from __future__ import annotations

import json
import os
import socket
import time

import torch
import torch.distributed as dist

from dtrain.comm import create_communicator


def rendezvous_host() -> str:
    """The address of the TCPStore this rank connected to (rank 0's announced address)."""
    store = dist.distributed_c10d._get_default_store()
    while hasattr(store, "underlying_store"):  # PrefixStore wrappers
        store = store.underlying_store
    return store.host


def timed_allreduce(comm, num_bytes: int, repeats: int = 3) -> float:
    """Best wall-clock seconds of ``repeats`` sum allreduces of ``num_bytes`` of float32 (after one warm-up)."""
    payload = torch.ones(max(1, num_bytes // 4), dtype=torch.float32)
    comm.allreduce(payload)  # connections and buffers warm
    best = float("inf")
    for _ in range(repeats):
        comm.barrier()
        started = time.perf_counter()
        comm.allreduce(payload)
        best = min(best, time.perf_counter() - started)
    return best


def main() -> None:
    comm = create_communicator(backend="gloo", timeout_s=60)
    values = torch.full((5,), float(comm.rank + 1))
    comm.allreduce(values)
    expected = comm.size * (comm.size + 1) / 2
    result = {
        "rank": comm.rank, "size": comm.size, "local_rank": comm.local_rank, "local_size": comm.local_size,
        "hostname": socket.gethostname(), "rendezvous": rendezvous_host(),
        "sum_ok": bool(torch.all(values == expected)),
    }
    num_bytes = int(os.environ.get("DTRAIN_TEST_PAYLOAD_BYTES", "0"))
    if num_bytes:
        result["allreduce_s"] = timed_allreduce(comm, num_bytes)
    print("RESULT " + json.dumps(result), flush=True)
    comm.finalize()


if __name__ == "__main__":
    main()
