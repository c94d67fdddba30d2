"""The communicator protocol: a small interface named after MPI operations.

Every rank holds one :class:`Communicator`. Tensor collectives work in place on the
caller's tensor and return it, so ``comm.allreduce(grad, op="mean")`` reads like the
MPI call it stands for. Object collectives pickle, so anything sent must be picklable.
"""
from __future__ import annotations

import abc
import os
import socket
import sys
import time
from typing import Any, NamedTuple, NoReturn

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


class HostGroups(NamedTuple):
    """A rank's two communicators of a two-level scheme (:meth:`Communicator.host_groups`)."""

    local: Communicator
    """The ranks on this rank's host; its rank 0 (the job's lowest rank there) is the host's leader."""
    leaders: Communicator | None
    """One rank per host, the hosts' leaders (ranked by host); None on the ranks that lead no host."""


class Communicator(abc.ABC):
    """One process's view of the job: its place in it and the collectives between ranks.

    All collectives must be called by every rank in the same order (as in MPI);
    ``root`` arguments are global ranks.
    """

    launcher: str = "local"
    """What started this process: ``local``, ``mpi``, ``torchrun`` or ``slurm``."""

    node_label: str | None = None
    """What the launcher calls this rank's node (ranks with the same label share a host); None: the
    host name. See :mod:`dtrain.comm.hosts`."""

    ranks_per_host: int | None = None
    """``comm.ranks_per_host`` as the job was started with (None: hosts from the launcher); what a
    two-level learner groups the ranks by unless told otherwise."""

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

    def reduce(self, tensor: torch.Tensor, root: int = 0, op: str = "sum") -> torch.Tensor:
        """Reduce ``tensor`` over all ranks onto rank ``root`` (MPI's ``Reduce``); return it.

        Only ``root``'s result is defined: other ranks' ``tensor`` may be used as scratch. Same ``op``
        rules as :meth:`allreduce`. This default is an :meth:`allreduce` (every rank gets the result);
        transports with a native reduce override it.
        """
        self._check_root(root)
        return self.allreduce(tensor, op)

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

    # -- sub-communicators ----------------------------------------------------------------------
    def split(self, color: int | None, key: int = 0) -> Communicator | None:
        """MPI's ``Comm_split`` (ChainerMN's ``split``): the ranks passing the same ``color`` form a new
        communicator, ranked by ``(key, rank)``; ``color=None`` (``MPI_UNDEFINED``) joins none and gets
        None. Collective over this communicator, in the same order as its other collectives.

        The result offers every collective of this class, with the same timeout, and its ``abort``
        ends the whole job. Its ``root`` arguments and ``rank`` count within it. Raises ValueError for
        a negative or non-integer ``color``.
        """
        raise NotImplementedError(f"{type(self).__name__} has no split()")

    def host_ranks(self, ranks_per_host: int | None = None) -> list[list[int]]:
        """This communicator's ranks grouped by host, hosts ordered by their lowest rank (collective).

        Hosts are the launcher's nodes (:attr:`node_label`, else the host name), gathered over the
        job; ``ranks_per_host`` instead makes consecutive blocks of that many ranks (to rehearse
        several hosts on one machine). Raises ValueError when ``ranks_per_host`` does not divide ``size``.
        """
        from dtrain.comm.hosts import ranks_by_block, ranks_by_label

        if ranks_per_host is not None:
            return ranks_by_block(self.size, ranks_per_host)
        return ranks_by_label(self.allgather_object(self.node_label or socket.gethostname()))

    def host_groups(self, ranks_per_host: int | None = None) -> HostGroups:
        """``(local, leaders)``: the communicator of this rank's host and, on each host's leader (its
        lowest rank), the communicator of the leaders (None elsewhere); see :class:`HostGroups`.

        Collective (two :meth:`split` calls after :meth:`host_ranks`); the same call again returns the
        same pair without communicating. Any exchange works over either: a learner may sum exactly
        within ``local`` and compress between ``leaders``.
        """
        cache = self.__dict__.setdefault("_host_groups", {})
        if ranks_per_host not in cache:
            hosts = self.host_ranks(ranks_per_host)
            host = next(index for index, ranks in enumerate(hosts) if self.rank in ranks)
            local = self.split(host, key=self.rank)
            leaders = self.split(0 if local.rank == 0 else None, key=host)
            cache[ranks_per_host] = HostGroups(local, leaders)
        return cache[ranks_per_host]

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

    def _check_color(self, color: int | None) -> None:
        if color is not None and (isinstance(color, bool) or not isinstance(color, int) or color < 0):
            raise ValueError(f"split color={color!r}: expected a non-negative int, or None to join no group")

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
