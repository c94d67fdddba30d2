"""LocalCommunicator: the size-1 reference implementation.

Every collective is the identity, written so that its result has exactly the shape the
distributed version would give (lists indexed by rank, new tensors from ``allgather``,
pickled round trips for objects). It never touches MPI or torch.distributed process
groups, so single-process runs start fast and cannot hang.
"""
from __future__ import annotations

import pickle
from typing import Any, NoReturn

import torch

from dtrain.comm.base import AsyncHandle, Communicator, CompletedHandle, format_rank_message, terminate


class LocalCommunicator(Communicator):
    """A job of one process: rank 0 of size 1.

    ``device`` is where this process's tensors should live (``cpu`` by default;
    :func:`dtrain.comm.create_communicator` passes ``cuda:0`` when CUDA is used).
    ``launcher`` records what started the process (``local``, or ``mpi``/``torchrun``/
    ``slurm`` for a one-process launch).
    """

    def __init__(self, device: torch.device | str = "cpu", launcher: str = "local") -> None:
        self._device = torch.device(device)
        self.launcher = launcher

    @property
    def rank(self) -> int:
        """Always 0."""
        return 0

    @property
    def size(self) -> int:
        """Always 1."""
        return 1

    @property
    def local_rank(self) -> int:
        """Always 0."""
        return 0

    @property
    def local_size(self) -> int:
        """Always 1."""
        return 1

    @property
    def backend(self) -> str:
        """Always ``local``."""
        return "local"

    @property
    def device(self) -> torch.device:
        """The device given at construction."""
        return self._device

    def allreduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Return ``tensor`` unchanged (the reduction of one value is that value)."""
        self._check_reduce(tensor, op)
        return tensor

    def allreduce_async(self, tensor: torch.Tensor, op: str = "sum") -> AsyncHandle:
        """Return a handle whose ``wait()`` gives ``tensor`` unchanged."""
        self._check_reduce(tensor, op)
        return CompletedHandle(tensor)

    def reduce(self, tensor: torch.Tensor, root: int = 0, op: str = "sum") -> torch.Tensor:
        """Return ``tensor`` unchanged; ``root`` must be 0."""
        self._check_reduce(tensor, op)
        self._check_root(root)
        return tensor

    def split(self, color: int | None, key: int = 0) -> LocalCommunicator | None:
        """A communicator of this one process (MPI's ``Comm_split`` of one rank); None for ``color=None``."""
        self._check_color(color)
        return None if color is None else LocalCommunicator(self._device, self.launcher)

    def broadcast(self, tensor: torch.Tensor, root: int = 0) -> torch.Tensor:
        """Return ``tensor`` unchanged; ``root`` must be 0."""
        self._check_root(root)
        return tensor

    def allgather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Return ``[copy of tensor]`` (a new tensor, as the distributed version gives)."""
        return [tensor.clone()]

    def all_to_all(self, sends: list[torch.Tensor], receive_sizes: list[int] | None = None) -> list[torch.Tensor]:
        """Return ``[copy of sends[0]]``: the one message this rank sends itself."""
        self._check_sends(sends)
        return [sends[0].clone()]

    def allgather_object(self, obj: Any) -> list[Any]:
        """Return ``[copy of obj]``, copied through pickle like the distributed version."""
        return [_pickle_round_trip(obj)]

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        """Return ``obj`` itself (the root keeps its object); raises if it cannot be pickled."""
        self._check_root(root)
        pickle.dumps(obj)  # fail here, not only when the job first runs on two ranks
        return obj

    def gather_object(self, obj: Any, root: int = 0) -> list[Any] | None:
        """Return ``[copy of obj]`` (this process is the root), copied through pickle."""
        self._check_root(root)
        return [_pickle_round_trip(obj)]

    def barrier(self) -> None:
        """Return at once."""

    def abort(self, message: str, exit_code: int = 1) -> NoReturn:
        """Print ``[rank 0/1] message`` to stderr and exit the process with ``exit_code``."""
        terminate(format_rank_message(0, 1, message), exit_code)

    def finalize(self) -> None:
        """Nothing to release."""


def _pickle_round_trip(obj: Any) -> Any:
    return pickle.loads(pickle.dumps(obj))
