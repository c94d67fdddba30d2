"""The full-precision strategy: a plain SUM all-reduce through the communicator (today's default)."""
from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from dtrain.comm.base import AsyncHandle
from dtrain.exchange.base import Exchange, full_precision_allreduce_bytes


class AllReduce(Exchange):
    """Sums in place with ``comm.allreduce_async`` (no compression, no state); overlaps naturally."""

    name = "allreduce"

    def start(self, key: Hashable, flat: torch.Tensor, shapes: Sequence[torch.Size]) -> AsyncHandle:
        """Launches the asynchronous all-reduce of ``flat`` and counts its bytes: a ring all-reduce's, or what
        a communicator with its own algorithm says it sends (``allreduce_bytes_sent``, the hierarchical one)."""
        bytes_sent = getattr(self.comm, "allreduce_bytes_sent", None)
        if bytes_sent is not None:
            sent = bytes_sent(flat.numel() * flat.element_size())
        else:
            sent = full_precision_allreduce_bytes(flat.numel(), self.comm.size) * flat.element_size() // 4
        self.bytes_sent_last_step += sent
        self.full_precision_bytes_last_step += full_precision_allreduce_bytes(flat.numel(), self.comm.size)
        return self.comm.allreduce_async(flat, op="sum")


__all__ = ["AllReduce"]
