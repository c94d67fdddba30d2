"""Gradient compression as pure tensor maths: nothing here talks to other ranks.

* :mod:`dtrain.compress.quantizer` — CNTK's column quantizer (1-bit zero threshold, k-bit linear
  over mean ± 5σ) and its error feedback.
* :mod:`dtrain.compress.bitpack` — k-bit codes to and from dense bytes.
* :mod:`dtrain.compress.stripes` — the stripe layout and message format of the two-phase exchange.
* :mod:`dtrain.compress.lowrank` — PowerSGD's orthogonalisation and worth-compressing test.

The exchanges that send these over the wire live in :mod:`dtrain.exchange`
(:class:`dtrain.exchange.quantized.QuantizedExchange`, :class:`dtrain.exchange.PowerSGD`).
"""
from dtrain.compress.bitpack import code_dtype, pack, packed_size, unpack
from dtrain.compress.lowrank import orthogonalize_, should_compress
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
from dtrain.compress.stripes import StripeLayout, decode_message, encode_message, stripe_bounds, stripe_of

__all__ = [
    "MIN_COLUMN_LENGTH", "STDDEVS", "ColumnBlock", "ColumnLayout", "QuantizedColumns", "StripeLayout", "Workspace",
    "code_dtype", "column_shape", "decode_message", "dequantize", "encode_message", "orthogonalize_", "pack",
    "packed_size", "quantize", "quantize_with_feedback", "should_compress", "stripe_bounds", "stripe_of", "unpack",
]
