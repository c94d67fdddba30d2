"""Flat copies of a list of tensors: packed into one 1-D tensor and back, broadcast coalesced, copied to the
host (the block learners' parameter snapshots, deltas and checkpoints)."""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from dtrain.learners._buckets import coalesced


def cpu_copy(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """A detached host copy of ``tensor`` (``None`` stays ``None``), for a checkpoint."""
    return None if tensor is None else tensor.detach().cpu().clone()


def pack(tensors: Sequence[torch.Tensor], flat: torch.Tensor) -> None:
    """Copies ``tensors`` one after another into the 1-D ``flat`` (casting to its dtype)."""
    offset = 0
    with torch.no_grad():
        for tensor in tensors:
            count = tensor.numel()
            flat[offset:offset + count].copy_(tensor.reshape(-1))
            offset += count


def unpack(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copies consecutive slices of the 1-D ``flat`` back into ``tensors`` (casting to theirs)."""
    offset = 0
    with torch.no_grad():
        for tensor in tensors:
            count = tensor.numel()
            tensor.copy_(flat[offset:offset + count].view_as(tensor))
            offset += count


def broadcast(tensors: Sequence[torch.Tensor], comm) -> None:
    """Overwrites ``tensors`` with rank 0's values: one broadcast per dtype, not one per tensor."""
    coalesced(tensors, math.inf, lambda flat: comm.broadcast(flat, root=0))


__all__ = ["broadcast", "cpu_copy", "pack", "unpack"]
