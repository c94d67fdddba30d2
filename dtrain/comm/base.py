"""The communicator protocol: a small interface named after MPI operations.

Every rank holds one :class:`Communicator`. Tensor collectives work in place on the
caller's tensor and return it, so ``comm.allreduce(grad, op="mean")`` reads like the
MPI call it stands for. Object collectives pickle, so anything sent must be picklable.
"""
from __future__ import annotations

import abc
import os
import sys
import time
from typing import Any, NoReturn

import torch

REDUCE_OPS = ("sum", "mean", "max", "min")
"""The reduction names :meth:`Communicator.allreduce` accepts."""


class AsyncHandle(abc.ABC):
    """A pending collective started by :meth:`Communicator.allreduce_async`."""

    @abc.abstractmethod
    def wait(self) -> torch.Tensor:
        """Block until the collective has finished and return its (in-place) result tensor.

        Calling ``wait`` again returns the same tensor without further work.
        Raises RuntimeError when the collective failed or timed out.
        """


class CompletedHandle(AsyncHandle):
    """An :class:`AsyncHandle` whose result is already available (size-1 and local cases)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._tensor = tensor

    def wait(self) -> torch.Tensor:
        """Return the result tensor at once."""
        return self._tensor


class Communicator(abc.ABC):
    """One process's view of the job: its place in it and the collectives between ranks.

    All collectives must be called by every rank in the same order (as in MPI);
    ``root`` arguments are global ranks.
    """

    launcher: str = "local"
    """What started this process: ``local``, ``mpi``, ``torchrun`` or ``slurm``."""

    native_all_to_all: bool = False
    """Whether :meth:`all_to_all` moves each message once (MPI's ``alltoallv``); False: the default
    built from :meth:`allgather`, N times the bytes. Exchanges choose their transport by it."""

    reduce_alone_bytes: int = 8 * 2 ** 20
    """A tensor of at least this many bytes costs less to all-reduce in a collective of its own than
    to copy into a shared buffer with others: the transport's fixed cost per collective, counted in
    bytes of copying. The data-parallel learner reduces such gradients in place. 8 MiB: Gloo on a
    loopback spends about 1 ms per extra collective, what copying 8 MiB costs on one CPU core
    (``benchmarks/allreduce_throughput.py``)."""

    # -- identity ---------------------------------------------------------------------------
    @property
    @abc.abstractmethod
    def rank(self) -> int:
        """This process's global rank, in ``[0, size)``."""

    @property
    @abc.abstractmethod
    def size(self) -> int:
        """The number of processes in the job (world size)."""

    @property
    @abc.abstractmethod
    def local_rank(self) -> int:
        """This process's rank among the processes on its node, in ``[0, local_size)``."""

    @property
    @abc.abstractmethod
    def local_size(self) -> int:
        """The number of processes on this process's node."""

    @property
    @abc.abstractmethod
    def backend(self) -> str:
        """The tensor transport: ``local``, ``gloo``, ``mpi`` or ``nccl``."""

    @property
    @abc.abstractmethod
    def device(self) -> torch.device:
        """Where this rank's tensors live: ``cuda:<local_rank>`` with NCCL, else ``cpu``."""

    @property
    def is_main(self) -> bool:
        """True on rank 0, the rank that writes logs, metrics and checkpoints."""
        return self.rank == 0

    # -- tensor collectives -----------------------------------------------------------------
    @abc.abstractmethod
    def allreduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Reduce ``tensor`` over all ranks in place and return it.

        ``op`` is one of ``sum``, ``mean`` (sum, then divide by ``size``; floating-point
        tensors only), ``max`` or ``min``. Raises ValueError for another ``op`` or for
        ``mean`` on an integer tensor.
        """

    @abc.abstractmethod
    def allreduce_async(self, tensor: torch.Tensor, op: str = "sum") -> AsyncHandle:
        """Start an in-place allreduce and return a handle; ``handle.wait()`` returns ``tensor``.

        The tensor must not be read or written until ``wait`` returns. Used to overlap
        bucketed gradient reduction with the rest of the backward pass. Same ``op``
        rules as :meth:`allreduce`.
        """

    @abc.abstractmethod
    def broadcast(self, tensor: torch.Tensor, root: int = 0) -> torch.Tensor:
        """Overwrite ``tensor`` on every rank with rank ``root``'s values; return it."""

    @abc.abstractmethod
    def allgather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Return every rank's ``tensor`` as a list indexed by rank (new tensors).

        All ranks must pass tensors of the same shape and dtype.
        """

    def all_to_all(self, sends: list[torch.Tensor], receive_sizes: list[int] | None = None) -> list[torch.Tensor]:
        """Send ``sends[j]`` to rank j and return what every rank sent this one, indexed by source rank.

        Messages are 1-D tensors of one dtype; their lengths may differ per pair of ranks (MPI's
        ``alltoallv``). Every rank must pass ``size`` tensors. ``receive_sizes`` (the lengths this
        rank will receive, by source), when the caller knows them, saves a transport the exchange
        of lengths. This default is built from
        :meth:`allgather` (each rank gathers every rank's padded messages and keeps those addressed
        to it, N times the bytes of a true all-to-all); transports with a native all-to-all
        override it.

        Raises ValueError when ``sends`` does not hold one 1-D tensor per rank.
        """
        self._check_sends(sends)
        del receive_sizes  # the gathered lengths below say the same
        sizes = torch.tensor([message.numel() for message in sends], dtype=torch.int64, device=self.device)
        all_sizes = self.allgather(sizes)  # all_sizes[src][dst]: what src sends dst
        longest = max(int(row.sum()) for row in all_sizes)
        outgoing = torch.zeros(longest, dtype=sends[0].dtype, device=self.device)
        if longest:
            outgoing[:int(sizes.sum())] = torch.cat([message.reshape(-1) for message in sends])
        gathered = self.allgather(outgoing) if longest else [outgoing] * self.size
        received = []
        for source, data in enumerate(gathered):
            row = [int(size) for size in all_sizes[source]]
            start = sum(row[:self.rank])
            received.append(data[start:start + row[self.rank]].clone())
        return received

    # -- object collectives -----------------------------------------------------------------
    @abc.abstractmethod
    def allgather_object(self, obj: Any) -> list[Any]:
        """Return every rank's picklable ``obj`` as a list indexed by rank."""

    @abc.abstractmethod
    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        """Return rank ``root``'s picklable ``obj`` on every rank (other ranks' ``obj`` is ignored)."""

    @abc.abstractmethod
    def gather_object(self, obj: Any, root: int = 0) -> list[Any] | None:
        """Collect every rank's picklable ``obj`` on ``root`` as a list indexed by rank; None elsewhere."""

    # -- control ----------------------------------------------------------------------------
    @abc.abstractmethod
    def barrier(self) -> None:
        """Block until every rank has called ``barrier``."""

    @abc.abstractmethod
    def abort(self, message: str, exit_code: int = 1) -> NoReturn:
        """End the whole job now: print ``[rank r/size] message`` to stderr and exit with ``exit_code``.

        Never returns. Under MPI every rank is killed (``MPI_Abort``); otherwise this
        process exits at once (``os._exit``) and the launcher or the peers' broken
        connections end the rest.
        """

    @abc.abstractmethod
    def finalize(self) -> None:
        """Release the transport (destroy the process group). Idempotent."""

    def __enter__(self) -> Communicator:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.finalize()

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(rank={self.rank}, size={self.size}, local_rank={self.local_rank}, "
                f"local_size={self.local_size}, backend={self.backend!r}, launcher={self.launcher!r})")

    # -- argument checks shared by every implementation ---------------------------------------
    def _check_reduce(self, tensor: torch.Tensor, op: str) -> None:
        if op not in REDUCE_OPS:
            raise ValueError(f"allreduce op={op!r} is not supported; use one of {', '.join(REDUCE_OPS)}")
        if op == "mean" and not (tensor.is_floating_point() or tensor.is_complex()):
            raise ValueError(f"allreduce op='mean' needs a floating-point tensor, got {tensor.dtype}; "
                             "use op='sum' and divide, or cast first")

    def _check_sends(self, sends: list[torch.Tensor]) -> None:
        if len(sends) != self.size or any(message.dim() != 1 for message in sends):
            raise ValueError(f"all_to_all needs one 1-D tensor per rank ({self.size}), got "
                             f"{[tuple(message.shape) for message in sends]}")
        if len({message.dtype for message in sends}) > 1:
            raise ValueError(f"all_to_all needs messages of one dtype, got {sorted({str(m.dtype) for m in sends})}")

    def _check_root(self, root: int) -> None:
        if not 0 <= root < self.size:
            raise ValueError(f"root={root} is outside [0, {self.size}); pass a global rank")


def format_rank_message(rank: int, size: int, message: str) -> str:
    """Return the one-line ``[rank r/size] message`` form used for every abort message."""
    return f"[rank {rank}/{size}] {message}"


ABORT_OUTPUT_GRACE_S = 0.25
"""Seconds between printing an abort message and calling ``MPI_Abort``."""


def terminate(line: str, exit_code: int, mpi_comm: Any = None) -> NoReturn:
    """Print ``line`` to stderr, then end the job with ``exit_code`` without any clean-up.

    ``exit_code`` outside ``1..255`` becomes 1 so an abort never reads as success.
    With ``mpi_comm`` (an mpi4py communicator) the whole MPI job is aborted; otherwise
    only this process exits (``os._exit``: no atexit handlers, no MPI_Finalize that
    could wait on ranks that will never arrive).
    """
    code = exit_code if 1 <= exit_code <= 255 else 1
    try:
        sys.stdout.flush()
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
    except Exception:  # a closed or broken stream must not stop the abort
        pass
    if mpi_comm is not None:
        # The line travels through the launcher's output forwarding while MPI_Abort's own
        # banner takes another path; a short pause lets the reason arrive first.
        time.sleep(ABORT_OUTPUT_GRACE_S)
        try:
            mpi_comm.Abort(code)
        except Exception:
            pass
    os._exit(code)


def first_line(error: BaseException | str) -> str:
    """Return the first non-blank line of an exception's message (or of a string), stripped.

    Collective errors from Gloo and NCCL carry pages of C++ context; the first line
    says what happened and keeps abort messages to one line.
    """
    for line in str(error).splitlines():
        if line.strip():
            return line.strip()
    return ""
