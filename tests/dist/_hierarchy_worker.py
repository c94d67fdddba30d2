"""Worker for test_hierarchy.py: sub-communicators and the hierarchical all-reduce at 4 ranks.

``python _hierarchy_worker.py checks``: the named checks below, with ``comm.ranks_per_host``'s override
(``WORKER_RANKS_PER_HOST``, default 2: 2 'hosts' x 2 ranks) on ``WORKER_BACKEND`` (gloo or mpi).
``kill`` and ``stall``: rank 3 dies (SIGKILL) or stops calling collectives while the others wait inside
a hierarchical all-reduce; the job must end promptly.
"""
from __future__ import annotations

import os
import signal
import sys
import time

import torch

from dtrain.comm import create_communicator, install_fail_fast
from dtrain.comm.base import HostGroups
from dtrain.comm.hierarchical import HierarchicalCommunicator, make_hierarchical
from tests.helpers.checks import run_checks

RANKS_PER_HOST = int(os.environ.get("WORKER_RANKS_PER_HOST", "2"))


def check_host_groups(comm) -> dict:
    """Hosts of consecutive ranks; the leader is each host's lowest rank; leaders ranked by host."""
    hosts = comm.host_ranks(RANKS_PER_HOST)
    assert hosts == [[0, 1], [2, 3]], hosts
    local, leaders = comm.host_groups(RANKS_PER_HOST)
    assert (local.rank, local.size) == (comm.rank % 2, 2), local
    assert local.backend == comm.backend and local.device == comm.device
    if comm.rank % 2 == 0:
        assert leaders is not None and (leaders.rank, leaders.size) == (comm.rank // 2, 2), leaders
    else:
        assert leaders is None
    assert comm.host_groups(RANKS_PER_HOST).local is local  # cached: no second set of groups
    return {"local": [local.rank, local.size], "leader": leaders is not None}


def check_sub_collectives(comm) -> None:
    """Every collective of the host-local communicator acts within the host only; roots are local ranks."""
    local, _ = comm.host_groups(RANKS_PER_HOST)
    host = comm.rank // 2
    members = [2 * host, 2 * host + 1]
    for dtype in (torch.float32, torch.int64, torch.bfloat16):  # bf16 leaves MPI for Gloo
        summed = local.allreduce(torch.full((5,), comm.rank + 1, dtype=dtype))
        assert summed.tolist() == [sum(m + 1 for m in members)] * 5, (dtype, summed)
    mean = local.allreduce_async(torch.full((3,), float(comm.rank)), op="mean").wait()
    assert mean.tolist() == [sum(members) / 2] * 3, mean
    largest = local.allreduce(torch.tensor([comm.rank]), op="max")
    assert largest.item() == members[1]
    check_ordered_collectives(local, members, comm.rank)
    local.barrier()
    try:
        local.broadcast(torch.zeros(1), root=2)
    except ValueError:
        pass
    else:
        raise AssertionError("a root outside the sub-communicator was accepted")


def check_ordered_collectives(sub, members: list[int], job_rank: int) -> None:
    """The collectives whose result depends on rank order act in ``sub``'s order (``members``: the job
    rank of each of its ranks), with roots named by its ranks; in float32 and bfloat16 (which leaves MPI)."""
    last = len(members) - 1
    for dtype in (torch.float32, torch.bfloat16):
        reduced = sub.reduce(torch.full((4,), float(job_rank), dtype=dtype), root=last)
        if sub.rank == last:
            assert reduced.tolist() == [float(sum(members))] * 4, (dtype, reduced)
        sent = torch.full((6,), float(job_rank), dtype=dtype)
        assert sub.broadcast(sent, root=last).tolist() == [float(members[last])] * 6, dtype
        gathered = sub.allgather(torch.tensor([job_rank, job_rank * 10], dtype=dtype))
        assert [g.tolist() for g in gathered] == [[m, m * 10] for m in members], (dtype, gathered)
    assert sub.allgather_object(("r", job_rank)) == [("r", m) for m in members]
    assert sub.broadcast_object({"from": job_rank} if sub.rank == last else None, root=last) == {"from": members[last]}
    at_root = sub.gather_object(job_rank, root=0)
    assert at_root == (members if sub.rank == 0 else None), at_root
    sends = [torch.full((sub.rank + 1 + j,), float(job_rank)) for j in range(len(members))]
    expected = [[float(m)] * (r + 1 + sub.rank) for r, m in enumerate(members)]
    assert [r.tolist() for r in sub.all_to_all(sends)] == expected
    told = sub.all_to_all(sends, receive_sizes=[r + 1 + sub.rank for r in range(len(members))])
    assert [r.tolist() for r in told] == expected


def check_split_order_and_undefined(comm) -> dict:
    """MPI's rules: members ordered by (key, rank); color None gets None; the others go on without it."""
    reverse = comm.split(comm.rank % 2, key=-comm.rank)
    order = reverse.allgather_object(comm.rank)
    expected = sorted((r for r in range(comm.size) if r % 2 == comm.rank % 2), key=lambda r: -r)
    assert order == expected and reverse.rank == expected.index(comm.rank), (order, reverse.rank)
    check_ordered_collectives(reverse, expected, comm.rank)  # its ranks run against the job's order
    without_last = comm.split(None if comm.rank == 3 else 7, key=0)
    if comm.rank == 3:
        assert without_last is None
    else:
        assert without_last.size == 3
        assert without_last.allreduce(torch.ones(2)).tolist() == [3.0, 3.0]
    # a split of a sub-communicator: one group per rank of each host
    local, _ = comm.host_groups(RANKS_PER_HOST)
    alone = local.split(local.rank, key=0)
    assert (alone.rank, alone.size) == (0, 1)
    assert alone.allreduce(torch.tensor([2.5])).item() == 2.5
    for bad in (-1, 1.5, True):
        try:
            comm.split(bad)
        except ValueError:
            continue
        raise AssertionError(f"split(color={bad!r}) was accepted")
    return {"order": order}


def check_hierarchical_allreduce(comm) -> dict:
    """The three-step all-reduce gives the exact sum (values exact in float32) on every rank, for every
    op, blocking or several in flight; its byte model counts what crosses hosts."""
    hierarchical, line = make_hierarchical(comm, True, RANKS_PER_HOST)
    assert isinstance(hierarchical, HierarchicalCommunicator) and "2 hosts x 2 ranks" in line, line
    values = torch.arange(1000, dtype=torch.float32) * (comm.rank + 1)
    expected = torch.arange(1000, dtype=torch.float32) * sum(r + 1 for r in range(comm.size))
    assert torch.equal(hierarchical.allreduce(values.clone()), expected)
    assert torch.equal(hierarchical.allreduce(values.clone(), op="mean"), expected / comm.size)
    assert hierarchical.allreduce(torch.tensor([comm.rank]), op="max").item() == comm.size - 1
    assert hierarchical.allreduce(torch.tensor([comm.rank]), op="min").item() == 0
    in_flight = [hierarchical.allreduce_async(torch.full((257,), float(comm.rank * k))) for k in range(1, 4)]
    for k, handle in reversed(list(enumerate(in_flight, start=1))):
        assert handle.wait().tolist() == [float(k * sum(range(comm.size)))] * 257
    # a sum that rounds: every rank still holds the same bits (the leader's broadcast)
    noisy = torch.randn(4096, generator=torch.Generator().manual_seed(comm.rank))
    result = hierarchical.allreduce(noisy)
    assert all(torch.equal(result, other) for other in comm.allgather(result))
    flat = comm.allreduce(torch.randn(4096, generator=torch.Generator().manual_seed(comm.rank)))
    # torch.testing.assert_close would import torch.distributed.tensor: seconds per rank
    assert float((result - flat).abs().max()) <= 1e-6 * float(flat.abs().max()), (result - flat).abs().max()
    before = hierarchical.bytes_between_hosts
    hierarchical.allreduce(torch.zeros(1000))
    crossed = hierarchical.bytes_between_hosts - before
    assert crossed == (4000 if comm.rank % 2 == 0 else 0), crossed  # 2(H-1)/H * 4000 bytes, leaders only
    # the exact exchange counts what this rank sends by the hierarchical scheme, not a flat ring's 1.5 n
    from dtrain.exchange import AllReduce

    exchange = AllReduce()
    exchange.bind(hierarchical)
    exchange.begin_step()
    exchange.start("bucket", torch.ones(1000), [torch.Size([1000])]).wait()
    assert exchange.bytes_sent_last_step == (8000 if comm.rank % 2 == 0 else 4000), exchange.bytes_sent_last_step
    hierarchical.barrier()
    return {"bytes_between_hosts": crossed}


def check_uneven_hosts(comm) -> None:
    """Hosts of 3 and 1 ranks (host groups built with split, as a launcher with uneven slots would give):
    the three steps still give the exact sum on every rank."""
    host = 0 if comm.rank < 3 else 1
    local = comm.split(host, key=comm.rank)
    leaders = comm.split(0 if local.rank == 0 else None, key=host)
    hierarchical = HierarchicalCommunicator(comm, HostGroups(local, leaders), [[0, 1, 2], [3]])
    assert "2 hosts (3, 1 ranks)" in hierarchical.describe()
    values = torch.arange(100, dtype=torch.float32) * (comm.rank + 1)
    assert torch.equal(hierarchical.allreduce(values), torch.arange(100, dtype=torch.float32) * 10)
    hierarchical.barrier()


def main() -> None:
    scenario = sys.argv[1]
    backend = os.environ.get("WORKER_BACKEND", "gloo")
    timeout_s = float(os.environ.get("WORKER_TIMEOUT_S", "60"))
    if scenario == "checks":
        comm = create_communicator(backend=backend, timeout_s=timeout_s, hierarchical=False)
        install_fail_fast(comm)
        run_checks(comm, {"host_groups": check_host_groups, "sub_collectives": check_sub_collectives,
                          "split_order": check_split_order_and_undefined,
                          "hierarchical_allreduce": check_hierarchical_allreduce, "uneven_hosts": check_uneven_hosts})
        comm.finalize()
        return
    comm = create_communicator(backend=backend, timeout_s=timeout_s, hierarchical=True,
                               ranks_per_host=RANKS_PER_HOST)
    install_fail_fast(comm)
    comm.allreduce(torch.ones(8))  # every group is connected
    if comm.rank == 3:
        time.sleep(0.5)
        print(f"EVENT {time.time():.3f}", flush=True)
        if scenario == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(300)  # "stall": alive, silent
    comm.allreduce(torch.ones(8))  # rank 2 waits for rank 3 within their host; 0 and 1 for rank 2
    raise AssertionError("the hierarchical all-reduce returned without rank 3")


if __name__ == "__main__":
    main()
