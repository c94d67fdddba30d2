"""Keeping every rank's copy of the model the same: broadcast from rank 0, consistent buffers."""
from __future__ import annotations

from collections.abc import Iterable

import torch

from dtrain.learners._buckets import coalesced


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
