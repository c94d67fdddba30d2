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


def plan_gradient_buckets(ready_order: Sequence[torch.Tensor], bucket_bytes: float,
                          in_place_bytes: float | None = None) -> list[list[int]]:
    """Buckets for gradients listed in the order backward produces them, with DDP's small first bucket.

    The first bucket is limited to ``min(bucket_bytes, FIRST_BUCKET_BYTES)``, the rest to
    ``bucket_bytes`` (see ``plan_buckets``). The last layers' gradients, ready first, then start
    their all-reduce while backward still computes the others, even when the whole model would
    fit into one ``bucket_bytes`` bucket (a small model would otherwise communicate nothing
    until backward ends).

    With ``in_place_bytes``, every tensor of at least that many bytes gets a bucket of its own
    (reduced in place, :class:`InPlaceBucket`), the tensors between two of them are packed as
    above, and the last bucket is always a packed one, which carries the "has a gradient" flags
    of the in-place buckets: when the plan would end with an in-place bucket, the last packed
    bucket moves to the end (it only waits for the rest of backward), or an empty one is added
    when there is none. Raises ValueError when ``bucket_bytes`` is not positive.
    """
    first_bucket_bytes = min(bucket_bytes, FIRST_BUCKET_BYTES)
    if in_place_bytes is None:
        return plan_buckets(ready_order, bucket_bytes, first_bucket_bytes=first_bucket_bytes)
    buckets: list[list[int]] = []
    run: list[int] = []  # indices of the packed tensors since the last in-place one

    def pack_run() -> None:
        first = first_bucket_bytes if not buckets else None
        buckets.extend([run[position] for position in indices]
                       for indices in plan_buckets([ready_order[index] for index in run], bucket_bytes, first))
        run.clear()

    for index, tensor in enumerate(ready_order):
        if _num_bytes(tensor) >= in_place_bytes:
            pack_run()
            buckets.append([index])
        else:
            run.append(index)
    pack_run()
    packed = [position for position, indices in enumerate(buckets) if not is_in_place(ready_order, indices, in_place_bytes)]
    if len(packed) < len(buckets):  # some in-place bucket: a packed one must come last
        if not packed:
            buckets.append([])
        elif packed[-1] != len(buckets) - 1:
            buckets.append(buckets.pop(packed[-1]))
    return buckets


def is_in_place(ready_order: Sequence[torch.Tensor], indices: Sequence[int], in_place_bytes: float | None) -> bool:
    """Whether ``plan_gradient_buckets(ready_order, ..., in_place_bytes)`` made ``indices`` an in-place bucket."""
    return in_place_bytes is not None and len(indices) == 1 and _num_bytes(ready_order[indices[0]]) >= in_place_bytes


def _num_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


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
        size = _num_bytes(tensor)
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


class _Slots:
    """What every bucket tracks per minibatch: which parameters' gradients arrived, how many are
    still missing before it can be launched, and its in-flight exchange."""

    def __init__(self, parameters: Sequence[torch.Tensor]):
        self.parameters = list(parameters)
        self.reset()

    def reset(self) -> None:
        """Forgets the previous minibatch (called before backward)."""
        self.filled = [False] * len(self.parameters)  # state: which slots this minibatch's backward wrote
        self.missing = len(self.parameters)           # state: slots still to be written before launch
        self.handle = None                           # state: the in-flight exchange, if launched

    def _claim(self, slot: int, gradient: torch.Tensor) -> None:
        """Marks ``slot`` written; raises on a second gradient in one minibatch or a sparse one."""
        if self.filled[slot]:
            raise RuntimeError(
                "a parameter received a second gradient in one minibatch; the data-parallel learner "
                "expects exactly one backward between begin_minibatch() and step() (run the backward passes of "
                "earlier micro-batches under learner.no_sync())"
            )
        if gradient.is_sparse:
            raise TypeError("sparse gradients are not supported by the data-parallel learner; "
                            "use dense embeddings (sparse=False)")
        self.filled[slot] = True
        self.missing -= 1


