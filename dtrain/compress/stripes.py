"""The stripe layout and message format of CNTK's two-phase quantized exchange, as pure tensor maths.

:class:`StripeLayout` says where each tensor's columns live in the stripe-major buffer the
exchange quantizes (stripe j belongs to worker j, CNTK's ``GetStripeForNode``);
:func:`encode_message` / :func:`decode_message` turn one quantized stripe into the bytes that
travel (``lower | upper | packed codes``) and back. Nothing here talks: the exchange that sends
these messages is :class:`dtrain.exchange.quantized.QuantizedExchange`
(``docs/semantics.md#two-phase-exchange``).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dtrain.compress import bitpack
from dtrain.compress.quantizer import ColumnBlock, ColumnLayout, QuantizedColumns, column_shape

_BYTES_PER_SCALE = 4  # lower and upper are float32


def stripe_bounds(num_columns: int, stripe: int, num_stripes: int) -> tuple[int, int]:
    """Return the ``[start, end)`` columns of ``stripe`` out of ``num_stripes`` (CNTK's ``GetStripeForNode``).

    Each stripe gets ``num_columns // num_stripes`` columns; the first ``num_columns % num_stripes``
    stripes get one more. Raises ValueError for a stripe outside ``[0, num_stripes)``.
    """
    if not 0 <= stripe < num_stripes:
        raise ValueError(f"stripe {stripe} is outside [0, {num_stripes})")
    per_stripe, extra = divmod(num_columns, num_stripes)
    start = per_stripe * stripe + min(extra, stripe)
    return start, start + per_stripe + (1 if stripe < extra else 0)


@dataclass(frozen=True)
class _Piece:
    """Columns ``[first_column, end_column)`` of tensor ``tensor_index`` (column view), stored from ``offset``."""

    tensor_index: int
    first_column: int
    end_column: int
    offset: int


class StripeLayout:
    """Where each tensor's columns live in the stripe-major flat buffer the exchange works on.

    The buffer holds stripe 0 (stripe 0 of tensor 0, of tensor 1, ...), then stripe 1, and so on,
    so every stripe is one contiguous range of values and of columns, and a message is a slice.
    Neighbouring pieces of a stripe with equally long columns form one :class:`ColumnBlock`, so
    the quantizer makes one vectorised pass over them.

    Args:
        shapes: the shapes of the tensors exchanged (e.g. the parameters, in optimizer order).
        num_stripes: N, the number of workers.

    Raises ValueError for ``num_stripes < 1``.
    """

    def __init__(self, shapes: Sequence[Sequence[int]], num_stripes: int):
        if num_stripes < 1:
            raise ValueError(f"num_stripes must be >= 1, got {num_stripes}")
        self.shapes = [tuple(int(size) for size in shape) for shape in shapes]
        self.num_stripes = num_stripes
        self.column_shapes = [column_shape(shape) for shape in self.shapes]
        self.pieces: list[_Piece] = []  # in buffer order
        blocks: list[ColumnBlock] = []
        self.stripe_blocks: list[tuple[int, int]] = []    # block index range of each stripe
        self.stripe_values: list[tuple[int, int]] = []    # value range of each stripe in the buffer
        self.stripe_columns: list[tuple[int, int]] = []   # column range of each stripe
        offset = column = 0
        for stripe in range(num_stripes):
            first_block, first_value, first_column = len(blocks), offset, column
            for tensor_index, (num_columns, length) in enumerate(self.column_shapes):
                start, end = stripe_bounds(num_columns, stripe, num_stripes)
                if end > start:
                    self.pieces.append(_Piece(tensor_index, start, end, offset))
                    previous = blocks[-1] if len(blocks) > first_block else None
                    if previous is not None and previous.column_length == length:
                        blocks[-1] = ColumnBlock(previous.offset, previous.num_columns + end - start, length)
                    else:
                        blocks.append(ColumnBlock(offset, end - start, length))
                    offset += (end - start) * length
                    column += end - start
            self.stripe_blocks.append((first_block, len(blocks)))
            self.stripe_values.append((first_value, offset))
            self.stripe_columns.append((first_column, column))
        self.columns = ColumnLayout(tuple(blocks))
        self.numel = offset
        self._stripes = [self._rebased(index) for index in range(num_stripes)]

    def stripe(self, index: int) -> ColumnLayout:
        """The column layout of stripe ``index`` alone, as a buffer of its own (offsets from 0)."""
        return self._stripes[index]

    def _rebased(self, index: int) -> ColumnLayout:
        first, end = self.stripe_blocks[index]
        base = self.stripe_values[index][0]
        return ColumnLayout(tuple(ColumnBlock(block.offset - base, block.num_columns, block.column_length)
                                  for block in self.columns.blocks[first:end]))

    def message_sizes(self, bits: int) -> list[int]:
        """Bytes of each stripe's message at ``bits`` bits: 8 per column plus the packed codes."""
        return [2 * _BYTES_PER_SCALE * (columns[1] - columns[0]) + bitpack.packed_size(values[1] - values[0], bits)
                for columns, values in zip(self.stripe_columns, self.stripe_values)]

    def flatten(self, tensors: Sequence[torch.Tensor], out: torch.Tensor | None = None,
                scale: float = 1.0) -> torch.Tensor:
        """Copy ``tensors`` (shaped like ``shapes``), times ``scale``, into a stripe-major 1-D buffer.

        ``out``: the buffer to write (``numel`` values of the tensors' dtype); a new one when None.
        """
        self._check(tensors)
        views = [_column_view(tensor, shape) for tensor, shape in zip(tensors, self.column_shapes)]
        parts = [views[piece.tensor_index][piece.first_column:piece.end_column].reshape(-1) for piece in self.pieces]
        if not parts:
            return torch.zeros(0) if out is None else out
        if out is None or scale == 1.0:
            flat = torch.cat(parts) if out is None else torch.cat(parts, out=out)
            return flat.mul_(scale) if scale != 1.0 else flat
        for piece, part in zip(self.pieces, parts):  # one pass: scale while copying
            torch.mul(part, scale, out=out[piece.offset:piece.offset + part.numel()])
        return out

    def unflatten_(self, flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
        """Copy the stripe-major buffer ``flat`` back into ``tensors`` (in place)."""
        self._check(tensors)
        if flat.numel() != self.numel:
            raise ValueError(f"buffer has {flat.numel()} values, the layout {self.numel}")
        views = [_column_view(tensor, shape, writable=True) for tensor, shape in zip(tensors, self.column_shapes)]
        for piece in self.pieces:
            target = views[piece.tensor_index][piece.first_column:piece.end_column]
            target.copy_(flat[piece.offset:piece.offset + target.numel()].view_as(target))

    def _check(self, tensors: Sequence[torch.Tensor]) -> None:
        shapes = [tuple(tensor.shape) for tensor in tensors]
        if shapes != self.shapes:
            raise ValueError(f"tensors have shapes {shapes}, the exchange was set up for {self.shapes}; "
                             f"create a new QuantizedExchange for a different set of tensors")


def _column_view(tensor: torch.Tensor, shape: tuple[int, int], writable: bool = False) -> torch.Tensor:
    if not tensor.numel():
        return tensor.reshape(0, 0)
    if writable and not tensor.is_contiguous():
        raise ValueError("the exchange writes results in place and needs contiguous tensors; "
                         "pass tensor.contiguous() and copy back")
    return tensor.view(shape) if writable else tensor.reshape(shape)


# -- messages ----------------------------------------------------------------------------------------


def encode_message(quantized: QuantizedColumns) -> torch.Tensor:
    """Return the bytes that travel for one quantized stripe: ``lower | upper | packed codes`` (uint8).

    The float32 scales are in the machine's byte order (all ranks of a job share one architecture).
    """
    scales = torch.cat([quantized.lower, quantized.upper]).to(torch.float32)
    return torch.cat([scales.view(torch.uint8), bitpack.pack(quantized.codes, quantized.bits)])


def decode_message(message: torch.Tensor, layout: ColumnLayout, bits: int) -> QuantizedColumns:
    """Inverse of :func:`encode_message` for a stripe of ``layout`` quantized to ``bits`` bits.

    Raises ValueError when the message does not have the size the layout implies.
    """
    columns = layout.num_columns
    scale_bytes = 2 * _BYTES_PER_SCALE * columns
    expected = scale_bytes + bitpack.packed_size(layout.numel, bits)
    if message.numel() != expected:
        raise ValueError(f"a {bits}-bit message for {layout.numel} values in {columns} columns has {expected} "
                         f"bytes, got {message.numel()}")
    scales = message[:scale_bytes].clone().view(torch.float32)  # clone: a float view needs aligned storage
    codes = bitpack.unpack(message[scale_bytes:], bits, layout.numel)
    return QuantizedColumns(codes, scales[:columns], scales[columns:], bits)


def stripe_of(quantized: QuantizedColumns, layout: StripeLayout, stripe: int) -> QuantizedColumns:
    """The part of a whole-buffer quantization that belongs to ``stripe`` (views, no copies)."""
    first_value, end_value = layout.stripe_values[stripe]
    first_column, end_column = layout.stripe_columns[stripe]
    return QuantizedColumns(quantized.codes[first_value:end_value], quantized.lower[first_column:end_column],
                            quantized.upper[first_column:end_column], quantized.bits)


__all__ = ["StripeLayout", "decode_message", "encode_message", "stripe_bounds", "stripe_of"]
