"""Chunked top-k sparsification with k-bit values: SparseLoCo's compressor, as pure maths (nothing here talks).

A flat buffer of ``numel`` values is cut into chunks of ``chunk_size`` (the last may be shorter); each chunk keeps
its ``top_k`` largest values by magnitude (a shorter last chunk keeps ``ceil(top_k * length / chunk_size)``), and
the kept values of each chunk are quantized to ``bits`` bits, sign and magnitude: one bit of sign, and
``bits - 1`` bits of magnitude on ``2**(bits-1)`` levels between the chunk's smallest and largest kept magnitude
(at 1 bit the sign alone, at the middle of that range; at 32 bits the exact float32). Not the k-bit gradient
quantizer (:mod:`dtrain.compress.quantizer`): its range, the mean ± 5 standard deviations, puts the kept values,
large and of both signs, all on its middle level at 2 bits. What travels per kept value is its position inside
its chunk (``ceil(log2(chunk_size))`` bits) and its code (``bits`` bits); per chunk, two float32 bounds.
At SparseLoCo's chunks of 4,096 with 64 kept, 2-bit values: 12 + 2 bits per kept value plus 1 bit of bounds, about
0.23 bits per value of the buffer against 32 (Sarfi et al. 2025, arXiv 2508.15706).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dtrain.compress import bitpack


@dataclass(frozen=True)
class ChunkLayout:
    """Where the kept values of a buffer of ``numel`` values come from, and how many bytes they travel in."""

    numel: int
    chunk_size: int
    top_k: int

    @property
    def full_chunks(self) -> int:
        """Chunks of exactly ``chunk_size`` values."""
        return self.numel // self.chunk_size

    @property
    def tail(self) -> int:
        """Values in the shorter last chunk (0: none)."""
        return self.numel - self.full_chunks * self.chunk_size

    @property
    def tail_k(self) -> int:
        """Values the last, shorter chunk keeps: its share of ``top_k``, at least 1."""
        if not self.tail:
            return 0
        return min(self.tail, max(1, math.ceil(self.top_k * self.tail / self.chunk_size)))

    @property
    def kept(self) -> int:
        """Values kept in all."""
        return self.full_chunks * min(self.top_k, self.chunk_size) + self.tail_k

    @property
    def index_bits(self) -> int:
        """Bits of a position inside a chunk."""
        return max(1, math.ceil(math.log2(self.chunk_size)))

    @property
    def chunks(self) -> int:
        """Chunks in all (the last may be shorter)."""
        return self.full_chunks + (1 if self.tail else 0)

    def blocks(self) -> list[tuple[int, int]]:
        """``(chunks, kept per chunk)`` of the full chunks, then of the shorter last one: the kept values' layout."""
        blocks = [(self.full_chunks, min(self.top_k, self.chunk_size))] if self.full_chunks else []
        return blocks + ([(1, self.tail_k)] if self.tail_k else [])

    def payload_bytes(self, bits: int) -> int:
        """Bytes of one rank's message: packed positions, packed codes, and two float32 bounds per chunk."""
        return bitpack.packed_size(self.kept, self.index_bits) + bitpack.packed_size(self.kept, bits) + 8 * self.chunks


