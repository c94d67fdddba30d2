"""Keeping every rank's copy of the model the same: broadcast from rank 0, consistent buffers."""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from dtrain.learners._buckets import coalesced
from dtrain.learners.base import Learner


def unique_tensors(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """``tensors`` without repeats (shared or tied weights), first occurrence kept."""
    seen: set[int] = set()
    unique = []
    for tensor in tensors:
        if id(tensor) not in seen:
            seen.add(id(tensor))
            unique.append(tensor)
    return unique


def broadcast_replica(model: torch.nn.Module, optimizer: torch.optim.Optimizer, comm, bucket_bytes: int) -> None:
    """Overwrites this rank's parameters, buffers and optimizer state with rank 0's (a collective)."""
    parameters = [p for group in optimizer.param_groups for p in group["params"]]
    tensors = unique_tensors([*model.parameters(), *parameters, *model.buffers()])
    coalesced(tensors, bucket_bytes, lambda flat: comm.broadcast(flat, root=0))
    # the structure may differ (a rank that never stepped has no momentum yet), so pickle it
    state = comm.broadcast_object(optimizer.state_dict() if comm.is_main else None, root=0)
    if not comm.is_main:
        optimizer.load_state_dict(state)


def make_buffers_consistent(model: torch.nn.Module, comm, bucket_bytes: int) -> None:
    """Floating-point buffers (BatchNorm statistics) averaged over ranks, the others taken from rank 0.

    Integer buffers such as ``num_batches_tracked`` can differ when a rank had no samples in a
    minibatch and skipped its forward pass; rank 0's value is kept.
    """
    buffers = unique_tensors(model.buffers())
    floating = [buffer for buffer in buffers if buffer.is_floating_point()]
    others = [buffer for buffer in buffers if not buffer.is_floating_point()]
    coalesced(floating, bucket_bytes, lambda flat: comm.allreduce(flat, op="mean"))
    coalesced(others, bucket_bytes, lambda flat: comm.broadcast(flat, root=0))


class ReplicatedLearner(Learner):
    """A learner whose ranks step one shared model: rank 0's copy is broadcast at the start and
    whenever local steps (warm start) have let the ranks drift apart.

    Subclasses set ``self._model`` in ``prepare`` and call :meth:`_local_step` for steps without
    communication; ``bucket_bytes`` bounds the flat chunks parameters and buffers travel in.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, comm, distributed_after: int, bucket_bytes: float):
        super().__init__(optimizer, comm, distributed_after)
        self.bucket_bytes = bucket_bytes
        self._model: torch.nn.Module | None = None
        self._replicas_identical = False  # state: all ranks hold rank 0's model and optimizer state

    def _local_step(self) -> None:
        """The local learner's step; with several ranks they drift apart, so the next sync re-broadcasts."""
        super().step()
        if self.comm.size > 1:
            self._replicas_identical = False

    def _require_prepared(self) -> None:
        if self._model is None:
            raise RuntimeError(f"the {self.kind.replace('_', '-')} learner was not prepared; call "
                               f"learner.prepare(model) on every rank before the first minibatch (training_session does)")

    def synchronize(self) -> None:
        """Makes every rank hold one model (a collective; called at the same points on all ranks).

        After local steps: broadcasts rank 0's parameters, buffers and optimizer state. Otherwise
        the parameters are already identical and only buffers are made consistent: floating-point
        buffers (BatchNorm statistics) averaged over ranks, the others taken from rank 0.
        """
        if self.comm.size == 1 or self._model is None:
            return
        if not self._replicas_identical:
            self._broadcast_from_root()
            return
        make_buffers_consistent(self._model, self.comm, self.bucket_bytes)

    def _broadcast_from_root(self) -> None:
        """Overwrites this rank's parameters, buffers and optimizer state with rank 0's (a collective)."""
        broadcast_replica(self._model, self.optimizer, self.comm, self.bucket_bytes)
        self._replicas_identical = True

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores a checkpoint (rank 0's state, replicated); the next ``prepare`` or distributed step re-broadcasts."""
        super().load_state_dict(state)
        self._replicas_identical = False
