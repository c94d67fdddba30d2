"""The two-phase quantized exchange (``docs/semantics.md#two-phase-exchange``) written out directly on whole buffers.

The independent reference both the unit tests and the mpiexec worker compare
``QuantizedExchange`` with: every rank's gradients are visible at once, so phase 1 (each
worker quantizes its whole buffer, with its residual) and phase 2 (each stripe's owner sums
the decoded stripe and re-quantizes it at ``owner_bits``, with its own residual) are plain loops. With
``requantize_sum=False`` there is no phase 2: the result is the sum of the decoded buffers, in rank order.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from dtrain.compress import StripeLayout, dequantize, quantize


class ReferenceExchange:
    """One reference exchange: ``worker_residuals`` per rank and ``owner_residuals`` per stripe carry over steps."""

    def __init__(self, layout: StripeLayout, bits: int, requantize_sum: bool = True, owner_bits: int | None = None):
        self.layout, self.bits, self.requantize_sum = layout, bits, requantize_sum
        self.owner_bits = bits if owner_bits is None else owner_bits
        self.worker_residuals = [torch.zeros(layout.numel) for _ in range(layout.num_stripes)]
        self.owner_residuals = [torch.zeros(end - start) for start, end in layout.stripe_values]

    def step(self, gradients_by_rank: Sequence[Sequence[torch.Tensor]]) -> torch.Tensor:
        """The flat all-reduced result every rank should hold after exchanging ``gradients_by_rank``."""
        layout, bits = self.layout, self.bits
        decoded = []
        for rank, gradients in enumerate(gradients_by_rank):
            values = layout.flatten(gradients) + self.worker_residuals[rank]
            sent = dequantize(quantize(values, layout.columns, bits), layout.columns)
            self.worker_residuals[rank] = values - sent
            decoded.append(sent)
        if not self.requantize_sum:
            result = decoded[0].clone()
            for sent in decoded[1:]:
                result += sent
            return result
        result = torch.empty(layout.numel)
        for stripe, (start, end) in enumerate(layout.stripe_values):
            total = torch.zeros(end - start)
            for sent in decoded:
                total += sent[start:end]
            values = total + self.owner_residuals[stripe]
            part = layout.stripe(stripe)
            result[start:end] = dequantize(quantize(values, part, self.owner_bits), part)
            self.owner_residuals[stripe] = values - result[start:end]
        return result
