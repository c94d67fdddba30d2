"""An independent reference of SparseLoCo's exchange (Sarfi et al. 2025, arXiv 2508.15706, Algorithm 1), written
chunk by chunk with plain tensor operations, for the tests of ``dtrain.exchange.Sparse``.

Per worker r and step: ``e_r <- decay * e_r + x_r``; each chunk of ``e_r`` keeps its ``top_k`` largest by
magnitude, quantized (sign, and a magnitude level between the chunk's smallest and largest kept magnitude); ``e_r
<- e_r - sent_r``; the sum is ``sum_r sent_r``."""
from __future__ import annotations

import math

import torch


def quantized(kept: torch.Tensor, bits: int) -> torch.Tensor:
    """One chunk's kept values as the receivers decode them, at ``bits`` bits (32: exactly)."""
    if bits == 32:
        return kept.clone()
    levels = 2 ** (bits - 1)
    magnitude = kept.abs()
    low, high = float(magnitude.min()), float(magnitude.max())
    step = torch.tensor((high - low) / levels, dtype=torch.float32)
    decoded = []
    for value in kept.tolist():
        level = 0 if step == 0 else min(max(math.floor((abs(value) - low) / float(step)), 0), levels - 1)
        magnitude_decoded = (level + 0.5) * float(step) + low
        decoded.append(-magnitude_decoded if value < 0 else magnitude_decoded)
    return torch.tensor(decoded, dtype=torch.float32)


def sparse_step(error: torch.Tensor, values: torch.Tensor, chunk_size: int, top_k: int, num_bits: int,
                decay: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(error after, sent)`` of one worker's step; ``sent`` dense, zero where nothing was kept."""
    error = error * decay + values
    sent = torch.zeros_like(error)
    for start in range(0, error.numel(), chunk_size):
        chunk = error[start:start + chunk_size]
        keep = top_k if chunk.numel() == chunk_size else min(chunk.numel(),
                                                               max(1, math.ceil(top_k * chunk.numel() / chunk_size)))
        where = chunk.abs().topk(keep).indices
        sent[start:start + chunk_size][where] = quantized(chunk[where], num_bits)
    return error - sent, sent


__all__ = ["quantized", "sparse_step"]
