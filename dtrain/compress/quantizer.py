"""CNTK's column quantizer (``ColumnQuantizer``/``ValueQuantizer``), as pure tensor maths.

Values are quantized per *column* with two float32 numbers per column (``lower``, ``upper``)
that travel with the packed codes (``docs/semantics.md#column-quantizer``).

The column view
---------------
CNTK stores matrices column-major, and a weight's column is one output unit's fan-in, stored
contiguously. The PyTorch equivalent of that, for a row-major tensor of shape ``[out, ...]``, is
the 2-D view ``[out, rest]`` with ``rest = numel // out``: each of the ``out`` rows (one output
unit's fan-in, contiguous in memory) is one column here. So a ``Linear(in, out)`` weight gives
``out`` columns of ``in`` values, a ``Conv2d`` weight ``[cout, cin, kh, kw]`` gives ``cout``
columns of ``cin*kh*kw`` values. A 0-D or 1-D tensor (a bias) is a single column, as a CNTK
bias (an ``[n, 1]`` matrix) is. A tensor whose columns would be shorter than
:data:`MIN_COLUMN_LENGTH` is also a single column: each column costs 64 bits of scales, which
would outweigh codes of a few bits.

Quantizers (``bits`` = k)
-------------------------
* k = 1, zero threshold (what CNTK's Python API uses): ``code = v >= 0``; ``mean0`` / ``mean1``
  are the means of the negative / non-negative values, an empty side's count taken as 1 (so its
  mean is 0); ``mid = (mean0 + mean1)/2``, ``radius = 2*(mean1 - mid)``, ``lower = mid - radius``,
  ``upper = mid + radius``. Decoding ``(code + 0.5) * (upper - lower)/2 + lower`` gives mean0 or
  mean1 (up to float32 rounding of that expression; exactly for dyadic values).
* 2 <= k <= 31: linear over ``mean ± 5σ`` of the column (population σ), with ``2**k - 1`` steps so
  that a symmetric range has a level at its centre (CNTK's "0 slot"): ``step = (upper-lower)/(2**k-1)``,
  ``code = clip(floor((v - lower)/step), 0, 2**k - 1)``, decode ``(code + 0.5)*step + lower``.
  Inside ``[lower, upper]`` the error is at most half a step. CNTK accepts only powers of two
  (its packing needs them); this packing does not, so every k works the same way. For k > 16
  the arithmetic runs in float64, since float32's 24-bit mantissa cannot resolve 2**k levels.
  A column whose range is below 1e-36 (constant) decodes to ``lower`` (its mean), as in CNTK.
  (The range follows ``docs/semantics.md#column-quantizer``. The ``ColumnQuantizer.h`` revision we read uses ±4σ
  around 0 instead: it computes the mean only for 1 bit without zero threshold. Change
  :data:`STDDEVS` and the centre here if that is the behaviour wanted.)
* k = 32: no quantization. The code is the float32 bit pattern of the value (CNTK's
  ``QuantizeToFullQWord`` testing path); lower and upper are 0 and unused.

Error feedback: :func:`quantize_with_feedback` quantizes ``v = values + residual`` and leaves
``residual = v - dequantize(q)``, so nothing is lost, only delayed.

Element-wise passes run once over the whole buffer; only per-column reductions and scale
broadcasts loop in Python over *blocks* (runs of equally long columns: one per tensor, or per
tensor slice), never over columns; each block is one vectorised 2-D operation.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from dtrain.compress.bitpack import check_bits, code_dtype

MIN_COLUMN_LENGTH = 16
"""Tensors whose per-output-unit slices are shorter than this are quantized as one column."""

STDDEVS = 5.0
"""k > 1 bits: the quantization range is the column mean ± this many standard deviations."""

_TINY_RANGE = 1e-36  # CNTK's guard: a range below this quantizes every value to code 0
_FLOAT64_ABOVE_BITS = 16


# -- layout ------------------------------------------------------------------------------------------


def column_shape(shape: Sequence[int]) -> tuple[int, int]:
    """Return ``(num_columns, column_length)`` of the column view of a tensor of ``shape``.

    ``[out, ...]`` → ``(out, numel // out)``; 0-D/1-D tensors and tensors whose columns would be
    shorter than :data:`MIN_COLUMN_LENGTH` → ``(1, numel)``; an empty tensor → ``(0, 0)``.
    """
    numel = 1
    for size in shape:
        numel *= int(size)
    if numel == 0:
        return 0, 0
    if len(shape) <= 1 or numel // int(shape[0]) < MIN_COLUMN_LENGTH:
        return 1, numel
    return int(shape[0]), numel // int(shape[0])


@dataclass(frozen=True)
class ColumnBlock:
    """``num_columns`` columns of ``column_length`` values each, stored contiguously from flat index ``offset``."""

    offset: int
    num_columns: int
    column_length: int

    @property
    def numel(self) -> int:
        """Values in the block."""
        return self.num_columns * self.column_length

    def view(self, flat: torch.Tensor) -> torch.Tensor:
        """Return the ``[num_columns, column_length]`` view of this block inside the 1-D tensor ``flat``."""
        return flat[self.offset:self.offset + self.numel].view(self.num_columns, self.column_length)


@dataclass(frozen=True)
class ColumnLayout:
    """How a 1-D buffer of ``numel`` values divides into columns: consecutive :class:`ColumnBlock` s.

    Columns are numbered in buffer order; ``lower``/``upper`` tensors have one entry per column.
    Raises ValueError when the blocks do not tile ``[0, numel)`` in order.
    """

    blocks: tuple[ColumnBlock, ...]

    def __post_init__(self) -> None:
        offset = 0
        for block in self.blocks:
            if block.offset != offset or block.num_columns < 0 or block.column_length < 0:
                raise ValueError(f"column blocks must tile the buffer in order; {block} does not start at {offset}")
            offset += block.numel
        # the sizes are read on every pass; a frozen dataclass caches them through object.__setattr__
        object.__setattr__(self, "_numel", offset)
        object.__setattr__(self, "_num_columns", sum(block.num_columns for block in self.blocks))

    @classmethod
    def for_shapes(cls, shapes: Sequence[Sequence[int]]) -> ColumnLayout:
        """The layout of the tensors of ``shapes`` flattened one after the other, each in its column view."""
        blocks, offset = [], 0
        for shape in shapes:
            num_columns, length = column_shape(shape)
            if num_columns:
                blocks.append(ColumnBlock(offset, num_columns, length))
                offset += num_columns * length
        return cls(tuple(blocks))

    @property
    def numel(self) -> int:
        """Values in the buffer."""
        return self._numel

    @property
    def num_columns(self) -> int:
        """Columns in the buffer (the number of lower/upper pairs)."""
        return self._num_columns


@dataclass(frozen=True)
class QuantizedColumns:
    """One quantized buffer: what travels (packed ``codes`` plus ``lower``/``upper``) before packing.

    ``codes``: 1-D integer tensor (dtype ``bitpack.code_dtype(bits)``), one code per value, in
    ``[0, 2**bits)``. ``lower``/``upper``: float32 tensors with one entry per column.
    """

    codes: torch.Tensor
    lower: torch.Tensor
    upper: torch.Tensor
    bits: int


class Workspace:
    """Scratch buffers kept between calls, so a repeated quantization of the same size allocates nothing.

    A fresh multi-MB tensor costs more than the arithmetic on it: the allocator returns large
    blocks to the system and every page faults again when touched. Pass one ``Workspace`` to
    :func:`quantize`, :func:`quantize_with_feedback` and :func:`dequantize` to reuse their
    temporaries. What a call returns may then live in the workspace (``QuantizedColumns.codes``,
    a ``dequantize`` result without ``out``) and is valid only until the next call that uses it.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def take(self, name: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A 1-D tensor of ``numel`` elements (contents undefined), the same storage on every call for ``name``."""
        buffer = self._buffers.get(name)
        if buffer is None or buffer.numel() < numel or buffer.dtype != dtype or buffer.device != torch.device(device):
            buffer = self._buffers[name] = torch.empty(numel, dtype=dtype, device=device)
        return buffer[:numel]


def _scratch(workspace: Workspace | None, name: str, numel: int, dtype: torch.dtype,
             device: torch.device) -> torch.Tensor:
    if workspace is None:
        return torch.empty(numel, dtype=dtype, device=device)
    return workspace.take(name, numel, dtype, device)


# -- quantize / dequantize --------------------------------------------------------------------------


def quantize(values: torch.Tensor, layout: ColumnLayout, bits: int,
             workspace: Workspace | None = None) -> QuantizedColumns:
    """Quantize the 1-D floating-point buffer ``values`` column by column to ``bits`` bits.

    ``workspace``: reuse its buffers for the temporaries and the codes (see :class:`Workspace`).
    Raises ValueError for ``bits`` outside 1..32 or a buffer whose size differs from
    ``layout.numel``; TypeError for a non-floating-point buffer.
    """
    _check_buffer(values, layout, bits)
    return _quantize(values, layout, bits, workspace)


def dequantize(quantized: QuantizedColumns, layout: ColumnLayout, dtype: torch.dtype = torch.float32,
               out: torch.Tensor | None = None, workspace: Workspace | None = None) -> torch.Tensor:
    """Return the values ``quantized`` stands for, as a 1-D tensor of ``dtype`` (written into ``out`` if given).

    ``workspace``: without ``out``, the result is the workspace's ``"decoded"`` buffer (see :class:`Workspace`).
    Raises ValueError when the codes or scales do not match ``layout``.
    """
    bits = check_bits(quantized.bits)
    if quantized.codes.numel() != layout.numel or quantized.lower.numel() != layout.num_columns:
        raise ValueError(f"quantized buffer has {quantized.codes.numel()} codes and {quantized.lower.numel()} "
                         f"columns; the layout has {layout.numel} values in {layout.num_columns} columns")
    if out is None:
        out = _scratch(workspace, "decoded", layout.numel, dtype, quantized.codes.device)
    if bits == 32:
        _dequantize_bit_patterns(quantized.codes, out)
    else:
        _dequantize_linear(quantized, layout, bits, out, workspace)
    return out


def quantize_with_feedback(values: torch.Tensor, residual: torch.Tensor, layout: ColumnLayout,
                           bits: int, workspace: Workspace | None = None) -> QuantizedColumns:
    """Quantize ``values + residual`` and set ``residual`` (in place) to what the quantization lost.

    After the call ``values_before + residual_before == dequantize(result) + residual`` up to float
    rounding: the error is fed back into the next step instead of being dropped (1-bit SGD).
    ``workspace``: reuse its buffers (see :class:`Workspace`).
    Raises ValueError when ``residual`` is not shaped like ``values``.
    """
    if residual.shape != values.shape:
        raise ValueError(f"residual shape {tuple(residual.shape)} differs from values shape {tuple(values.shape)}")
    dtype = torch.promote_types(values.dtype, residual.dtype)
    corrected = torch.add(values, residual, out=_scratch(workspace, "corrected", values.numel(), dtype, values.device))
    _check_buffer(corrected, layout, bits)
    quantized = _quantize(corrected, layout, bits, workspace)
    if residual.dtype == corrected.dtype:
        dequantize(quantized, layout, out=residual)  # the decoded values, then what they missed, in place
        torch.sub(corrected, residual, out=residual)
    else:
        torch.sub(corrected, dequantize(quantized, layout, dtype=corrected.dtype, workspace=workspace), out=residual)
    return quantized


# -- the passes --------------------------------------------------------------------------------------
# Element-wise work runs once over the whole buffer; only the per-column reductions (and the
# per-column broadcasts of the scales) run per block, on views. Every value goes through the
# same float operations, in the same order, as the per-block formulation in the module
# docstring, so the results are bit for bit those of quantizing each block on its own.


def _quantize(values: torch.Tensor, layout: ColumnLayout, bits: int, workspace: Workspace | None) -> QuantizedColumns:
    if bits == 32:
        codes = values.to(torch.float32).view(torch.int32).to(torch.int64)
        codes &= 0xFFFFFFFF  # the bit pattern as an unsigned 32-bit code
        zeros = torch.zeros(layout.num_columns, dtype=torch.float32, device=values.device)
        return QuantizedColumns(codes, zeros, zeros, bits)
    if bits == 1:
        return _quantize_1bit(values, layout, workspace)
    codes = _scratch(workspace, "codes", layout.numel, code_dtype(bits), values.device)
    lower = torch.zeros(layout.num_columns, dtype=torch.float32, device=values.device)
    upper = torch.zeros_like(lower)
    column = 0
    for block in layout.blocks:
        columns = slice(column, column + block.num_columns)
        lower[columns], upper[columns] = _quantize_block_linear(block.view(values), bits, block.view(codes))
        column += block.num_columns
    return QuantizedColumns(codes, lower, upper, bits)


def _quantize_1bit(values: torch.Tensor, layout: ColumnLayout, workspace: Workspace | None) -> QuantizedColumns:
    codes = _scratch(workspace, "codes", layout.numel, torch.uint8, values.device)
    _non_negative(values, codes)  # the codes themselves (0/1 bytes)
    # clamp keeps exactly the values of one side (the other side becomes 0 and adds nothing)
    side = _scratch(workspace, "decoded", layout.numel, values.dtype, values.device)  # free until a dequantize
    num_columns = layout.num_columns
    count1 = torch.empty(num_columns, dtype=torch.int32, device=values.device)  # int32: exact, 2x faster to sum
    sums = torch.empty(2, num_columns, dtype=torch.float32, device=values.device)  # sum0, sum1
    lengths = torch.empty(num_columns, dtype=torch.int32, device=values.device)
    column = 0
    for block in layout.blocks:
        end = column + block.num_columns
        torch.sum(block.view(codes), dim=1, dtype=torch.int32, out=count1[column:end])
        lengths[column:end] = block.column_length
        column = end
    for which, bound in ((0, {"max": 0}), (1, {"min": 0})):  # sum0 from the negative part, sum1 the positive
        torch.clamp(values, **bound, out=side)
        column = 0
        for block in layout.blocks:
            end = column + block.num_columns
            torch.sum(block.view(side), dim=1, dtype=torch.float32, out=sums[which, column:end])
            column = end
    # CNTK: "happens for all-zero columns which do exist (mean0 is 0 in that case)"
    mean0 = sums[0] / (lengths - count1).clamp(min=1)
    mean1 = sums[1] / count1.clamp(min=1)
    mid = 0.5 * (mean0 + mean1)
    radius = 2.0 * (mean1 - mid)
    return QuantizedColumns(codes, mid - radius, mid + radius, 1)


_NUMPY_COMPARABLE = (torch.float16, torch.float32, torch.float64)


def _non_negative(values: torch.Tensor, codes: torch.Tensor) -> None:
    """Write ``values >= 0`` as uint8 0/1 (NaN: 0) into ``codes``; on CPU through NumPy, several times faster."""
    if values.device.type == "cpu" and values.dtype in _NUMPY_COMPARABLE and not values.requires_grad:
        np.greater_equal(values.numpy(), 0, out=codes.numpy().view(np.bool_))
    else:
        torch.ge(values, 0, out=codes.view(torch.bool))


def _dequantize_bit_patterns(codes: torch.Tensor, out: torch.Tensor) -> None:
    signed = torch.where(codes >= 1 << 31, codes - (1 << 32), codes)
    out.copy_(signed.to(torch.int32).view(torch.float32))


def _dequantize_linear(quantized: QuantizedColumns, layout: ColumnLayout, bits: int, out: torch.Tensor,
                       workspace: Workspace | None) -> None:
    """``(code + 0.5) * step + lower`` per value, one rounding per operation (for 1 bit this is bit for bit
    CNTK's Unquantize(0) = 0.5*step + lower = mean0 and Unquantize(1) = 1.5*step + lower = mean1)."""
    work = _work_dtype(bits)
    levels = 2 if bits == 1 else (1 << bits) - 1  # CNTK: usedrangeend = 2**k - (k > 1)
    span = quantized.upper.to(work) - quantized.lower.to(work)
    step = torch.where(span < _TINY_RANGE, torch.zeros_like(span), span / levels)
    lower = quantized.lower.to(work)
    decoded = out if out.dtype == work else _scratch(workspace, "decoded_work", layout.numel, work, out.device)
    decoded.copy_(quantized.codes).add_(0.5)  # exact: work has room for a k-bit code plus a half
    column = 0
    for block in layout.blocks:
        end = column + block.num_columns
        block.view(decoded).mul_(step[column:end, None]).add_(lower[column:end, None])
        column = end
    if decoded is not out:
        out.copy_(decoded)


def _quantize_block_linear(columns: torch.Tensor, bits: int, codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Write the codes of ``columns`` (k = 2..31) into ``codes``; return the float32 (lower, upper) per column."""
    work = _work_dtype(bits)
    values = columns.to(work)
    mean = values.mean(dim=1)
    # (torch.var_mean is several times slower than this on CPU)
    stddev = (values - mean[:, None]).square_().mean(dim=1).sqrt_()
    # the scales travel as float32, so codes are computed from the rounded scales the receiver sees
    lower = (mean - STDDEVS * stddev).to(torch.float32)
    upper = (mean + STDDEVS * stddev).to(torch.float32)
    levels = (1 << bits) - 1
    span = upper.to(work) - lower.to(work)
    factor = torch.where(span < _TINY_RANGE, torch.zeros_like(span), levels / span)
    scaled = (values - lower.to(work)[:, None]).mul_(factor[:, None])
    codes.copy_(scaled.floor_().clamp_(0, levels))  # CNTK: u <= lower -> 0, u >= upper -> 2**k - 1
    return lower, upper


def _work_dtype(bits: int) -> torch.dtype:
    # float32 matches the float32 scales on the wire; float64 resolves the 2**k levels of k > 16
    return torch.float64 if bits > _FLOAT64_ABOVE_BITS else torch.float32


def _check_buffer(values: torch.Tensor, layout: ColumnLayout, bits: int) -> None:
    check_bits(bits)
    if not values.is_floating_point():
        raise TypeError(f"values must be a floating-point tensor, got {values.dtype}")
    if values.dim() != 1 or values.numel() != layout.numel:
        raise ValueError(f"values must be a 1-D buffer of {layout.numel} values (the layout's size), "
                         f"got shape {tuple(values.shape)}")


__all__ = [
    "MIN_COLUMN_LENGTH", "STDDEVS", "ColumnBlock", "ColumnLayout", "QuantizedColumns", "Workspace", "column_shape",
    "dequantize", "quantize", "quantize_with_feedback",
]
