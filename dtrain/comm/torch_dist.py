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
                 init_method: str | None = None, mpi_comm: Any = None, launcher: str = "mpi",
                 node: str | None = None) -> None:
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
        self._job_mpi_comm = mpi_comm  # what abort() ends: always the whole job's, also in a sub-communicator
        self._job_rank, self._job_size = rank, size  # named in abort lines
        self._group: Any = None  # the process group of the collectives: None is the job's (default) group
        self._members = list(range(size))  # global rank of each rank of this communicator
        #: this communicator's rank r is rank ``_group_ranks[r]`` of ``_group`` (None: the same): a group's
        #: ranks are its members sorted, as torch.distributed numbers them, and a split's order is MPI's
        self._group_ranks: list[int] | None = None
        self._timeout_s = timeout_s
        self.launcher = launcher
        self._finalized = False
        if backend == "nccl":
            _bind_gpu(local_rank)
        dist.init_process_group(backend=backend, store=store, init_method=init_method, rank=rank,
                                world_size=size, timeout=datetime.timedelta(seconds=timeout_s))
        if local_rank is None or local_size is None:
            local_rank, local_size = _node_position(self.allgather_object(socket.gethostname()), rank)
        self._local_rank, self._local_size = local_rank, local_size
        self._gpu_index = local_rank  # cuda:<this> with NCCL; a sub-communicator keeps its parent's
        self.node_label = node or socket.gethostname()
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
        return torch.device("cuda", self._gpu_index) if self._backend == "nccl" else torch.device("cpu")

    # -- tensor collectives -----------------------------------------------------------------
    def allreduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Reduce in place over all ranks (``mean`` = sum, then divide by size); return ``tensor``."""
        return self.allreduce_async(tensor, op).wait()

    def allreduce_async(self, tensor: torch.Tensor, op: str = "sum") -> AsyncHandle:
        """Start an in-place allreduce; the handle's ``wait()`` finishes ``mean`` and returns ``tensor``."""
        self._check_reduce(tensor, op)
        work = dist.all_reduce(tensor, op=_TORCH_OPS[op], group=self._group, async_op=True)
        return _PendingReduce(work, tensor, self._size if op == "mean" else None)

    def broadcast(self, tensor: torch.Tensor, root: int = 0) -> torch.Tensor:
        """Overwrite ``tensor`` with rank ``root``'s values on every rank; return it."""
        self._check_root(root)
        dist.broadcast(tensor, group=self._group, group_src=self._group_rank(root))
        return tensor

    def reduce(self, tensor: torch.Tensor, root: int = 0, op: str = "sum") -> torch.Tensor:
        """Reduce over all ranks into ``tensor`` on rank ``root`` (``mean`` divides there); other ranks'
        ``tensor`` is left undefined (Gloo and NCCL may use it as scratch). Returns ``tensor``."""
        self._check_reduce(tensor, op)
        self._check_root(root)
        dist.reduce(tensor, op=_TORCH_OPS[op], group=self._group, group_dst=self._group_rank(root))
        if op == "mean" and self._rank == root:
            tensor.div_(self._size)
        return tensor

    def allgather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Return every rank's tensor (same shape and dtype on all ranks), indexed by rank."""
        gathered = [torch.empty_like(tensor) for _ in range(self._size)]
        dist.all_gather(gathered, tensor, group=self._group)
        return self._in_rank_order(gathered)

    def all_to_all(self, sends: list[torch.Tensor], receive_sizes: list[int] | None = None) -> list[torch.Tensor]:
        """``sends[j]`` to rank j through ``all_to_all_single`` with per-peer sizes (alltoallv).

        Gloo implements it for CPU tensors and NCCL for GPU tensors in torch 2.x; a backend
        without it falls back to :meth:`Communicator.all_to_all` (built from ``allgather``).
        Without ``receive_sizes`` the lengths are exchanged first with a small all-to-all.
        """
        self._check_sends(sends)
        group_sends = self._in_group_order(sends)
        send_sizes = [message.numel() for message in group_sends]
        if receive_sizes is None:
            size_out = torch.empty(self._size, dtype=torch.int64, device=self.device)
            try:
                dist.all_to_all_single(size_out, torch.tensor(send_sizes, dtype=torch.int64, device=self.device),
                                       group=self._group)
            except (RuntimeError, NotImplementedError):  # no all-to-all in this backend: the allgather form
                return super().all_to_all(sends)
            group_receive_sizes = [int(size) for size in size_out.tolist()]
        else:
            group_receive_sizes = self._in_group_order(list(receive_sizes))
        received = torch.empty(sum(group_receive_sizes), dtype=sends[0].dtype, device=self.device)
        dist.all_to_all_single(received, torch.cat([message.reshape(-1) for message in group_sends]),
                               output_split_sizes=group_receive_sizes, input_split_sizes=send_sizes,
                               group=self._group)
        return self._in_rank_order(list(received.split(group_receive_sizes)))

    # -- object collectives -----------------------------------------------------------------
    def allgather_object(self, obj: Any) -> list[Any]:
        """Return every rank's picklable object, indexed by rank."""
        gathered: list[Any] = [None] * self._size
        dist.all_gather_object(gathered, obj, group=self._group)
        return self._in_rank_order(gathered)

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        """Return rank ``root``'s picklable object on every rank."""
        self._check_root(root)
        box = [obj if self._rank == root else None]
        dist.broadcast_object_list(box, group=self._group, group_src=self._group_rank(root))
        return box[0]

    def gather_object(self, obj: Any, root: int = 0) -> list[Any] | None:
        """Return every rank's picklable object on ``root`` (indexed by rank); None on other ranks."""
        self._check_root(root)
        gathered: list[Any] | None = [None] * self._size if self._rank == root else None
        dist.gather_object(obj, gathered, group=self._group, group_dst=self._group_rank(root))
        return self._in_rank_order(gathered) if gathered is not None else None

    # -- sub-communicators ----------------------------------------------------------------------
    def split(self, color: int | None, key: int = 0) -> TorchDistCommunicator | None:
        """MPI's ``Comm_split``: a communicator of the ranks that pass the same ``color``, ranked by
        ``(key, rank)``; None for ``color=None`` (``MPI_UNDEFINED``). Collective: every rank calls it,
        in the same order as its other collectives. Its collectives have this communicator's timeout
        and its ``abort`` ends the whole job.

        Each group is a ``torch.distributed.new_group`` of the members' global ranks, which torch numbers
        in ascending order; the sub-communicator maps its ranks (MPI's order) onto the group's in every
        collective, so any torch 2.x behaves alike. From the job's communicator every rank creates every
        group in the same order (torch's rule); a split of a sub-communicator creates only its own group
        (``use_local_synchronization``), and refuses to create a second group of exactly the same ranks
        there (torch names such groups by their ranks). Raises ValueError for a negative ``color``."""
        plan = self._split_plan(color, key)
        groups = {}
        timeout = datetime.timedelta(seconds=self._timeout_s)
        for group_color, members in plan.items():
            global_ranks = sorted(self._members[member] for member in members)
            if self._group is None:  # every rank of the job creates every group, in color order
                groups[group_color] = dist.new_group(global_ranks, timeout=timeout)
            elif group_color == color:
                name = dist.distributed_c10d._hash_ranks_to_str(global_ranks)
                if name in dist.distributed_c10d._world.pg_names.values():
                    raise ValueError(f"split(color={color}) of a sub-communicator would create a second group of "
                                     f"ranks {global_ranks}; torch.distributed names such groups by their ranks: "
                                     "reuse the sub-communicator made first")
                groups[group_color] = dist.new_group(global_ranks, timeout=timeout, use_local_synchronization=True)
        if color is None:
            return None
        members = plan[color]
        return self._adopt(groups[color], [self._members[member] for member in members], members.index(self._rank))

    def _adopt(self, group: Any, global_ranks: list[int], rank: int) -> TorchDistCommunicator:
        """A communicator of the same class over ``group`` (whose ranks are ``global_ranks``), this
        process being its ``rank``: identity from the parent, no new transport."""
        sub = type(self).__new__(type(self))
        sub.__dict__.update(self.__dict__)
        sub.__dict__.pop("_host_groups", None)  # the parent's host groups are not the sub's
        sub._group, sub._members, sub._rank, sub._size = group, global_ranks, rank, len(global_ranks)
        in_group = sorted(global_ranks)  # torch.distributed's numbering of the group's ranks
        sub._group_ranks = None if in_group == global_ranks else [in_group.index(member) for member in global_ranks]
        sub._finalized, sub.heartbeat = False, None
        labels = self._split_labels  # node of each member, gathered by _split_plan
        same_node = [member for member in global_ranks if labels[member] == self.node_label]
        sub._local_rank, sub._local_size = same_node.index(global_ranks[rank]), len(same_node)
        return sub

    def _group_rank(self, rank: int) -> int:
        """The rank of ``_group`` that this communicator's ``rank`` is."""
        return rank if self._group_ranks is None else self._group_ranks[rank]

    def _in_rank_order(self, items: list[Any]) -> list[Any]:
        """``items`` indexed by the group's ranks, re-indexed by this communicator's."""
        return items if self._group_ranks is None else [items[index] for index in self._group_ranks]

    def _in_group_order(self, items: list[Any]) -> list[Any]:
        """``items`` indexed by this communicator's ranks, re-indexed by the group's."""
        if self._group_ranks is None:
            return items
        ordered: list[Any] = [None] * len(items)
        for rank, index in enumerate(self._group_ranks):
            ordered[index] = items[rank]
        return ordered

    def _split_plan(self, color: int | None, key: int) -> dict[int, list[int]]:
        """Every color's members (this communicator's ranks, ordered by (key, rank)), colors ascending;
        gathers each rank's node label too, for the sub-communicators' local ranks."""
        self._check_color(color)
        entries = self.allgather_object((color, int(key), self.node_label))
        self._split_labels = {self._members[rank]: label for rank, (_, _, label) in enumerate(entries)}
        plan: dict[int, list[int]] = {}
        for rank, (entry_color, entry_key, _) in sorted(enumerate(entries), key=lambda item: (item[1][1], item[0])):
            if entry_color is not None:
                plan.setdefault(entry_color, []).append(rank)
        return dict(sorted(plan.items()))

    # -- control ----------------------------------------------------------------------------
    def barrier(self) -> None:
        """Block until every rank arrives (bounded by the collective timeout)."""
        if self._backend == "nccl":
            dist.barrier(group=self._group, device_ids=[self._gpu_index])
        else:
            dist.barrier(group=self._group)

    def abort(self, message: str, exit_code: int = 1) -> NoReturn:
        """Print ``[rank r/size] message`` (the job's rank and size, also from a sub-communicator) and end the
        whole job: ``MPI_Abort`` under MPI, else ``os._exit``."""
        terminate(format_rank_message(self._job_rank, self._job_size, message), exit_code, self._job_mpi_comm)

    def finalize(self) -> None:
        """Destroy the default process group (joining Gloo's worker threads); later calls do nothing.

        A sub-communicator's finalize does nothing: its group lives until the job's communicator is
        finalized (destroying every group), as the job's ranks may still be using it."""
        if not self._finalized:
            self._finalized = True
            if self._group is not None:
                return
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
