"""CNTK's two-phase quantized gradient exchange (``QuantizedDistributedCommunicator``), with error feedback.

A striped reduce-scatter followed by an all-gather, both on quantized, bit-packed data
(``docs/semantics.md#two-phase-exchange``):

1. The columns of every tensor are split into N stripes, one per worker; the first
   ``columns % N`` workers get one extra column (CNTK's ``GetStripeForNode``, applied per tensor
   as CNTK applies it per gradient matrix).
2. Every worker quantizes its whole gradient plus its *worker residual* and sends stripe j to
   worker j (all-to-all).
3. Owner j unquantizes the N quantized copies of its stripe (its own included, quantized) and sums
   them, quantizes the sum plus its *owner residual*, and all-gathers the result.
4. Every worker unquantizes all stripes; every rank therefore ends with the same bits.

What travels for a stripe is one uint8 message: ``lower`` (float32 per column) | ``upper``
(float32 per column) | the packed codes (``bitpack``).

Transports. Phase 1 uses the communicator's ``all_to_all`` with per-peer sizes
(:meth:`dtrain.comm.Communicator.all_to_all`: ``all_to_all_single`` on Gloo and NCCL). A
communicator without one (and ``all_to_all="allgather"``) gets a fallback built from
``Communicator.allgather``: every rank gathers every rank's messages and keeps those addressed
to it, which moves N times the bytes. Phase 2 is
``Communicator.allgather`` of the messages padded to the longest stripe's.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dtrain import checks
from dtrain.comm.torch_dist import TorchDistCommunicator
from dtrain.compress import bitpack
from dtrain.compress.quantizer import (
    ColumnBlock,
    ColumnLayout,
    QuantizedColumns,
    Workspace,
    column_shape,
    dequantize,
    quantize_with_feedback,
)

ALL_TO_ALL_CHOICES = ("auto", "torch", "allgather")
"""How phase 1 travels: ``torch`` (the communicator's ``all_to_all``: ``all_to_all_single`` on a
torch.distributed one), ``allgather`` (the fallback), ``auto`` (``all_to_all`` when the communicator has one)."""

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


# -- transports --------------------------------------------------------------------------------------


def _all_to_all_native(comm, sends: list[torch.Tensor], receive_sizes: list[int]) -> tuple[list[torch.Tensor], int]:
    """``sends[j]`` to rank j through ``comm.all_to_all``; returns (received, bytes sent to other ranks)."""
    received = comm.all_to_all(sends, receive_sizes=receive_sizes)
    sent = sum(message.numel() for rank, message in enumerate(sends) if rank != comm.rank)
    return received, sent


def _all_to_all_allgather(comm, sends: list[torch.Tensor], sizes: list[list[int]]) -> tuple[list[torch.Tensor], int]:
    """The same through ``comm.allgather``: each rank gathers everything and keeps its part.

    ``sizes[src][dst]`` is the length of the message ``src`` sends ``dst`` (known on every rank).
    Bytes sent: (N - 1) copies of this rank's padded concatenation, as a ring all-gather sends.
    """
    gathered, sent = _all_gather_padded(comm, torch.cat(sends), [sum(row) for row in sizes])
    received = []
    for source, data in enumerate(gathered):
        start = sum(sizes[source][:comm.rank])
        received.append(data[start:start + sizes[source][comm.rank]])
    return received, sent


def _all_gather_padded(comm, message: torch.Tensor, sizes: list[int]) -> tuple[list[torch.Tensor], int]:
    """Every rank's ``message`` (rank j's is ``sizes[j]`` bytes) via ``comm.allgather`` of padded copies."""
    longest = max(sizes)
    if longest == 0:  # nothing to move (every rank knows the sizes, so all skip together)
        return [message[:0] for _ in sizes], 0
    outgoing = torch.zeros(longest, dtype=torch.uint8, device=message.device)
    outgoing[:message.numel()] = message
    gathered = comm.allgather(outgoing)
    return [data[:size] for data, size in zip(gathered, sizes)], (comm.size - 1) * longest


# -- the exchange ------------------------------------------------------------------------------------


class QuantizedExchange:
    """Sums tensors over all ranks through CNTK's two-phase k-bit exchange with two error-feedback buffers.

    A stateful strategy object (like PyTorch's ``PowerSGDState``): create one per set of tensors
    and call :meth:`allreduce_` every step on every rank, in the same order.

    Args:
        comm: the job's :class:`~dtrain.comm.Communicator`.
        num_bits: bits per value on the wire, 1 to 32 (32: CNTK's lossless bit-pattern path).
        all_to_all: phase 1's transport: ``auto`` (``torch`` for a TorchDistCommunicator, else
            ``allgather``), ``torch`` (``comm.all_to_all``: ``all_to_all_single``) or ``allgather``
            (N times the bytes).
        error_feedback: carry each step's quantization error into the next (1-bit SGD needs it);
            ``False`` drops it, to show what error feedback is worth.

    Raises:
        ValueError: ``num_bits`` outside 1..32, an unknown ``all_to_all``, or ``torch`` without a
            torch.distributed communicator.
    """

    def __init__(self, comm, num_bits: int, all_to_all: str = "auto", error_feedback: bool = True):
        if all_to_all not in ALL_TO_ALL_CHOICES:
            raise ValueError(f"all_to_all={all_to_all!r} is not one of {', '.join(ALL_TO_ALL_CHOICES)}")
        has_torch = isinstance(comm, TorchDistCommunicator)
        if all_to_all == "torch" and not has_torch:
            raise ValueError(f"all_to_all='torch' needs a TorchDistCommunicator, got {type(comm).__name__}; "
                             f"use all_to_all='allgather'")
        # -- hyper-parameters
        self.comm = comm
        self.num_bits = bitpack.check_bits(num_bits, "num_bits")
        if all_to_all == "auto":
            all_to_all = "torch" if has_torch else "allgather"
        self.all_to_all = all_to_all
        self.error_feedback = checks.boolean("error_feedback", error_feedback)  # False: residuals dropped every step (an ablation)
        # -- state (this rank's own; not replicated, not in the model's checkpoint)
        self.layout: StripeLayout | None = None           # set by the first call (or load_state_dict)
        self.worker_residual: torch.Tensor | None = None  # [layout.numel] stripe-major: what quantizing
        #                                                   this rank's gradient lost, added back next step
        self.owner_residual: torch.Tensor | None = None   # [own stripe's values]: what re-quantizing the
        #                                                   summed stripe this rank owns lost
        # -- statistics
        self.bytes_sent_last_step = 0                # bytes this rank handed to the transport (both phases)
        self.full_precision_bytes_last_step = 0      # a float32 ring all-reduce's bytes per rank: 2(N-1)/N * 4 * numel
        self.seconds_last_step = 0.0                 # wall-clock seconds of the last exchange
        self.transport_seconds_last_step = 0.0       # ... of which in the two collectives (waiting for peers included)
        self._workspace = Workspace()                # scratch buffers reused every step (no per-step allocation)

    # -- the public operation ----------------------------------------------------------------------
    @property
    def compute_seconds_last_step(self) -> float:
        """Seconds of the last exchange outside the collectives: flatten, quantize, pack, unpack, dequantize."""
        return self.seconds_last_step - self.transport_seconds_last_step

    @property
    def compression_ratio(self) -> float:
        """Full-precision all-reduce bytes / bytes actually sent, for the last step (nan before any)."""
        if not self.bytes_sent_last_step:
            return float("nan")
        return self.full_precision_bytes_last_step / self.bytes_sent_last_step

    def allreduce_(self, tensors: Sequence[torch.Tensor], scale: float = 1.0) -> Sequence[torch.Tensor]:
        """Replace every tensor by (approximately) the sum over ranks of ``scale * tensor``; return them.

        All ranks end with bit-identical results. With one rank the tensors are only scaled
        (CNTK does not quantize then). Raises ValueError when the shapes differ from the first call's.
        """
        if self.comm.size == 1:
            if scale != 1.0:
                for tensor in tensors:
                    tensor.mul_(scale)
            return tensors
        started = time.perf_counter()
        layout = self._layout_for([tuple(tensor.shape) for tensor in tensors])
        dtypes = {tensor.dtype for tensor in tensors}
        flat = None
        if len(dtypes) == 1 and tensors:  # the usual case: one reused buffer, written in place by the exchange
            flat = self._workspace.take("flat", layout.numel, dtypes.pop(), tensors[0].device)
        flat = layout.flatten(tensors, out=flat, scale=scale)
        layout.unflatten_(self._exchange_into(flat, flat, started), tensors)
        self.seconds_last_step = time.perf_counter() - started
        return tensors

    def exchange(self, flat: torch.Tensor) -> torch.Tensor:
        """The two phases on a stripe-major buffer (see :class:`StripeLayout`); returns the summed buffer.

        A collective. Raises RuntimeError when called before the layout is known.
        """
        return self._exchange_into(flat, torch.empty_like(flat), time.perf_counter())

    def _exchange_into(self, flat: torch.Tensor, result: torch.Tensor, started: float) -> torch.Tensor:
        """:meth:`exchange` writing the sum into ``result`` (which may be ``flat`` itself: it is read first)."""
        if self.layout is None:
            raise RuntimeError("call allreduce_ (or load_state_dict) first, so the exchange knows the tensors' layout")
        workspace = self._workspace
        layout, bits, rank, size = self.layout, self.num_bits, self.comm.rank, self.comm.size
        sizes = layout.message_sizes(bits)
        if self.worker_residual is None:
            self._zero_residuals(flat)
        elif not self.error_feedback:
            self.reset()

        # phase 1: quantize everything with the worker residual; stripe j goes to its owner j
        quantized = quantize_with_feedback(flat, self.worker_residual, layout.columns, bits, workspace)
        sends = [encode_message(_stripe_of(quantized, layout, stripe)) for stripe in range(size)]
        transport_started = time.perf_counter()
        if self.all_to_all == "torch":
            received, sent_phase1 = _all_to_all_native(self.comm, sends, [sizes[rank]] * size)
        else:
            received, sent_phase1 = _all_to_all_allgather(self.comm, sends, [sizes] * size)
        transport = time.perf_counter() - transport_started

        # the owner: sum the N quantized copies of its stripe, re-quantize with the owner residual
        own = layout.stripe(rank)
        total = workspace.take("total", own.numel, flat.dtype, flat.device).zero_()
        for message in received:
            total += dequantize(decode_message(message, own, bits), own, dtype=flat.dtype, workspace=workspace)
        summed = encode_message(quantize_with_feedback(total, self.owner_residual, own, bits, workspace))

        # phase 2: every owner's summed stripe to everyone; all ranks decode the same bytes
        transport_started = time.perf_counter()
        gathered, sent_phase2 = _all_gather_padded(self.comm, summed, sizes)
        transport += time.perf_counter() - transport_started
        for stripe, message in enumerate(gathered):
            start, end = layout.stripe_values[stripe]
            part = layout.stripe(stripe)
            dequantize(decode_message(message, part, bits), part, dtype=flat.dtype, out=result[start:end])

        self.bytes_sent_last_step = sent_phase1 + sent_phase2
        self.full_precision_bytes_last_step = full_precision_allreduce_bytes(layout.numel, size)
        self.transport_seconds_last_step = transport
        self.seconds_last_step = time.perf_counter() - started
        return result

    # -- state -------------------------------------------------------------------------------------
    def reset(self) -> None:
        """Zero both residuals (CNTK does this at every checkpoint)."""
        for residual in (self.worker_residual, self.owner_residual):
            if residual is not None:
                residual.zero_()

    def state_dict(self) -> dict[str, Any]:
        """This rank's residuals, in tensor order, so they load at any world size.

        ``worker_residual`` and ``owner_residual`` are 1-D float tensors of all values (tensor after
        tensor, each flattened); the owner residual is zero outside the stripe this rank owns.
        Before the first exchange both are None.
        """
        state: dict[str, Any] = {"num_bits": self.num_bits, "world_size": self.comm.size, "rank": self.comm.rank,
                                 "shapes": None, "worker_residual": None, "owner_residual": None}
        if self.layout is None or self.worker_residual is None:
            return state
        owner_full = torch.zeros_like(self.worker_residual)
        start, end = self.layout.stripe_values[self.comm.rank]
        owner_full[start:end] = self.owner_residual
        state.update(shapes=[list(shape) for shape in self.layout.shapes],
                     worker_residual=self._to_tensor_order(self.worker_residual),
                     owner_residual=self._to_tensor_order(owner_full))
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore residuals saved by :meth:`state_dict` (at this or another world size).

        The owner residual keeps the part of the saved one that falls in this rank's stripe now.
        Raises ValueError when the saved shapes differ from the tensors this exchange was set up for.
        """
        if state.get("shapes") is None:
            self.worker_residual = self.owner_residual = None
            return
        layout = self._layout_for([tuple(shape) for shape in state["shapes"]])
        worker = torch.as_tensor(state["worker_residual"])
        owner = torch.as_tensor(state["owner_residual"])
        if worker.numel() != layout.numel or owner.numel() != layout.numel:
            raise ValueError(f"saved residuals have {worker.numel()} and {owner.numel()} values, "
                             f"the tensors {layout.numel}")
        self.worker_residual = self._from_tensor_order(worker)
        start, end = layout.stripe_values[self.comm.rank]
        self.owner_residual = self._from_tensor_order(owner)[start:end].clone()

    # -- helpers -----------------------------------------------------------------------------------
    def _layout_for(self, shapes: list[tuple[int, ...]]) -> StripeLayout:
        if self.layout is None:
            self.layout = StripeLayout(shapes, self.comm.size)
        elif [tuple(shape) for shape in shapes] != self.layout.shapes:
            raise ValueError(f"tensors have shapes {shapes}, this exchange was set up for {self.layout.shapes}; "
                             f"create a new QuantizedExchange for a different set of tensors")
        return self.layout

    def _zero_residuals(self, like: torch.Tensor) -> None:
        start, end = self.layout.stripe_values[self.comm.rank]
        self.worker_residual = torch.zeros_like(like)
        self.owner_residual = torch.zeros(end - start, dtype=like.dtype, device=like.device)

    def _to_tensor_order(self, flat: torch.Tensor) -> torch.Tensor:
        tensors = [torch.zeros(shape, dtype=flat.dtype) for shape in self.layout.shapes]
        self.layout.unflatten_(flat.detach().cpu(), tensors)
        if not tensors:
            return torch.zeros(0, dtype=flat.dtype)
        return torch.cat([tensor.reshape(-1) for tensor in tensors])

    def _from_tensor_order(self, values: torch.Tensor) -> torch.Tensor:
        tensors, offset = [], 0
        for shape in self.layout.shapes:
            count = 1
            for size in shape:
                count *= size
            tensors.append(values[offset:offset + count].reshape(shape))
            offset += count
        return self.layout.flatten(tensors).to(self.comm.device)


def full_precision_allreduce_bytes(numel: int, world_size: int) -> int:
    """Bytes one rank sends in a float32 ring (or reduce-scatter + all-gather) all-reduce of ``numel`` values.

    ``2 * (N - 1) / N * 4 * numel``; the same formula is what the two-phase exchange sends at 32 bits.
    """
    return round(2 * (world_size - 1) * 4 * numel / world_size)


def _stripe_of(quantized: QuantizedColumns, layout: StripeLayout, stripe: int) -> QuantizedColumns:
    """The part of a whole-buffer quantization that belongs to ``stripe`` (views, no copies)."""
    first_value, end_value = layout.stripe_values[stripe]
    first_column, end_column = layout.stripe_columns[stripe]
    return QuantizedColumns(quantized.codes[first_value:end_value], quantized.lower[first_column:end_column],
                            quantized.upper[first_column:end_column], quantized.bits)


__all__ = [
    "ALL_TO_ALL_CHOICES", "QuantizedExchange", "StripeLayout", "decode_message", "encode_message",
    "full_precision_allreduce_bytes", "stripe_bounds",
]
