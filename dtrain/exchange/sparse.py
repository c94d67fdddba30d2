"""SparseLoCo's exchange: chunked top-k of what a rank has to send, in k-bit values, with decaying error feedback.

Sarfi et al. 2025 ("Communication Efficient LLM Pre-training with SparseLoCo", arXiv 2508.15706; code:
tplr-ai/SparseLoCo). Each rank keeps an error-feedback buffer ``e`` per key. Per exchange of its values ``x``:

1. ``e <- decay * e + x``;
2. each chunk of ``chunk_size`` values of ``e`` keeps its ``top_k`` largest by magnitude, quantized to ``num_bits``
   (:mod:`dtrain.compress.sparse`): ``x_hat``;
3. ``e <- e - x_hat`` (what was not sent, or sent rounded, waits for later);
4. every rank's ``x_hat`` is all-gathered as bytes, decoded and summed in rank order, so every rank holds the same
   sum to the bit.

With a block learner the values are the model changes and the sum goes to the outer optimizer: SparseLoCo's own
update is ``learner=sparseloco`` (DiLoCo's blocks, this exchange with ``decay`` 0.95, and an outer SGD without
momentum: the decaying buffer stands in for DiLoCo's outer momentum). Bytes: each rank sends its message to the
``N - 1`` others (an all-gather), counted at the collective; ``docs/exchange-strategies.md#sparse``.
"""
from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import torch

from dtrain.advice import LONGER_WARM_START, Advice
from dtrain.compress.sparse import ChunkLayout, chunk_starts, decode, encode, select
from dtrain.exchange.base import ThreadedExchange, full_precision_allreduce_bytes
from dtrain.exchange.settings import SPARSE
from dtrain.rules import check_settings


class Sparse(ThreadedExchange):
    """Chunked top-k with ``num_bits``-bit values and error feedback decaying by ``decay`` (``learner/exchange=sparse``).

    Args:
        chunk_size: values per chunk (at least 2); SparseLoCo's 4,096.
        top_k: values each chunk keeps (1 to ``chunk_size``); 64 keeps 1.6% at chunks of 4,096.
        num_bits: bits per kept value (1 to 32; 32: the exact float32 bits).
        decay: the error-feedback buffer's factor before each step's values are added, in (0, 1] (1: plain error
            feedback; SparseLoCo's 0.95, where it stands in for the outer momentum).

    Raises:
        ValueError: a value out of its range, or ``top_k`` above ``chunk_size``.
    """

    name = "sparse"
    needs_warm_start = True

    def __init__(self, chunk_size: int = 4096, top_k: int = 64, num_bits: int = 2, decay: float = 0.95):
        super().__init__()
        check_settings(SPARSE, chunk_size=chunk_size, top_k=top_k, num_bits=num_bits, decay=decay)
        if top_k > chunk_size:
            raise ValueError(f"learner.exchange.top_k={top_k}: expected at most learner.exchange.chunk_size={chunk_size} "
                             f"(the values a chunk keeps)")
        self.chunk_size, self.top_k, self.num_bits, self.decay = int(chunk_size), int(top_k), int(num_bits), float(decay)
        self.errors: dict[Hashable, torch.Tensor] = {}  # per key: this rank's error-feedback buffer e

    def identity(self) -> dict[str, Any]:
        """The name and every setting (the residuals mean something only under the same ones)."""
        return {"name": self.name, "chunk_size": self.chunk_size, "top_k": self.top_k, "num_bits": self.num_bits,
                "decay": self.decay}

    def describe(self) -> str:
        """``top-64 of 4096, 2-bit, decay 0.95``."""
        return f"sparse top-{self.top_k} of {self.chunk_size}, {self.num_bits}-bit, decay {self.decay:g}"

    def collapse_advice(self, sent: str) -> Advice:
        """Sparse ``sent`` started too early: a longer warm start, more values per chunk, more bits."""
        return Advice((f"{sent} sparsified by {self.describe()} started too early",),
                      (LONGER_WARM_START, f"keep more per chunk (learner.exchange.top_k above {self.top_k})",
                       f"use more bits (learner.exchange.num_bits above {self.num_bits})"))

    def exchange_now(self, key: Hashable, flat: torch.Tensor, shapes: list[torch.Size]) -> torch.Tensor:
        """Steps 1-4 of the module docstring on ``flat``, blocking; returns it holding the sum."""
        error = self.errors.get(key)
        if error is None:
            error = self.errors[key] = torch.zeros_like(flat, dtype=torch.float32)
        error.mul_(self.decay).add_(flat)                               # 1. e <- decay e + x
        layout = ChunkLayout(flat.numel(), self.chunk_size, self.top_k)
        positions = select(error, layout)                               # 2. each chunk's top-k ...
        message, sent = encode(error, positions, layout, self.num_bits)  # ... in k bits
        error.index_add_(0, positions, sent, alpha=-1)                  # 3. e <- e - x_hat
        messages = self.comm.allgather(message)                         # 4. every rank's, summed in rank order
        flat.zero_()
        starts = chunk_starts(layout, messages[0].device)  # the same for every message
        for received in messages:
            where, values = decode(received, layout, self.num_bits, starts)
            flat.index_add_(0, where, values.to(flat.dtype))
        self.bytes_sent_last_step += (self.comm.size - 1) * message.numel()
        self.full_precision_bytes_last_step += full_precision_allreduce_bytes(flat.numel(), self.comm.size)
        return flat

    def state_dict(self) -> dict[str, Any]:
        """This rank's error-feedback buffers, CPU copies."""
        self.drain()
        return {"name": self.name, "errors": {key: error.cpu().clone() for key, error in self.errors.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores :meth:`state_dict`'s output onto the communicator's device."""
        self.errors = {key: error.to(self.comm.device) for key, error in state.get("errors", {}).items()}

    def reset(self) -> None:
        """Forgets the buffers (a resume at another world size)."""
        self.drain()
        self.errors = {}


__all__ = ["Sparse"]
