"""bf16/fp16 compressed all-reduce: half the bytes of float32, no state, one asynchronous collective."""
from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import torch

from dtrain.comm.base import AsyncHandle
from dtrain.exchange.base import Exchange, full_precision_allreduce_bytes
from dtrain.exchange.settings import COMPRESSED
from dtrain.rules import check_settings

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
"""The wire formats ``CompressedAllReduce`` accepts, by config name."""


class _CastBack(AsyncHandle):
    """The all-reduce of the low-precision copy; ``wait()`` writes the sum back into the float32 buffer."""

    def __init__(self, pending: AsyncHandle, low: torch.Tensor, flat: torch.Tensor, strategy: CompressedAllReduce):
        self._pending, self._low, self._flat, self._strategy = pending, low, flat, strategy

    def wait(self) -> torch.Tensor:
        """Completes the all-reduce, casts the sum back into ``flat`` and returns it."""
        if self._pending is not None:
            self._pending.wait()
            self._pending = None
            self._flat.copy_(self._low)
            self._low = None
            self._strategy.check_result(self._flat)
        return self._flat


class CompressedAllReduce(Exchange):
    """Sums through a bf16 or fp16 all-reduce (``learner/exchange=bf16`` or ``=fp16``).

    The learner hands over gradients already multiplied by ``local_samples / global_samples``
    (the SUM over ranks is the mean gradient), so values are cast AFTER that division and the
    sum has the magnitude of one mean gradient: it cannot overflow where the gradient itself
    fits. bf16 keeps float32's range with 8 bits of mantissa; fp16 has 11 bits but overflows
    above 65504, which without loss scaling is reported as an error (all ranks see the same
    sum, so all stop together) rather than stepping on an inf. Lossy but stateless: rounding
    errors are not fed back. Ranks decode the same sum, so parameters stay identical.

    Args:
        dtype: ``"bf16"`` or ``"fp16"``, the type on the wire.

    Raises:
        ValueError: another ``dtype``.
    """

    name = "compressed"
    lossless = False

    def __init__(self, dtype: str = "bf16"):
        super().__init__()
        check_settings(COMPRESSED, dtype=dtype)
        self.dtype = dtype

    def identity(self) -> dict[str, Any]:
        """The name and the wire type."""
        return {"name": self.name, "dtype": self.dtype}

    def describe(self) -> str:
        """``bf16 all-reduce`` or ``fp16 all-reduce``."""
        return f"{self.dtype} all-reduce"

    def start(self, key: Hashable, flat: torch.Tensor, shapes: Sequence[torch.Size]) -> AsyncHandle:
        """Casts ``flat`` to the wire type and launches its asynchronous SUM all-reduce."""
        low = flat.to(DTYPES[self.dtype])
        full = full_precision_allreduce_bytes(flat.numel(), self.comm.size)
        self.full_precision_bytes_last_step += full
        self.bytes_sent_last_step += full * low.element_size() // 4
        return _CastBack(self.comm.allreduce_async(low, op="sum"), low, flat, self)

    def check_result(self, flat: torch.Tensor) -> None:
        """Raises when an fp16 sum overflowed outside loss scaling (where an inf would be stepped on)."""
        if self.dtype == "fp16" and not self.loss_scaled and not bool(torch.isfinite(flat).all()):
            raise RuntimeError("the fp16 gradient exchange produced inf or NaN (values beyond fp16's 65504, or a "
                               "non-finite gradient); use learner/exchange=bf16 (float32's range) or "
                               "session.precision=fp16 (loss scaling skips such steps)")


__all__ = ["CompressedAllReduce", "DTYPES"]
