"""Gradient compression with explicit state: CNTK's k-bit column quantizer and its two-phase exchange.

* :mod:`dtrain.compress.quantizer` — the column quantizer (1-bit zero threshold, k-bit linear
  over mean ± 5σ) and error feedback, as pure tensor maths.
* :mod:`dtrain.compress.bitpack` — k-bit codes to and from dense bytes.
* :mod:`dtrain.compress.exchange` — :class:`QuantizedExchange`, the stateful two-phase
  (reduce-scatter + all-gather) quantized sum over ranks, with its bytes-on-the-wire statistics.

Typical use (what :class:`dtrain.learners.QuantizedDataParallelLearner` does every step)::

    exchange = QuantizedExchange(comm, num_bits=1)
    exchange.allreduce_(gradients, scale=local_samples / global_samples)
    print(exchange.bytes_sent_last_step, exchange.compression_ratio)
"""
from dtrain.compress.bitpack import code_dtype, pack, packed_size, unpack
from dtrain.compress.exchange import QuantizedExchange, StripeLayout, full_precision_allreduce_bytes, stripe_bounds
from dtrain.compress.quantizer import (
    MIN_COLUMN_LENGTH,
    STDDEVS,
    ColumnBlock,
    ColumnLayout,
    QuantizedColumns,
    Workspace,
    column_shape,
    dequantize,
    quantize,
    quantize_with_feedback,
)

__all__ = [
    "MIN_COLUMN_LENGTH", "STDDEVS", "ColumnBlock", "ColumnLayout", "QuantizedColumns", "QuantizedExchange",
    "StripeLayout", "code_dtype", "column_shape", "dequantize", "full_precision_allreduce_bytes", "pack",
    "packed_size", "quantize", "quantize_with_feedback", "stripe_bounds", "unpack", "Workspace",
]