class GradientBucket(_Slots):
    """One flat buffer for the gradients of some parameters, plus one "has a gradient" flag each.

    The buffer is ``[grad_0 | grad_1 | ... | flag_0 | flag_1 | ... | carried flags]``: with an
    exact (float32) exchange the flags travel in the same all-reduce as the gradients, so after a
    SUM every rank knows whether ANY rank had a gradient for a parameter (flag > 0) and can leave
    ``.grad`` at None otherwise, as a single process would; a lossy exchange is given ``payload``
    (the gradients alone) and the learner sums the flags separately. The last bucket also carries
    the flags of the in-place buckets (``carried_flags``, one each); it may hold no parameters.
    """

    def __init__(self, parameters: Sequence[torch.Tensor], carried_flags: int = 0,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        super().__init__(parameters)
        numels = [parameter.numel() for parameter in self.parameters]
        total = sum(numels)
        if self.parameters:
            dtype, device = self.parameters[0].dtype, self.parameters[0].device
        self.buffer = torch.empty(total + len(numels) + carried_flags, dtype=dtype, device=device)
        self.gradients = [part.view(parameter.shape)
                          for part, parameter in zip(self.buffer[:total].split(numels), self.parameters)]
        self.flags = self.buffer[total:total + len(numels)]
        self.carried_flags = self.buffer[total + len(numels):]
        self.payload = self.buffer[:total]  # the gradients alone, for exchanges that are not exact sums
        self.shapes = [parameter.shape for parameter in self.parameters]
        self.shapes_with_flags = [*self.shapes, torch.Size([len(numels) + carried_flags])]  # what ``buffer`` holds

    @property
    def num_bytes(self) -> int:
        """Bytes of gradient payload (without the flags)."""
        return sum(gradient.numel() for gradient in self.gradients) * self.buffer.element_size()

    def fill(self, slot: int, gradient: torch.Tensor, scale: float) -> None:
        """Writes ``gradient * scale`` into the slot of parameter ``slot``; raises on a second write."""
        self._claim(slot, gradient)
        if scale == 1.0:
            self.gradients[slot].copy_(gradient)
        else:
            torch.mul(gradient, scale, out=self.gradients[slot])
        self.flags[slot] = 1

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


class InPlaceBucket(_Slots):
    """A bucket of one large parameter whose ``.grad`` is exchanged in place: no copy in, none out.

    Its "has a gradient" flag is a slot of the last (packed) bucket, ``flag``, written when the
    gradient arrives (or is found missing) and summed with that bucket, which is launched after
    this one. A rank without a gradient for the parameter contributes zeros.
    """

    def __init__(self, parameter: torch.Tensor, flag: torch.Tensor):
        super().__init__([parameter])
        self.shapes = [parameter.shape]
        self.shapes_with_flags = self.shapes
        self.flag = flag

    @property
    def num_bytes(self) -> int:
        """Bytes of gradient payload."""
        return _num_bytes(self.parameters[0])

    @property
    def buffer(self) -> torch.Tensor:
        """The gradient, flat: what the exchange reduces in place."""
        return self.gradient.view(-1)

    payload = buffer

    def reset(self) -> None:
        """Forgets the previous minibatch, its gradient included."""
        super().reset()
        self.gradient: torch.Tensor | None = None  # state: this minibatch's gradient (the parameter's .grad)

    def fill(self, slot: int, gradient: torch.Tensor, scale: float) -> None:
        """Takes the parameter's ``.grad`` itself (made contiguous if it is not), scaled in place."""
        self._claim(slot, gradient)
        parameter = self.parameters[0]
        if not gradient.is_contiguous():
            gradient = gradient.contiguous()
            parameter.grad = gradient
        if scale != 1.0:
            gradient.mul_(scale)
        self.gradient = gradient
        self.flag.fill_(1)

    def fill_missing_with_zeros(self) -> None:
        """Zeros for a parameter no gradient arrived for on this rank."""
        if not self.filled[0]:
            self.gradient = torch.zeros_like(self.parameters[0], memory_format=torch.contiguous_format)
            self.flag.fill_(0)
            self.filled[0] = True
        self.missing = 0

    def assign_grads(self) -> None:
        """Sets ``.grad`` to the reduced gradient, or None where no rank had one (after the last bucket's sum)."""
        self.parameters[0].grad = self.gradient if float(self.flag) > 0 else None
