"""N ranks of one job simulated as N threads, for unit tests of the distributed learners.

``FakeWorld(size).run(work)`` calls ``work(comm)`` in one thread per rank; each ``FakeComm``
meets the others at a barrier for every collective, so a learner's real collective code runs
end to end without ``torch.distributed``. Every collective is an all-gather through shared slots.
"""
from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from dtrain.comm.base import Communicator, CompletedHandle


class FakeWorld:
    """N communicators for N threads; every collective is an all-gather through shared slots."""

    def __init__(self, size: int, devices: Sequence[str | torch.device] = ("cpu",)):
        self.size = size
        # where each rank's tensors live (the last one for the ranks past the list); the GPU tests put one
        # rank on CUDA, since autograd runs every CUDA backward of a process in one shared device thread
        self.devices = [torch.device(devices[min(rank, len(devices) - 1)]) for rank in range(size)]
        self.barrier = threading.Barrier(size, timeout=60)
        self.slots: list[Any] = [None] * size

    def gather(self, rank: int, item: Any) -> list[Any]:
        self.slots[rank] = item
        self.barrier.wait()
        items = list(self.slots)
        self.barrier.wait()  # nobody refills the slots before everyone has read them
        return items

    def run(self, work: Callable[["FakeComm"], Any]) -> list[Any]:
        """Run ``work(comm)`` in one thread per rank; return the results by rank (re-raising failures)."""
        results: list[Any] = [None] * self.size
        errors: list[BaseException] = []

        def target(rank: int) -> None:
            try:
                results[rank] = work(FakeComm(self, rank))
            except BaseException as error:  # noqa: BLE001 - reported below
                errors.append(error)
                self.barrier.abort()  # let the other threads leave their barrier

        threads = [threading.Thread(target=target, args=(rank,)) for rank in range(self.size)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        if errors:
            raise errors[0]
        return results


class FakeComm:
    """The part of the Communicator interface the learners use; counts its all-reduces."""

    backend = "threads"  # the start-up line names it, as it names gloo or nccl
    reduce_alone_bytes = Communicator.reduce_alone_bytes  # the in-place threshold of Gloo and NCCL

    def __init__(self, world: FakeWorld, rank: int):
        self.world, self.rank, self.size = world, rank, world.size
        self.device = world.devices[rank]
        self.allreduce_calls = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def allgather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        return [item.to(self.device, copy=True) for item in self.world.gather(self.rank, tensor.clone())]

    def allreduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        self.allreduce_calls += 1
        gathered = torch.stack(self.allgather(tensor))
        if op in ("max", "min"):
            tensor.copy_(gathered.amax(0) if op == "max" else gathered.amin(0))
            return tensor
        total = gathered.sum(0)
        tensor.copy_(total / self.size if op == "mean" else total)
        return tensor

    def allreduce_async(self, tensor: torch.Tensor, op: str = "sum") -> CompletedHandle:
        return CompletedHandle(self.allreduce(tensor, op))

    def broadcast(self, tensor: torch.Tensor, root: int = 0) -> torch.Tensor:
        tensor.copy_(self.allgather(tensor)[root])
        return tensor

    def allgather_object(self, obj: Any) -> list[Any]:
        # copies, as a real all-gather gives: ranks must not share each other's objects
        return copy.deepcopy(self.world.gather(self.rank, obj))

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        # a copy, as a real broadcast gives: ranks must not share the root's tensors
        return copy.deepcopy(self.world.gather(self.rank, obj)[root])
