"""Gradient buckets for the data-parallel learner: planning, packing and in-order launching.

A bucket is one flat tensor holding the gradients of several parameters, so a model is reduced
with a few large collectives instead of one per parameter. Buckets are planned in the order
gradients become ready during backward (reverse parameter order), and are launched strictly in
bucket-index order, so every rank issues the same collectives in the same order (Gloo and NCCL
both require that).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

BYTES_PER_MB = 2 ** 20
"""``bucket_size_mb`` counts MiB, as ``torch.nn.parallel.DistributedDataParallel``'s ``bucket_cap_mb`` does."""


FIRST_BUCKET_BYTES = 2 ** 20
"""The first gradient bucket's limit, 1 MiB: ``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES``, as DDP."""


def plan_gradient_buckets(ready_order: Sequence[torch.Tensor], bucket_bytes: float) -> list[list[int]]:
    """Buckets for gradients listed in the order backward produces them, with DDP's small first bucket.

    The first bucket is limited to ``min(bucket_bytes, FIRST_BUCKET_BYTES)``, the rest to
    ``bucket_bytes`` (see ``plan_buckets``). The last layers' gradients, ready first, then start
    their all-reduce while backward still computes the others, even when the whole model would
    fit into one ``bucket_bytes`` bucket (a small model would otherwise communicate nothing
    until backward ends). Raises ValueError when ``bucket_bytes`` is not positive.
    """
    return plan_buckets(ready_order, bucket_bytes, first_bucket_bytes=min(bucket_bytes, FIRST_BUCKET_BYTES))


def plan_buckets(tensors: Sequence[torch.Tensor], bucket_bytes: float,
                 first_bucket_bytes: float | None = None) -> list[list[int]]:
    """Groups ``tensors`` (by position) into buckets of at most ``bucket_bytes`` bytes each.

    Tensors keep their given order inside and across buckets; a bucket holds one dtype and one
    device (it becomes a single flat tensor). A bucket is closed when the next tensor of its kind
    would overflow it, so every bucket respects the limit except a single tensor larger than the
    limit, which gets a bucket of its own. Buckets are listed in the order they close, then the
    still-open ones in the order their kinds first appeared, so with one dtype the concatenated
    buckets are exactly the input order.

    Args:
        tensors: the tensors to group (e.g. parameters in reverse order).
        bucket_bytes: the size limit in bytes (> 0).
        first_bucket_bytes: the limit of the first bucket of each dtype and device instead
            (DDP's small first bucket); ``None``: ``bucket_bytes``.

    Returns:
        Lists of indices into ``tensors``; every index appears exactly once.

    Raises:
        ValueError: ``bucket_bytes`` is not positive.
    """
    if not bucket_bytes > 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes!r}")
    if first_bucket_bytes is not None and not first_bucket_bytes > 0:
        raise ValueError(f"first_bucket_bytes must be positive, got {first_bucket_bytes!r}")
    closed: list[list[int]] = []
    open_buckets: dict[tuple[torch.dtype, torch.device], tuple[list[int], list[int]]] = {}  # kind -> (indices, [bytes])
    kinds_closed: set[tuple[torch.dtype, torch.device]] = set()  # kinds past their first bucket
    for index, tensor in enumerate(tensors):
        kind = (tensor.dtype, tensor.device)
        size = tensor.numel() * tensor.element_size()
        if kind in open_buckets:
            indices, used = open_buckets[kind]
            limit = bucket_bytes if kind in kinds_closed or first_bucket_bytes is None else first_bucket_bytes
            if used[0] + size > limit:
                closed.append(indices)
                del open_buckets[kind]
                kinds_closed.add(kind)
        if kind not in open_buckets:
            open_buckets[kind] = ([], [0])
        indices, used = open_buckets[kind]
        indices.append(index)
        used[0] += size
    closed.extend(indices for indices, _ in open_buckets.values())
    return closed


