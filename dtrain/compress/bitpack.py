"""Bit packing: k-bit integer codes (k = 1..32) to and from a dense uint8 byte stream.

Codes are laid out as one little-endian bit stream, least significant bit first (CNTK's
``ColumnQuantizer`` also fills each word from bit 0 upwards): code ``i`` occupies stream bits
``[i*k, (i+1)*k)`` and byte ``b`` holds stream bits ``[8b, 8b+8)``. ``n`` codes therefore take
exactly ``ceil(n*k/8)`` bytes, with no per-code or per-column padding.

Both directions are vectorised, with no loop over codes:

* 1 bit on CPU: NumPy's ``packbits``/``unpackbits`` (``bitorder="little"``), one C pass;
* 8, 16, 24 or 32 bits: each code is its low ``k/8`` bytes (little-endian), a byte view;
* every other case: codes are processed in groups that fill whole bytes (8 codes of 3 bits make
  3 bytes), viewed as a ``[groups, codes]`` tensor, and the work is a fixed set of at most
  ``8 * (ceil(k/8) + 1)`` shift-and-or operations on whole columns of it.

All paths produce the same stream.
"""
from __future__ import annotations

import math
import sys

import numpy as np
import torch

from dtrain import checks

MAX_BITS = 32
"""The widest code :func:`pack` accepts (a float32's bit pattern, CNTK's no-quantization case)."""

_LITTLE_ENDIAN = sys.byteorder == "little"  # the byte-view paths read an int64's low bytes first

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
    if bits == 1 and flat.device.type == "cpu":
        return torch.from_numpy(np.packbits(flat.to(torch.uint8).numpy(), bitorder="little"))
    if bits == 8:
        return flat.to(torch.uint8, copy=True)
    if bits % 8 == 0 and _LITTLE_ENDIAN:  # whole bytes: each code's low bits/8 bytes, in order
        return flat.to(torch.int64).view(torch.uint8).view(count, 8)[:, :bits // 8].reshape(-1)
    codes_per_group, bytes_per_group = _group(bits)
    groups = math.ceil(count / codes_per_group)
    work = _work_dtype(bits)
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
    stream = packed.reshape(-1)
    if bits == 1 and stream.device.type == "cpu":
        return torch.from_numpy(np.unpackbits(stream.numpy(), count=count, bitorder="little"))
    if bits % 8 == 0 and _LITTLE_ENDIAN:
        if bits == 8:
            return stream.clone()
        wide = torch.zeros(count, 8, dtype=torch.uint8, device=packed.device)
        wide[:, :bits // 8] = stream.view(count, bits // 8)
        return wide.view(torch.int64).view(-1)
    codes_per_group, bytes_per_group = _group(bits)
    groups = math.ceil(count / codes_per_group)
    work = _work_dtype(bits)
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


def _work_dtype(bits: int) -> torch.dtype:
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


__all__ = ["MAX_BITS", "check_bits", "code_dtype", "pack", "packed_size", "unpack"]
