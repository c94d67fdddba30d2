"""MPICommunicator: CPU tensors through MPI (mpi4py), everything else through a Gloo process group.

Under ``mpiexec`` on one node, Open MPI moves a tensor between ranks through shared memory; Gloo
goes through the loopback TCP stack. For the all-reduce of a 3.8 MB gradient bucket between two
ranks that is about 0.6 ms against 7 ms (``benchmarks/allreduce_throughput.py --backend mpi``), which
is most of what a data-parallel step spends communicating on a CPU node. This communicator sends
the tensor collectives of the training loop (all-reduce, broadcast, all-gather of float and
integer CPU tensors) through MPI and keeps the Gloo group for the rest: object collectives, the
all-to-all, barriers, tensors of dtypes MPI has no reduction for (bf16, fp16, bool) and the
rendezvous store the heartbeat uses.

Each rank issues the collectives of both transports in the same program order, so the two never
wait on each other. MPI collectives have no timeout of their own: a wait longer than the
communicator's ``timeout_s`` ends the job (:class:`_WaitWatch`), as Gloo's timeout does; a rank
that dies ends it through ``mpiexec`` and :func:`dtrain.comm.install_fail_fast`, one that stops
through the heartbeat.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from dtrain.comm.base import AsyncHandle
from dtrain.comm.torch_dist import TorchDistCommunicator, _PendingReduce

_MPI_DTYPES = (torch.float32, torch.float64, torch.int32, torch.int64, torch.uint8, torch.int8)
"""CPU dtypes sent through MPI; numpy (and so mpi4py) has them all, with MPI reductions for each."""


class _WaitWatch:
    """Ends the job when one wait inside MPI lasts longer than ``timeout_s`` (MPI has no timeout).

    The hot path only stamps when a wait begins and clears the stamp when it ends; a daemon thread,
    started with the first wait, looks at the stamp every ``min(1, timeout_s / 10)`` seconds and
    calls ``on_timeout(message)``, which must end the job, as Gloo's collective timeout does.
    """

    def __init__(self, timeout_s: float, on_timeout: Callable[[str], None]) -> None:
        self.timeout_s = timeout_s
        self._on_timeout = on_timeout
        self._since: float | None = None  # state: when the current wait began (monotonic), None between waits
        self._what = ""                   # state: the collective waited for, for the message
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    def begin(self, what: str) -> None:
        """A wait for ``what`` (a collective's name) begins."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="dtrain-mpi-wait-watch", daemon=True)
            self._thread.start()
        self._what = what
        self._since = time.monotonic()

    def end(self) -> None:
        """The wait is over."""
        self._since = None

    def stop(self) -> None:
        """Stops the thread (no wait may begin afterwards)."""
        self._stopped.set()
        if self._thread is not None:
            self._thread.join()

    def _watch(self) -> None:
        while not self._stopped.wait(min(1.0, self.timeout_s / 10)):
            since = self._since
            if since is not None and time.monotonic() - since > self.timeout_s:
                self._on_timeout(f"RuntimeError: MPI {self._what} timed out: no answer from the other ranks for "
                                 f"{self.timeout_s:g} s (comm.timeout_s); a rank has stopped calling collectives")
                return


class _WatchedRequest:
    """An MPI request whose ``wait()`` is watched (:class:`_WaitWatch`): what ``_PendingReduce`` waits on."""

    def __init__(self, request: Any, watch: _WaitWatch) -> None:
        self._request, self._watch = request, watch

    def wait(self) -> None:
        """Block until the request completes."""
        self._watch.begin("all-reduce")
        self._request.Wait()
        self._watch.end()


class MPICommunicator(TorchDistCommunicator):
    """A rank of an ``mpiexec`` job whose CPU tensor collectives go through MPI (``backend="mpi"``).

    Takes :class:`TorchDistCommunicator`'s arguments (its process group is Gloo) and ``mpi_comm``,
    the mpi4py communicator of the job's ranks (``MPI.COMM_WORLD``, in rank order). ``timeout_s``
    bounds every collective of both transports: an MPI wait longer than that ends the job.
    """

    reduce_alone_bytes = 2 ** 20
    """1 MiB: an MPI collective through shared memory costs tens of microseconds, so a gradient of 1 MiB
    or more is reduced in place rather than copied into a bucket (with 4.2 MB gradients the learner's
    path took 12.2 ms in place against 17.8 ms packed, ``benchmarks/allreduce_throughput.py``)."""

    def __init__(self, *, mpi_comm: Any, timeout_s: float = 60.0, **kwargs: Any) -> None:
        super().__init__(backend="gloo", mpi_comm=mpi_comm, timeout_s=timeout_s, **kwargs)
        from mpi4py import MPI  # initialised already: the launcher's bootstrap imported it

        self._mpi = MPI
        self._ops = {"sum": MPI.SUM, "mean": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}
        self._watch = _WaitWatch(timeout_s, self.abort)

    @property
    def backend(self) -> str:
        """``mpi``."""
        return "mpi"

    def _through_mpi(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cpu" and tensor.dtype in _MPI_DTYPES and tensor.is_contiguous()

    # -- tensor collectives -----------------------------------------------------------------
    def allreduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Reduce in place over all ranks (``mean`` = sum, then divide by size); return ``tensor``."""
        self._check_reduce(tensor, op)
        if not self._through_mpi(tensor):
            return super().allreduce(tensor, op)
        self._watch.begin("all-reduce")
        self._mpi_comm.Allreduce(self._mpi.IN_PLACE, tensor.detach().numpy(), op=self._ops[op])
        self._watch.end()
        if op == "mean":
            tensor.div_(self._size)
        return tensor

    def allreduce_async(self, tensor: torch.Tensor, op: str = "sum") -> AsyncHandle:
        """Start an in-place allreduce (``MPI_Iallreduce``); the handle's ``wait()`` returns ``tensor``."""
        self._check_reduce(tensor, op)
        if not self._through_mpi(tensor):
            return super().allreduce_async(tensor, op)
        request = self._mpi_comm.Iallreduce(self._mpi.IN_PLACE, tensor.detach().numpy(), op=self._ops[op])
        return _PendingReduce(_WatchedRequest(request, self._watch), tensor, self._size if op == "mean" else None)

    def reduce(self, tensor: torch.Tensor, root: int = 0, op: str = "sum") -> torch.Tensor:
        """Reduce over all ranks into ``tensor`` on rank ``root`` (``MPI_Reduce``; ``mean`` divides there);
        other ranks' ``tensor`` is left as it was. Returns ``tensor``."""
        self._check_reduce(tensor, op)
        self._check_root(root)
        if not self._through_mpi(tensor):
            return super().reduce(tensor, root, op)
        buffer = tensor.detach().numpy()
        self._watch.begin("reduce")
        if self._rank == root:
            self._mpi_comm.Reduce(self._mpi.IN_PLACE, buffer, op=self._ops[op], root=root)
        else:
            self._mpi_comm.Reduce(buffer, None, op=self._ops[op], root=root)
        self._watch.end()
        if op == "mean" and self._rank == root:
            tensor.div_(self._size)
        return tensor

    def broadcast(self, tensor: torch.Tensor, root: int = 0) -> torch.Tensor:
        """Overwrite ``tensor`` with rank ``root``'s values on every rank; return it."""
        self._check_root(root)
        if not self._through_mpi(tensor):
            return super().broadcast(tensor, root)
        self._watch.begin("broadcast")
        self._mpi_comm.Bcast(tensor.detach().numpy(), root=root)
        self._watch.end()
        return tensor

    def allgather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Return every rank's tensor (same shape and dtype on all ranks), indexed by rank."""
        if not self._through_mpi(tensor):
            return super().allgather(tensor)
        gathered = torch.empty((self._size, *tensor.shape), dtype=tensor.dtype)
        self._watch.begin("all-gather")
        self._mpi_comm.Allgather(tensor.detach().numpy(), gathered.numpy())
        self._watch.end()
        return list(gathered.unbind(0))

    def split(self, color: int | None, key: int = 0) -> MPICommunicator | None:
        """MPI's ``Comm_split`` on both transports: the Gloo sub-group (:meth:`TorchDistCommunicator.split`)
        and ``MPI_Comm_split`` for the tensors, with the same members in the same order. Collective."""
        sub = super().split(color, key)
        mpi_sub = self._mpi_comm.Split(self._mpi.UNDEFINED if color is None else color, key)
        if sub is None:
            return None
        if (mpi_sub.Get_rank(), mpi_sub.Get_size()) != (sub.rank, sub.size):  # an invariant of both rules
            raise RuntimeError(f"MPI's split gives rank {mpi_sub.Get_rank()} of {mpi_sub.Get_size()}, "
                               f"torch.distributed's rank {sub.rank} of {sub.size}")
        sub._mpi_comm = mpi_sub
        sub._watch = _WaitWatch(self._watch.timeout_s, sub.abort)
        return sub

    def finalize(self) -> None:
        """Stops the wait watch, then destroys the Gloo group (see :meth:`TorchDistCommunicator.finalize`)."""
        self._watch.stop()
        super().finalize()


__all__ = ["MPICommunicator"]