def coalesced(tensors: Sequence[torch.Tensor], bucket_bytes: float, operation: Callable[[torch.Tensor], object]) -> None:
    """Applies an in-place collective to many tensors through a few flat buffers.

    ``operation(flat)`` is called once per bucket (see ``plan_buckets``), on a flat copy of the
    bucket's tensors, and the result is copied back. Used for broadcasting parameters and
    averaging buffers without one collective per tensor; every rank must pass tensors of the same
    shapes and dtypes in the same order. Runs under ``torch.no_grad`` (parameters are leaves).
    """
    with torch.no_grad():
        for indices in plan_buckets(tensors, bucket_bytes):
            members = [tensors[index] for index in indices]
            flat = torch.cat([member.reshape(-1) for member in members])
            operation(flat)
            for member, part in zip(members, flat.split([member.numel() for member in members])):
                member.copy_(part.view_as(member))


class GradientBucket:
    """One flat buffer for the gradients of some parameters, plus one "has a gradient" flag each.

    The buffer is ``[grad_0 | grad_1 | ... | flag_0 | flag_1 | ...]``: with an exact (float32)
    exchange the flags travel in the same all-reduce as the gradients, so after a SUM every rank
    knows whether ANY rank had a gradient for a parameter (flag > 0) and can leave ``.grad`` at
    None otherwise, as a single process would; a lossy exchange is given ``payload`` (the
    gradients alone) and the learner sums the flags separately.
    """

    def __init__(self, parameters: Sequence[torch.Tensor]):
        self.parameters = list(parameters)
        numels = [parameter.numel() for parameter in self.parameters]
        total = sum(numels)
        first = self.parameters[0]
        self.buffer = torch.empty(total + len(numels), dtype=first.dtype, device=first.device)
        self.gradients = [part.view(parameter.shape)
                          for part, parameter in zip(self.buffer[:total].split(numels), self.parameters)]
        self.flags = self.buffer[total:]
        self.payload = self.buffer[:total]  # the gradients alone, for exchanges that are not exact sums
        self.shapes = [parameter.shape for parameter in self.parameters]
        self.shapes_with_flags = [*self.shapes, torch.Size([len(numels)])]  # what ``buffer`` holds
        self.filled = [False] * len(self.parameters)  # state: which slots this minibatch's backward wrote
        self.missing = len(self.parameters)           # state: slots still to be written before launch
        self.handle = None                           # state: the in-flight all-reduce, if launched

    @property
    def num_bytes(self) -> int:
        """Bytes of gradient payload (without the flags)."""
        return sum(gradient.numel() for gradient in self.gradients) * self.buffer.element_size()

    def reset(self) -> None:
        """Forgets the previous minibatch (called before backward)."""
        self.filled = [False] * len(self.parameters)
        self.missing = len(self.parameters)
        self.handle = None

    def fill(self, slot: int, gradient: torch.Tensor, scale: float) -> None:
        """Writes ``gradient * scale`` into the slot of parameter ``slot``; raises on a second write."""
        if self.filled[slot]:
            raise RuntimeError(
                "a parameter received a second gradient in one minibatch; the data-parallel learner "
                "expects exactly one backward between begin_minibatch() and step() (run the backward passes of "
                "earlier micro-batches under learner.no_sync())"
            )
        if gradient.is_sparse:
            raise TypeError("sparse gradients are not supported by the data-parallel learner; "
                            "use dense embeddings (sparse=False)")
        torch.mul(gradient, scale, out=self.gradients[slot])
        self.flags[slot] = 1
        self.filled[slot] = True
        self.missing -= 1

    def fill_missing_with_zeros(self) -> None:
        """Zeros the slots no gradient arrived for (unused parameters, or a rank with 0 samples)."""
        for slot, filled in enumerate(self.filled):
            if not filled:
                self.gradients[slot].zero_()
                self.flags[slot] = 0
                self.filled[slot] = True
        self.missing = 0

    def assign_grads(self) -> None:
        """Points each ``.grad`` at its reduced gradient in the bucket; None where no rank had one.

        The grads are views of the bucket (no copy, as DDP's ``gradient_as_bucket_view``): they hold
        this minibatch's values until the next backward refills the bucket, which is after
        ``begin_minibatch`` has set every ``.grad`` back to None.
        """
        has_gradient = (self.flags > 0).tolist()
        for parameter, gradient, present in zip(self.parameters, self.gradients, has_gradient):
            parameter.grad = gradient if present else None
