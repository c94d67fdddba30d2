"""TorchDistCommunicator: collectives through torch.distributed (Gloo on CPU, NCCL on GPU).

The communicator owns the default process group: constructing it calls
``init_process_group`` and :meth:`finalize` destroys it. Launch details (who is rank 0,
where the rendezvous store lives) are decided by :mod:`dtrain.comm.bootstrap`.
"""
from __future__ import annotations

import contextlib

import datetime
import socket
from typing import Any, NoReturn

import torch
import torch.distributed as dist
# Imported before any process group exists: this module binds ``group.WORLD`` as a default argument
# when first imported, so importing it later (torch._dynamo does, e.g. when an optimizer is built)
# would pin the world group past destroy_process_group, and Gloo's worker threads would then die
# during interpreter shutdown (std::terminate, SIGABRT) instead of being joined in finalize().
import torch.distributed.nn.functional  # noqa: F401

from dtrain.comm.base import AsyncHandle, Communicator, format_rank_message, terminate

_TORCH_OPS = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM,
              "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


class _PendingReduce(AsyncHandle):
    """An in-flight all-reduce; ``mean`` is finished (divided) on ``wait``. ``work`` is anything whose
    ``wait()`` blocks until the reduction is done: torch.distributed's ``Work``, or an MPI request."""

    def __init__(self, work: Any, tensor: torch.Tensor, divisor: int | None) -> None:
        self._work, self._tensor, self._divisor = work, tensor, divisor

    def wait(self) -> torch.Tensor:
        """Block until the reduction is done and return the reduced tensor."""
        if self._work is not None:
            self._work.wait()
            self._work = None
            if self._divisor is not None:
                self._tensor.div_(self._divisor)
        return self._tensor


