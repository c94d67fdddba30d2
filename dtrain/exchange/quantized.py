"""k-bit quantized exchange with two-sided error feedback, as a strategy: one
:class:`dtrain.compress.QuantizedExchange` (CNTK's two-phase exchange) per key."""
from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import torch

from dtrain import checks
from dtrain.comm.base import AsyncHandle, CompletedHandle
from dtrain.compress.bitpack import check_bits
from dtrain.compress.exchange import QuantizedExchange
from dtrain.exchange.base import Exchange


class Quantized(Exchange):
    """Sums through k-bit codes with error feedback (1-bit SGD at ``num_bits=1``); state per key.

    Args:
        num_bits: bits per value on the wire, 1 to 32.
        error_feedback: carry each step's quantization error into the next (``False``: ablation).
    """

    name = "quantized"

    def __init__(self, num_bits: int = 1, error_feedback: bool = True):
        super().__init__()
        self.num_bits = check_bits(num_bits, "num_bits")
        self.error_feedback = checks.boolean("error_feedback", error_feedback)
        self._exchanges: dict[Hashable, QuantizedExchange] = {}

    def identity(self) -> dict[str, Any]:
        """The name and the bits per value."""
        return {"name": self.name, "num_bits": self.num_bits}

    def start(self, key: Hashable, flat: torch.Tensor, shapes: Sequence[torch.Size]) -> AsyncHandle:
        """Runs the two-phase exchange of ``flat`` (seen as tensors of ``shapes``) now; the handle is complete."""
        exchange = self._exchanges.get(key)
        if exchange is None:
            exchange = self._exchanges[key] = QuantizedExchange(self.comm, self.num_bits,
                                                                 error_feedback=self.error_feedback)
        views = [part.view(shape) for part, shape in zip(flat.split([_numel(s) for s in shapes]), shapes)]
        exchange.allreduce_(views)
        self.bytes_sent_last_step += exchange.bytes_sent_last_step
        self.full_precision_bytes_last_step += exchange.full_precision_bytes_last_step
        return CompletedHandle(flat)

    def state_dict(self) -> dict[str, Any]:
        """Each key's residuals (see ``QuantizedExchange.state_dict``)."""
        return {"per_key": {key: exchange.state_dict() for key, exchange in self._exchanges.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores :meth:`state_dict`'s output (needs ``bind`` first)."""
        for key, saved in state.get("per_key", {}).items():
            exchange = self._exchanges.get(key)
            if exchange is None:
                exchange = self._exchanges[key] = QuantizedExchange(self.comm, self.num_bits,
                                                                     error_feedback=self.error_feedback)
            exchange.load_state_dict(saved)

    def reset(self) -> None:
        """Zeroes every key's residuals."""
        for exchange in self._exchanges.values():
            exchange.reset()


def _numel(shape: Sequence[int]) -> int:
    count = 1
    for size in shape:
        count *= int(size)
    return count


__all__ = ["Quantized"]
