"""``ReplicatedLearner``: the public base for learners whose ranks train one shared model.

Write a learner of your own by subclassing it and implementing ``distributed_update``; see
``docs/writing-a-learner.md`` for the contract and a complete Local-SGD example. The helpers
here keep every rank's copy of the model the same: broadcast from rank 0, consistent buffers.
"""
from __future__ import annotations

import abc
from collections.abc import Iterable
from typing import Any

import torch

from dtrain.learners._buckets import BYTES_PER_MB, coalesced
from dtrain.learners.base import Learner
from dtrain.learners.settings import BUCKETS
from dtrain.rules import check_settings


def unique_tensors(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """``tensors`` without repeats (shared or tied weights), first occurrence kept."""
    seen: set[int] = set()
    unique = []
    for tensor in tensors:
        if id(tensor) not in seen:
            seen.add(id(tensor))
            unique.append(tensor)
    return unique


def broadcast_replica(model: torch.nn.Module, optimizer: torch.optim.Optimizer, comm, bucket_bytes: float) -> None:
    """Overwrites this rank's parameters, buffers and optimizer state with rank 0's (a collective)."""
    parameters = [p for group in optimizer.param_groups for p in group["params"]]
    tensors = unique_tensors([*model.parameters(), *parameters, *model.buffers()])
    coalesced(tensors, bucket_bytes, lambda flat: comm.broadcast(flat, root=0))
    # the structure may differ (a rank that never stepped has no momentum yet), so pickle it
    state = comm.broadcast_object(optimizer.state_dict() if comm.is_main else None, root=0)
    if not comm.is_main:
        optimizer.load_state_dict(state)


def make_buffers_consistent(model: torch.nn.Module, comm, bucket_bytes: float) -> None:
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
    """A learner whose ranks step one shared model; subclass it to write your own distributed learner.

    What the base does, so a subclass does not have to:

    * ``prepare(model)`` keeps the model as ``self.model`` and broadcasts rank 0's parameters,
      buffers and optimizer state, so every rank starts from one model;
    * the warm start: while ``samples_seen < distributed_after`` (or with one process) each
      minibatch is a local step (:meth:`local_update`: the optimizer alone, no communication);
      at the first distributed minibatch after local steps, rank 0's model and optimizer state
      are broadcast again (the ranks drifted apart while stepping alone);
    * ``synchronize()`` (called by the session before cross-validation, checkpoints and the end
      of training) makes buffers consistent: floating-point ones averaged, others from rank 0;
    * ``step()`` (final, in :class:`Learner`) advances ``samples_seen`` after every update, so
      training stops at ``max_samples`` whatever the subclass does.

    A subclass implements :meth:`distributed_update` (the update of one distributed minibatch)
    and sets ``kind`` (the name written into checkpoints). If its ranks' parameters may differ
    between minibatches (as in Local SGD), it also overrides :meth:`synchronize` to bring them
    to one model.

    Args:
        optimizer: the torch optimizer of the model's parameters.
        comm: the job's communicator (a size-1 local one when omitted).
        distributed_after: global samples of local-only training before distributed updates begin.
        bucket_size_mb: parameters and buffers travel in flat chunks of at most this many MiB.

    Raises:
        ValueError: ``distributed_after`` or ``bucket_size_mb`` out of range.
        TypeError: ``optimizer`` is not a torch optimizer.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, comm=None, distributed_after: int = 0,
                 bucket_size_mb: float = 25.0):
        super().__init__(optimizer, comm, distributed_after)
        check_settings(BUCKETS, bucket_size_mb=bucket_size_mb)
        self.bucket_size_mb = float(bucket_size_mb)
        self.bucket_bytes = self.bucket_size_mb * BYTES_PER_MB
        self.model: torch.nn.Module | None = None
        self._replicas_identical = False  # state: all ranks hold rank 0's model and optimizer state

    # -- what a subclass implements ------------------------------------------------------------
    @abc.abstractmethod
    def distributed_update(self) -> None:
        """The update of one distributed minibatch (several processes, past ``distributed_after``).

        Called with this rank's gradient of its LOCAL mean loss over ``local_samples`` in
        ``.grad``; ``global_samples`` is the whole minibatch (the same on every rank, so a
        decision made from it is the same everywhere). It must issue the same collectives in the
        same order on every rank. It must not change ``samples_seen`` (``step`` does).
        """

    # -- the template --------------------------------------------------------------------------
    def prepare(self, model: torch.nn.Module) -> None:
        """Keeps ``model`` and broadcasts rank 0's parameters, buffers and optimizer state.

        A collective: every rank calls it once before training. Does nothing else with one rank.
        """
        self.model = model
        if self.comm.size > 1:
            self._broadcast_from_root()

    def begin_minibatch(self, local_samples: int, global_samples: int) -> None:
        """Clears gradients and records sample counts; at the first distributed minibatch after
        local steps, first broadcasts rank 0's model and optimizer state (a collective).

        Raises:
            RuntimeError: several processes and ``prepare(model)`` was not called.
        """
        super().begin_minibatch(local_samples, global_samples)
        if self.comm.size > 1:
            self._require_prepared()
        if self.is_distributed() and not self._replicas_identical:
            self._broadcast_from_root()

    def apply_update(self) -> None:
        """:meth:`distributed_update` when distributed, else :meth:`local_update`."""
        if self.is_distributed():
            self.distributed_update()
        else:
            self.local_update()

    def local_update(self) -> None:
        """The local learner's update: ``optimizer.step()`` on this rank's own gradient.

        With several ranks they drift apart, so the next distributed minibatch (or
        ``synchronize``) re-broadcasts rank 0's model.
        """
        if self.local_samples > 0:
            self._step_optimizer()
        if self.comm.size > 1:
            self._replicas_identical = False

    def synchronize(self) -> None:
        """Makes every rank hold one model (a collective; called at the same points on all ranks).

        After local steps: broadcasts rank 0's parameters, buffers and optimizer state. Otherwise
        the parameters are already identical and only buffers are made consistent: floating-point
        buffers (BatchNorm statistics) averaged over ranks, the others taken from rank 0.
        """
        if self.comm.size == 1 or self.model is None:
            return
        if not self._replicas_identical:
            self._broadcast_from_root()
            return
        make_buffers_consistent(self.model, self.comm, self.bucket_bytes)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores a checkpoint (rank 0's state, replicated); the next ``prepare`` or distributed step re-broadcasts."""
        super().load_state_dict(state)
        self._replicas_identical = False

    # -- helpers -------------------------------------------------------------------------------
    def _require_prepared(self) -> None:
        if self.model is None:
            raise RuntimeError(f"the {self.kind.replace('_', '-')} learner was not prepared; call "
                               f"learner.prepare(model) on every rank before the first minibatch (training_session does)")

    def _broadcast_from_root(self) -> None:
        """Overwrites this rank's parameters, buffers and optimizer state with rank 0's (a collective)."""
        broadcast_replica(self.model, self.optimizer, self.comm, self.bucket_bytes)
        self._replicas_identical = True


__all__ = ["ReplicatedLearner", "broadcast_replica", "make_buffers_consistent", "unique_tensors"]
