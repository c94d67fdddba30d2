"""The column quantizer and bit packing exactly as first written (per-block passes, shift-and-or packing).

Kept verbatim as the bit-for-bit reference for the vectorised ``dtrain.compress.quantizer`` and
``dtrain.compress.bitpack``: tests/unit/test_quantizer_equivalence.py checks that both give the
same codes, scales, bytes and decoded values on random inputs for every width 1..32.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dtrain import checks

MAX_BITS = 32
"""The widest code :func:`pack` accepts (a float32's bit pattern, CNTK's no-quantization case)."""

def code_dtype(bits: int) -> torch.dtype:
    """Return the integer dtype that holds ``bits``-bit codes: ``uint8`` up to 8 bits, else ``int64``.

    Raises ValueError when ``bits`` is not in 1..32.
    """
    check_bits(bits)
    return torch.uint8 if bits <= 8 else torch.int64


def check_bits(bits: int, name: str = "bits") -> int:
    """Return ``bits`` when it is a whole number from 1 to 32 (the one rule for a quantization width).

    ``name`` is what the caller's user knows the value by (``"num_quantization_bits"`` for a learner).

    Raises:
        ValueError: ``name=value: expected a whole number of bits from 1 to 32``.
    """
    return checks.whole_number(name, bits, 1, MAX_BITS, unit="bits")


def packed_size(count: int, bits: int) -> int:
    """Return the number of bytes :func:`pack` produces for ``count`` codes of ``bits`` bits."""
    check_bits(bits)
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    return (count * bits + 7) // 8


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integer ``codes`` (each in ``[0, 2**bits)``) into a 1-D uint8 tensor of ``packed_size`` bytes.

    Args:
        codes: integer tensor of any shape (read in flattened order); any integer dtype.
        bits: code width, 1 to 32.

    Returns:
        A new uint8 tensor on ``codes.device`` of ``ceil(codes.numel() * bits / 8)`` bytes.

    Raises:
        ValueError: ``bits`` out of range, or a code outside ``[0, 2**bits)``.
        TypeError: ``codes`` is not an integer tensor.
    """
    check_bits(bits)
    if codes.is_floating_point() or codes.is_complex() or codes.dtype == torch.bool:
        raise TypeError(f"codes must be an integer tensor, got {codes.dtype}")
    count = codes.numel()
    if count == 0:
        return torch.empty(0, dtype=torch.uint8, device=codes.device)
    flat = codes.reshape(-1)
    low, high = int(flat.min()), int(flat.max())
    if low < 0 or high >= 1 << bits:
        raise ValueError(f"codes must lie in [0, 2**{bits}) for {bits}-bit packing, got values in [{low}, {high}]")
    codes_per_group, bytes_per_group = _group(bits)
    groups = math.ceil(count / codes_per_group)
    work = _pack_work_dtype(bits)
    if count % codes_per_group or flat.dtype != work:  # pad the last group with zero codes
        padded = torch.zeros(groups * codes_per_group, dtype=work, device=codes.device)
        padded[:count] = flat
        flat = padded
    grouped = flat.view(groups, codes_per_group)  # column j: code j of every group
    out = torch.zeros(groups, bytes_per_group, dtype=work, device=codes.device)  # column b: byte b
    for code_index, byte_index, shift in _placements(bits):
        code = grouped[:, code_index]
        part = code << shift if shift >= 0 else code >> -shift
        out[:, byte_index] |= part & 0xFF
    return out.view(-1)[:packed_size(count, bits)].to(torch.uint8)


