"""LocalCommunicator: the size-1 reference every distributed communicator must agree with."""
from __future__ import annotations

import pickle

import pytest
import torch

from dtrain.comm import REDUCE_OPS, Communicator, LocalCommunicator


@pytest.fixture
def comm() -> LocalCommunicator:
    return LocalCommunicator()


def test_identity(comm: LocalCommunicator) -> None:
    assert isinstance(comm, Communicator)
    assert (comm.rank, comm.size, comm.local_rank, comm.local_size) == (0, 1, 0, 1)
    assert comm.is_main and comm.backend == "local" and comm.launcher == "local"
    assert comm.device == torch.device("cpu")
    assert LocalCommunicator(device="cuda:0", launcher="mpi").device == torch.device("cuda:0")
    assert "rank=0, size=1" in repr(comm)


@pytest.mark.parametrize("op", REDUCE_OPS)
def test_allreduce_is_in_place_identity(comm: LocalCommunicator, op: str) -> None:
    tensor = torch.tensor([1.5, -2.0])
    assert comm.allreduce(tensor, op=op) is tensor
    assert tensor.tolist() == [1.5, -2.0]
    handle = comm.allreduce_async(tensor, op=op)
    assert handle.wait() is tensor and handle.wait() is tensor


def test_allreduce_rejects_unknown_op_and_integer_mean(comm: LocalCommunicator) -> None:
    with pytest.raises(ValueError, match=r"op='avg'.*sum, mean, max, min"):
        comm.allreduce(torch.ones(2), op="avg")
    with pytest.raises(ValueError, match="op='mean' needs a floating-point tensor, got torch.int64"):
        comm.allreduce_async(torch.ones(2, dtype=torch.int64), op="mean")
    assert comm.allreduce(torch.ones(2, dtype=torch.int64), op="sum").tolist() == [1, 1]


def test_broadcast_and_allgather(comm: LocalCommunicator) -> None:
    tensor = torch.arange(3.0)
    assert comm.broadcast(tensor, root=0) is tensor
    gathered = comm.allgather(tensor)
    assert len(gathered) == 1 and torch.equal(gathered[0], tensor)
    gathered[0].add_(1)  # a new tensor, as a real allgather returns
    assert tensor.tolist() == [0.0, 1.0, 2.0]


def test_object_collectives_copy_through_pickle(comm: LocalCommunicator) -> None:
    payload = {"step": 3, "names": ["a"]}
    gathered = comm.allgather_object(payload)
    assert gathered == [payload] and gathered[0] is not payload
    assert comm.gather_object(payload, root=0) == [payload]
    assert comm.broadcast_object(payload, root=0) is payload
    unpicklable = (pickle.PicklingError, AttributeError, TypeError)
    with pytest.raises(unpicklable):  # what would fail on two ranks fails on one
        comm.allgather_object(lambda: None)
    with pytest.raises(unpicklable):
        comm.broadcast_object(lambda: None)


@pytest.mark.parametrize("call", ["broadcast", "broadcast_object", "gather_object"])
def test_root_must_be_a_rank(comm: LocalCommunicator, call: str) -> None:
    argument = torch.ones(1) if call == "broadcast" else "x"
    with pytest.raises(ValueError, match=r"root=1 is outside \[0, 1\)"):
        getattr(comm, call)(argument, root=1)


def test_barrier_finalize_and_context_manager() -> None:
    with LocalCommunicator() as comm:
        comm.barrier()
        comm.finalize()
    comm.finalize()  # idempotent


def test_abort_prints_one_line_and_exits(comm: LocalCommunicator, monkeypatch, capsys) -> None:
    exits = []

    def fake_exit(code: int) -> None:
        exits.append(code)
        raise SystemExit(code)

    monkeypatch.setattr("os._exit", fake_exit)
    with pytest.raises(SystemExit):
        comm.abort("disk full", exit_code=3)
    assert capsys.readouterr().err == "[rank 0/1] disk full\n"
    with pytest.raises(SystemExit):
        comm.abort("bad code", exit_code=0)  # an abort never reports success
    assert exits == [3, 1]


# -- the reference agrees with the real communicator on a world of one --------------------------------
@pytest.fixture
def gloo_world_of_one():
    import torch.distributed as dist

    from dtrain.comm import TorchDistCommunicator

    comm = TorchDistCommunicator(backend="gloo", rank=0, size=1, store=dist.HashStore(), timeout_s=10,
                                 launcher="local")
    yield comm
    comm.finalize()
    comm.finalize()  # idempotent
    assert not dist.is_initialized()


def test_torch_dist_world_of_one_matches_local(gloo_world_of_one) -> None:
    local = LocalCommunicator()
    for comm in (local, gloo_world_of_one):
        assert (comm.rank, comm.size, comm.local_rank, comm.local_size) == (0, 1, 0, 1)
        assert comm.device == torch.device("cpu")
        for op in REDUCE_OPS:
            tensor = torch.tensor([2.0, -1.0])
            assert comm.allreduce(tensor, op=op) is tensor and tensor.tolist() == [2.0, -1.0]
            assert comm.allreduce_async(tensor, op=op).wait().tolist() == [2.0, -1.0]
        assert [t.tolist() for t in comm.allgather(torch.ones(2))] == [[1.0, 1.0]]
        assert comm.allgather_object({"a": 1}) == [{"a": 1}]
        assert comm.broadcast_object("x") == "x" and comm.gather_object(5) == [5]
        comm.barrier()
    with pytest.raises(ValueError, match="op='mean' needs a floating-point tensor"):
        gloo_world_of_one.allreduce(torch.ones(1, dtype=torch.int32), op="mean")


def test_torch_dist_rejects_second_initialisation(gloo_world_of_one) -> None:
    import torch.distributed as dist

    from dtrain.comm import TorchDistCommunicator

    with pytest.raises(RuntimeError, match="already initialised"):
        TorchDistCommunicator(backend="gloo", rank=0, size=1, store=dist.HashStore())


@pytest.mark.parametrize("kwargs, match", [
    ({"backend": "mpi"}, "backend='mpi' is not a torch.distributed backend"),
    ({"rank": 2}, r"rank=2 is outside \[0, size=2\)"),
    ({"timeout_s": -1}, "timeout_s=-1 must be a positive"),
    ({"init_method": "env://"}, "exactly one of store= and init_method="),
])
def test_torch_dist_validates_arguments(kwargs: dict, match: str) -> None:
    import torch.distributed as dist

    from dtrain.comm import TorchDistCommunicator

    arguments = {"backend": "gloo", "rank": 0, "size": 2, "store": dist.HashStore(), **kwargs}
    with pytest.raises(ValueError, match=match):
        TorchDistCommunicator(**arguments)