def select(values: torch.Tensor, layout: ChunkLayout) -> torch.Tensor:
    """The flat positions of the kept values of the 1-D ``values``: each chunk's ``top_k`` largest by magnitude,
    chunk by chunk, in each chunk by decreasing magnitude."""
    parts = []
    size, full = layout.chunk_size, layout.full_chunks
    if full:
        local = values[:full * size].view(full, size).abs().topk(min(layout.top_k, size), dim=1).indices
        parts.append((local + torch.arange(full, device=values.device)[:, None] * size).reshape(-1))
    if layout.tail_k:
        parts.append(values[full * size:].abs().topk(layout.tail_k).indices + full * size)
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def quantize(kept: torch.Tensor, layout: ChunkLayout, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(codes, lower, upper)`` of the kept float32 values, chunk by chunk (:func:`select`'s order): sign and
    magnitude codes of ``bits`` bits, and each chunk's smallest and largest kept magnitude."""
    if bits == 32:
        zeros = torch.zeros(layout.chunks, dtype=torch.float32, device=kept.device)
        return kept.view(torch.int32).to(torch.int64) & 0xFFFFFFFF, zeros, zeros
    codes, lowers, uppers, offset = [], [], [], 0
    levels = 1 << (bits - 1)
    for chunks, count in layout.blocks():
        values = kept[offset:offset + chunks * count].view(chunks, count)
        magnitude = values.abs()
        lower, upper = magnitude.amin(dim=1), magnitude.amax(dim=1)
        step = (upper - lower) / levels
        level = torch.where(step[:, None] > 0, (magnitude - lower[:, None]) / step[:, None], torch.zeros_like(magnitude))
        level = level.floor_().clamp_(0, levels - 1).to(torch.int64)
        codes.append(((values < 0).to(torch.int64) << (bits - 1) | level).reshape(-1))  # 1 bit: the sign alone
        lowers.append(lower)
        uppers.append(upper)
        offset += chunks * count
    return torch.cat(codes), torch.cat(lowers), torch.cat(uppers)


def dequantize(codes: torch.Tensor, lower: torch.Tensor, upper: torch.Tensor, layout: ChunkLayout,
               bits: int) -> torch.Tensor:
    """The float32 values the codes of :func:`quantize` stand for: ``sign * (lower + (level + 0.5) * step)``."""
    if bits == 32:
        codes = codes.to(torch.int64)
        return torch.where(codes < 2 ** 31, codes, codes - 2 ** 32).to(torch.int32).view(torch.float32)  # the bits
    codes = codes.to(torch.int64)
    levels = 1 << (bits - 1)
    sign = 1.0 - 2.0 * (codes >> (bits - 1)).to(torch.float32)
    level = (codes & (levels - 1)).to(torch.float32)  # 1 bit: level 0, the middle of the range
    parts, offset, chunk = [], 0, 0
    for chunks, count in layout.blocks():
        low, high = lower[chunk:chunk + chunks, None], upper[chunk:chunk + chunks, None]
        step = (high - low) / levels
        magnitude = level[offset:offset + chunks * count].view(chunks, count).add(0.5).mul_(step).add_(low)
        parts.append(magnitude.reshape(-1))
        offset += chunks * count
        chunk += chunks
    return torch.cat(parts).mul_(sign)


def encode(values: torch.Tensor, positions: torch.Tensor, layout: ChunkLayout, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(message, decoded)``: the uint8 message of the kept values ``values[positions]`` (their positions inside
    their chunks and ``bits``-bit codes), and the values the receivers will decode from it (error feedback keeps
    the difference)."""
    codes, lower, upper = quantize(values[positions].to(torch.float32).contiguous(), layout, bits)
    local = positions % layout.chunk_size
    message = torch.cat([bitpack.pack(local, layout.index_bits), bitpack.pack(codes, bits),
                         lower.view(torch.uint8), upper.view(torch.uint8)])
    return message, dequantize(codes, lower, upper, layout, bits)


def decode(message: torch.Tensor, layout: ChunkLayout, bits: int,
           starts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(positions, values)`` of one rank's message: the flat positions of its kept values and their decoded values.
    ``starts``: :func:`chunk_starts` of the layout, where the caller decodes several messages (None: computed here).

    Raises:
        ValueError: the message is not the size this layout's messages have.
    """
    expected = layout.payload_bytes(bits)
    if message.numel() != expected:
        raise ValueError(f"a sparse message of {message.numel()} bytes, expected {expected} for {layout}")
    index_bytes, code_bytes = bitpack.packed_size(layout.kept, layout.index_bits), bitpack.packed_size(layout.kept, bits)
    local = bitpack.unpack(message[:index_bytes], layout.index_bits, layout.kept).to(torch.int64)
    codes = bitpack.unpack(message[index_bytes:index_bytes + code_bytes], bits, layout.kept)
    bounds = message[index_bytes + code_bytes:].clone().view(torch.float32)  # a copy: float32 needs 4-byte alignment
    values = dequantize(codes, bounds[:layout.chunks], bounds[layout.chunks:], layout, bits)
    return local + (chunk_starts(layout, message.device) if starts is None else starts), values


def chunk_starts(layout: ChunkLayout, device: torch.device) -> torch.Tensor:
    """The flat position of each kept value's chunk start, in :func:`select`'s order."""
    per_chunk = min(layout.top_k, layout.chunk_size)
    starts = torch.arange(layout.full_chunks, device=device).repeat_interleave(per_chunk) * layout.chunk_size
    if layout.tail_k:
        tail = torch.full((layout.tail_k,), layout.full_chunks * layout.chunk_size, device=device, dtype=starts.dtype)
        starts = torch.cat([starts, tail])
    return starts


__all__ = ["ChunkLayout", "chunk_starts", "decode", "dequantize", "encode", "quantize", "select"]