def unpack(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """Inverse of :func:`pack`: read ``count`` codes of ``bits`` bits from the uint8 tensor ``packed``.

    Returns a 1-D tensor of dtype :func:`code_dtype` ``(bits)`` on ``packed.device``.

    Raises:
        ValueError: ``bits`` out of range, or ``packed`` does not hold exactly ``packed_size(count, bits)`` bytes.
        TypeError: ``packed`` is not uint8.
    """
    check_bits(bits)
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed must be a uint8 tensor, got {packed.dtype}")
    expected = packed_size(count, bits)
    if packed.numel() != expected:
        raise ValueError(f"{count} codes of {bits} bits take {expected} bytes, got {packed.numel()}")
    if count == 0:
        return torch.empty(0, dtype=code_dtype(bits), device=packed.device)
    codes_per_group, bytes_per_group = _group(bits)
    groups = math.ceil(count / codes_per_group)
    work = _pack_work_dtype(bits)
    stream = packed.reshape(-1)
    if expected != groups * bytes_per_group or work != torch.uint8:
        padded = torch.zeros(groups * bytes_per_group, dtype=work, device=packed.device)
        padded[:expected] = stream
        stream = padded
    stream = stream.view(groups, bytes_per_group)
    codes = torch.zeros(groups, codes_per_group, dtype=work, device=packed.device)
    for code_index, byte_index, shift in _placements(bits):
        byte = stream[:, byte_index]
        codes[:, code_index] |= byte >> shift if shift >= 0 else byte << -shift
    codes &= (1 << bits) - 1  # drop the neighbouring codes' bits that shared a byte
    return codes.view(-1)[:count].to(code_dtype(bits))


def _group(bits: int) -> tuple[int, int]:
    """(codes, bytes) of the smallest run of codes that fills whole bytes: 8 codes of 1 bit = 1 byte,
    8 of 3 bits = 3 bytes, 1 of 16 bits = 2 bytes."""
    common = math.gcd(8, bits)
    return 8 // common, bits // common


def _pack_work_dtype(bits: int) -> torch.dtype:
    # When k divides 8 no code straddles a byte, so uint8 arithmetic suffices (and is 8x smaller);
    # otherwise int64 holds a 32-bit code shifted left by up to 7 bits without overflow.
    return torch.uint8 if 8 % bits == 0 else torch.int64


def _placements(bits: int) -> list[tuple[int, int, int]]:
    """``(code j, byte b, shift)`` for every byte each code of a group (see ``_group``) touches.

    ``shift`` is how far left code j's bit 0 sits from byte b's bit 0 (negative: to the right).
    """
    placements = []
    for code_index in range(_group(bits)[0]):
        first_bit = code_index * bits
        last_bit = first_bit + bits - 1
        for byte_index in range(first_bit // 8, last_bit // 8 + 1):
            placements.append((code_index, byte_index, first_bit - 8 * byte_index))
    return placements






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
        return sum(block.numel for block in self.blocks)

    @property
    def num_columns(self) -> int:
        """Columns in the buffer (the number of lower/upper pairs)."""
        return sum(block.num_columns for block in self.blocks)


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


# -- quantize / dequantize --------------------------------------------------------------------------


def quantize(values: torch.Tensor, layout: ColumnLayout, bits: int) -> QuantizedColumns:
    """Quantize the 1-D floating-point buffer ``values`` column by column to ``bits`` bits.

    Raises ValueError for ``bits`` outside 1..32 or a buffer whose size differs from
    ``layout.numel``; TypeError for a non-floating-point buffer.
    """
    _check_buffer(values, layout, bits)
    codes = torch.empty(layout.numel, dtype=code_dtype(bits), device=values.device)
    lower = torch.zeros(layout.num_columns, dtype=torch.float32, device=values.device)
    upper = torch.zeros_like(lower)
    column = 0
    for block in layout.blocks:
        columns = slice(column, column + block.num_columns)
        lower[columns], upper[columns] = _quantize_block(block.view(values), bits, block.view(codes))
        column += block.num_columns
    return QuantizedColumns(codes, lower, upper, bits)


def dequantize(quantized: QuantizedColumns, layout: ColumnLayout, dtype: torch.dtype = torch.float32,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """Return the values ``quantized`` stands for, as a 1-D tensor of ``dtype`` (written into ``out`` if given).

    Raises ValueError when the codes or scales do not match ``layout``.
    """
    bits = check_bits(quantized.bits)
    if quantized.codes.numel() != layout.numel or quantized.lower.numel() != layout.num_columns:
        raise ValueError(f"quantized buffer has {quantized.codes.numel()} codes and {quantized.lower.numel()} "
                         f"columns; the layout has {layout.numel} values in {layout.num_columns} columns")
    if out is None:
        out = torch.empty(layout.numel, dtype=dtype, device=quantized.codes.device)
    column = 0
    for block in layout.blocks:
        columns = slice(column, column + block.num_columns)
        _dequantize_block(block.view(quantized.codes), quantized.lower[columns], quantized.upper[columns], bits,
                          block.view(out))
        column += block.num_columns
    return out


def quantize_with_feedback(values: torch.Tensor, residual: torch.Tensor, layout: ColumnLayout,
                           bits: int) -> QuantizedColumns:
    """Quantize ``values + residual`` and set ``residual`` (in place) to what the quantization lost.

    After the call ``values_before + residual_before == dequantize(result) + residual`` up to float
    rounding: the error is fed back into the next step instead of being dropped (1-bit SGD).
    Raises ValueError when ``residual`` is not shaped like ``values``.
    """
    if residual.shape != values.shape:
        raise ValueError(f"residual shape {tuple(residual.shape)} differs from values shape {tuple(values.shape)}")
    corrected = values + residual
    quantized = quantize(corrected, layout, bits)
    torch.sub(corrected, dequantize(quantized, layout, dtype=corrected.dtype), out=residual)
    return quantized


# -- one block of equally long columns --------------------------------------------------------------
# Each function reads a [num_columns, length] view and writes a view of the same shape, so the
# whole buffer is touched a few times per call, never copied block by block.


def _quantize_block(columns: torch.Tensor, bits: int, codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Write the codes of ``columns`` into ``codes``; return the float32 (lower, upper) per column."""
    if bits == 32:
        codes.copy_(columns.to(torch.float32).contiguous().view(torch.int32))
        codes &= 0xFFFFFFFF  # the bit pattern as an unsigned 32-bit code
        zeros = torch.zeros(columns.shape[0], dtype=torch.float32, device=columns.device)
        return zeros, zeros
    if bits == 1:
        return _quantize_block_1bit(columns, codes)
    return _quantize_block_linear(columns, bits, codes)


def _quantize_block_1bit(columns: torch.Tensor, codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    non_negative = torch.ge(columns, 0, out=codes.view(torch.bool))  # the codes themselves (0/1 bytes)
    count1 = non_negative.sum(dim=1)
    count0 = columns.shape[1] - count1
    # clamp keeps exactly the values of one side (the other side becomes 0 and adds nothing)
    sum0 = columns.clamp(max=0).sum(dim=1, dtype=torch.float32)
    sum1 = columns.clamp(min=0).sum(dim=1, dtype=torch.float32)
    # CNTK: "happens for all-zero columns which do exist (mean0 is 0 in that case)"
    mean0 = sum0 / count0.clamp(min=1)
    mean1 = sum1 / count1.clamp(min=1)
    mid = 0.5 * (mean0 + mean1)
    radius = 2.0 * (mean1 - mid)
    return mid - radius, mid + radius


def _quantize_block_linear(columns: torch.Tensor, bits: int, codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
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


def _dequantize_block(codes: torch.Tensor, lower: torch.Tensor, upper: torch.Tensor, bits: int,
                      out: torch.Tensor) -> None:
    """Write the values of ``codes`` (float32 scales per column) into ``out``."""
    if bits == 32:
        signed = torch.where(codes >= 1 << 31, codes - (1 << 32), codes)
        out.copy_(signed.to(torch.int32).view(torch.float32))
        return
    work = _work_dtype(bits)
    levels = 2 if bits == 1 else (1 << bits) - 1  # CNTK: usedrangeend = 2**k - (k > 1)
    span = upper.to(work) - lower.to(work)
    step = torch.where(span < _TINY_RANGE, torch.zeros_like(span), span / levels)
    # (q + 0.5) * step + lower, per column, one rounding per operation: for 1 bit this is bit for bit
    # CNTK's Unquantize(0) = 0.5*step + lower = mean0 and Unquantize(1) = 1.5*step + lower = mean1
    decoded = codes.to(work).add_(0.5).mul_(step[:, None]).add_(lower.to(work)[:, None])
    out.copy_(decoded)


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