class TorchDistCommunicator(Communicator):
    """A rank of a torch.distributed job; tensors travel through Gloo (CPU) or NCCL (GPU).

    Exactly one of ``store`` (a connected ``torch.distributed.Store``) and ``init_method``
    (``env://`` or ``tcp://host:port``) says how ranks meet. ``timeout_s`` (seconds)
    bounds the rendezvous and every collective, so a rank whose peer stalls raises
    instead of hanging. ``local_rank``/``local_size`` of None are computed by gathering
    host names. ``mpi_comm`` (an mpi4py communicator), when given, is used by
    :meth:`abort` to kill the whole MPI job.

    Raises ValueError for bad ranks, sizes, backend or timeout; RuntimeError when
    torch.distributed is already initialised, or NCCL is asked for without a usable GPU.
    """

    native_all_to_all = True  # all_to_all_single with per-peer sizes

    def __init__(self, *, backend: str, rank: int, size: int, local_rank: int | None = None,
                 local_size: int | None = None, timeout_s: float = 60.0, store: Any = None,
                 init_method: str | None = None, mpi_comm: Any = None, launcher: str = "mpi") -> None:
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend={backend!r} is not a torch.distributed backend here; use 'gloo' or 'nccl'")
        if not 0 <= rank < size:
            raise ValueError(f"rank={rank} is outside [0, size={size})")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s} must be a positive number of seconds")
        if (store is None) == (init_method is None):
            raise ValueError("pass exactly one of store= and init_method= to say how ranks meet")
        if dist.is_initialized():
            raise RuntimeError("torch.distributed is already initialised in this process; "
                               "create one communicator per process, or finalize() the previous one")
        self._backend, self._rank, self._size = backend, rank, size
        self._mpi_comm = mpi_comm
        self.launcher = launcher
        self._finalized = False
        if backend == "nccl":
            _bind_gpu(local_rank)
        dist.init_process_group(backend=backend, store=store, init_method=init_method, rank=rank,
                                world_size=size, timeout=datetime.timedelta(seconds=timeout_s))
        if local_rank is None or local_size is None:
            local_rank, local_size = _node_position(self.allgather_object(socket.gethostname()), rank)
        self._local_rank, self._local_size = local_rank, local_size
        #: the running :class:`dtrain.comm.heartbeat.Heartbeat`, stopped by :meth:`finalize`
        self.heartbeat: Any = None

    @property
    def store_endpoint(self) -> tuple[str, int] | None:
        """``(host, port)`` of the job's rendezvous ``TCPStore`` (a side channel for heartbeats), or None."""
        store = dist.distributed_c10d._get_default_store() if dist.is_initialized() else None
        while store is not None and not isinstance(store, dist.TCPStore):
            store = getattr(store, "underlying_store", None)
        return (store.host, store.port) if store is not None else None

    # -- identity ---------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        """Global rank."""
        return self._rank

    @property
    def size(self) -> int:
        """World size."""
        return self._size

    @property
    def local_rank(self) -> int:
        """Rank among the processes on this node."""
        return self._local_rank

    @property
    def local_size(self) -> int:
        """Number of processes on this node."""
        return self._local_size

    @property
    def backend(self) -> str:
        """``gloo`` or ``nccl``."""
        return self._backend

    @property
    def device(self) -> torch.device:
        """``cuda:<local_rank>`` with NCCL, else ``cpu``."""
        return torch.device("cuda", self._local_rank) if self._backend == "nccl" else torch.device("cpu")

    # -- tensor collectives -----------------------------------------------------------------
    def allreduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Reduce in place over all ranks (``mean`` = sum, then divide by size); return ``tensor``."""
        return self.allreduce_async(tensor, op).wait()

    def allreduce_async(self, tensor: torch.Tensor, op: str = "sum") -> AsyncHandle:
        """Start an in-place allreduce; the handle's ``wait()`` finishes ``mean`` and returns ``tensor``."""
        self._check_reduce(tensor, op)
        work = dist.all_reduce(tensor, op=_TORCH_OPS[op], async_op=True)
        return _PendingReduce(work, tensor, self._size if op == "mean" else None)

    def broadcast(self, tensor: torch.Tensor, root: int = 0) -> torch.Tensor:
        """Overwrite ``tensor`` with rank ``root``'s values on every rank; return it."""
        self._check_root(root)
        dist.broadcast(tensor, src=root)
        return tensor

    def allgather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Return every rank's tensor (same shape and dtype on all ranks), indexed by rank."""
        gathered = [torch.empty_like(tensor) for _ in range(self._size)]
        dist.all_gather(gathered, tensor)
        return gathered

    def all_to_all(self, sends: list[torch.Tensor], receive_sizes: list[int] | None = None) -> list[torch.Tensor]:
        """``sends[j]`` to rank j through ``all_to_all_single`` with per-peer sizes (alltoallv).

        Gloo implements it for CPU tensors and NCCL for GPU tensors in torch 2.x; a backend
        without it falls back to :meth:`Communicator.all_to_all` (built from ``allgather``).
        Without ``receive_sizes`` the lengths are exchanged first with a small all-to-all.
        """
        self._check_sends(sends)
        send_sizes = [message.numel() for message in sends]
        if receive_sizes is None:
            size_out = torch.empty(self._size, dtype=torch.int64, device=self.device)
            try:
                dist.all_to_all_single(size_out, torch.tensor(send_sizes, dtype=torch.int64, device=self.device))
            except (RuntimeError, NotImplementedError):  # no all-to-all in this backend: the allgather form
                return super().all_to_all(sends)
            receive_sizes = [int(size) for size in size_out.tolist()]
        received = torch.empty(sum(receive_sizes), dtype=sends[0].dtype, device=self.device)
        dist.all_to_all_single(received, torch.cat([message.reshape(-1) for message in sends]),
                               output_split_sizes=receive_sizes, input_split_sizes=send_sizes)
        return list(received.split(receive_sizes))

    # -- object collectives -----------------------------------------------------------------
    def allgather_object(self, obj: Any) -> list[Any]:
        """Return every rank's picklable object, indexed by rank."""
        gathered: list[Any] = [None] * self._size
        dist.all_gather_object(gathered, obj)
        return gathered

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        """Return rank ``root``'s picklable object on every rank."""
        self._check_root(root)
        box = [obj if self._rank == root else None]
        dist.broadcast_object_list(box, src=root)
        return box[0]

    def gather_object(self, obj: Any, root: int = 0) -> list[Any] | None:
        """Return every rank's picklable object on ``root`` (indexed by rank); None on other ranks."""
        self._check_root(root)
        gathered: list[Any] | None = [None] * self._size if self._rank == root else None
        dist.gather_object(obj, gathered, dst=root)
        return gathered

    # -- control ----------------------------------------------------------------------------
    def barrier(self) -> None:
        """Block until every rank arrives (bounded by the collective timeout)."""
        if self._backend == "nccl":
            dist.barrier(device_ids=[self._local_rank])
        else:
            dist.barrier()

    def abort(self, message: str, exit_code: int = 1) -> NoReturn:
        """Print ``[rank r/size] message`` and end the job: ``MPI_Abort`` under MPI, else ``os._exit``."""
        terminate(format_rank_message(self._rank, self._size, message), exit_code, self._mpi_comm)

    def finalize(self) -> None:
        """Destroy the default process group (joining Gloo's worker threads); later calls do nothing."""
        if not self._finalized:
            self._finalized = True
            if dist.is_initialized():
                # no rank tears its connections down while a peer may still be using them (Gloo
                # aborts the process when a socket closes under it)
                with contextlib.suppress(Exception):
                    dist.barrier()
                if self.heartbeat is not None:  # every rank has arrived: silence is no longer a failure
                    self.heartbeat.stop()
                dist.destroy_process_group()


def _bind_gpu(local_rank: int | None) -> None:
    """Make ``cuda:local_rank`` the current device before NCCL starts (one GPU per rank)."""
    if not torch.cuda.is_available():
        raise RuntimeError("backend='nccl' needs CUDA but torch.cuda.is_available() is False; use backend='gloo'")
    if local_rank is None:
        raise RuntimeError("backend='nccl' needs the node-local rank to pick a GPU, but the launcher "
                           "did not provide one; set LOCAL_RANK or launch with mpiexec/torchrun/srun")
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise RuntimeError(f"local_rank={local_rank} has no GPU: this node has {count}; "
                           f"start at most {count} ranks per node")
    torch.cuda.set_device(local_rank)


def _node_position(hosts: list[str], rank: int) -> tuple[int, int]:
    """Return (local_rank, local_size) of ``rank`` given every rank's host name."""
    same_host = [r for r, host in enumerate(hosts) if host == hosts[rank]]
    return same_host.index(rank), len(same_host)
