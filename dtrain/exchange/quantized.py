"""k-bit quantized exchange with two-sided error feedback, as a strategy: one
:class:`dtrain.compress.QuantizedExchange` (CNTK's two-phase exchange) per key, run on a
background thread so each bucket's exchange overlaps the rest of backward."""
from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import torch

from dtrain import checks
from dtrain.compress.bitpack import check_bits
from dtrain.compress.exchange import QuantizedExchange
from dtrain.exchange.base import ThreadedExchange, split_views, warn_residuals_dropped


class Quantized(ThreadedExchange):
    """Sums through k-bit codes with error feedback (1-bit SGD at ``num_bits=1``); state per key.

    Each key (a gradient bucket) has its own worker and owner residuals, so a bucket is
    exchanged as soon as backward has filled it. Lossy: 1-bit SGD needs a full-precision warm
    start (``needs_warm_start``: the learner's ``distributed_after="auto"`` gives one).

    Args:
        num_bits: bits per value on the wire, 1 to 32.
        error_feedback: carry each step's quantization error into the next (``False``: ablation).

    Raises:
        ValueError: ``num_bits`` outside 1..32 or ``error_feedback`` not a boolean.
    """

    name = "quantized"
    needs_warm_start = True

    def __init__(self, num_bits: int = 1, error_feedback: bool = True):
        super().__init__()
        self.num_bits = check_bits(num_bits, "num_bits")
        self.error_feedback = checks.boolean("error_feedback", error_feedback)
        self._exchanges: dict[Hashable, QuantizedExchange] = {}
        self.seconds_last_step = 0.0  # wall-clock seconds of this step's exchanges (on the worker thread)
        self.transport_seconds_last_step = 0.0  # ... of which in their collectives (waiting for peers included)

    def begin_step(self) -> None:
        """Starts a step's byte and time counters."""
        super().begin_step()
        self.seconds_last_step = self.transport_seconds_last_step = 0.0

    @property
    def compute_seconds_last_step(self) -> float:
        """Seconds of this step's exchanges outside their collectives: quantize, pack, unpack, dequantize
        (what 1-bit SGD costs in CPU against what it saves on the wire)."""
        return self.seconds_last_step - self.transport_seconds_last_step

    def identity(self) -> dict[str, Any]:
        """The name and the bits per value."""
        return {"name": self.name, "num_bits": self.num_bits}

    def describe(self) -> str:
        """``1-bit`` and so on."""
        return f"{self.num_bits}-bit"

    def _exchange_for(self, key: Hashable) -> QuantizedExchange:
        exchange = self._exchanges.get(key)
        if exchange is None:
            exchange = self._exchanges[key] = QuantizedExchange(self.comm, self.num_bits,
                                                                error_feedback=self.error_feedback)
        return exchange

    def exchange_now(self, key: Hashable, flat: torch.Tensor, shapes: list[torch.Size]) -> torch.Tensor:
        """Runs the two-phase exchange of ``flat`` (seen as tensors of ``shapes``), blocking."""
        exchange = self._exchange_for(key)
        exchange.allreduce_(split_views(flat, shapes))
        self.bytes_sent_last_step += exchange.bytes_sent_last_step
        self.full_precision_bytes_last_step += exchange.full_precision_bytes_last_step
        self.seconds_last_step += exchange.seconds_last_step
        self.transport_seconds_last_step += exchange.transport_seconds_last_step
        return flat

    def state_dict(self) -> dict[str, Any]:
        """Each key's residuals (see ``QuantizedExchange.state_dict``)."""
        self.drain()
        return {"name": self.name, "per_key": {key: exchange.state_dict() for key, exchange in self._exchanges.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores :meth:`state_dict`'s output (needs ``bind`` first). With error feedback off the
        saved residuals are not used: they are dropped, and a warning says so (rank 0, one line)."""
        saved_keys = state.get("per_key", {})
        if not self.error_feedback:
            if any(saved.get("worker_residual") is not None for saved in saved_keys.values()):
                warn_residuals_dropped(self, "error_feedback")
            return
        for key, saved in saved_keys.items():
            self._exchange_for(key).load_state_dict(saved)

    def reset(self) -> None:
        """Forgets every key's residuals (they start again at zero), after any exchange still running."""
        self.drain()
        self._exchanges.clear()


__all__ = ["Quantized"]
