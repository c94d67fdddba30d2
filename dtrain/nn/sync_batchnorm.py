"""BatchNorm whose batch statistics cover the whole global minibatch, reduced through a dtrain communicator.

The maths is ``torch.nn.SyncBatchNorm``'s (``torch/nn/modules/_functions.py``): the forward reduces
each channel's sample count, sum and sum of squares over the ranks; the backward reduces
``sum(dy)`` and ``sum(dy * xhat)``. Counts travel with the sums, so uneven shares (and a rank with
no samples) give exactly one process's statistics. Unlike torch's, it runs wherever the
communicator does (Gloo, MPI, NCCL, one process), on the CPU as on CUDA. See ``docs/batchnorm.md``.
"""
from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm


class BatchNormSync:
    """What every converted layer of one model shares: the communicator and, per minibatch, whether
    to reduce and this rank's gradient factor.

    ``active``: reduce over the ranks now (the session turns it off while a learner steps alone,
    e.g. before ``distributed_after``). ``gradient_factor``: by how much this rank's loss was scaled
    relative to the global mean loss (``global_samples * folded_scale / local_samples``; 1.0 when the
    data-parallel learner folds its weighting into the loss), so the backward sums are brought to one
    scale before they are added across ranks.
    """

    def __init__(self, comm) -> None:
        self.comm = comm
        self.active = comm.size > 1      # one process: nothing to reduce, no communicator traffic
        self.in_training = True          # reduce in training forwards (False: only while recomputing statistics)
        self.gradient_factor = 1.0
        self.collectives = 0             # statistics: collectives issued (tests check one process issues none)

    @property
    def reducing(self) -> bool:
        """Whether a training forward now reduces its statistics over the ranks."""
        return self.active and self.comm.size > 1

    def allreduce(self, values: torch.Tensor) -> torch.Tensor:
        """Sums ``values`` over the ranks on the communicator's device; returns them on ``values``' device."""
        self.collectives += 1
        reduced = self.comm.allreduce(values.to(self.comm.device), op="sum")
        return reduced.to(values.device)


class SyncBatchNorm(_BatchNorm):
    """A BatchNorm layer (any of 1d/2d/3d) whose training statistics are reduced over ``sync``'s ranks.

    Same parameters, buffers and ``state_dict`` keys as the ``nn.BatchNorm*d`` it replaces. In eval
    mode (or without running statistics in eval) it is a plain local ``batch_norm``: no traffic.
    Statistics are computed in float32 for float32 and narrower inputs (bf16 autocast included), in float64
    for float64 inputs.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = True,
                 track_running_stats: bool = True, sync: BatchNormSync | None = None, input_dims: int = 0,
                 device=None, dtype=None) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype)
        self.sync = sync
        self.input_dims = input_dims  # 2 or 3 (1d), 4 (2d), 5 (3d); 0: any of at least 2
        _keep_synchronized_forward_out_of_compiled_graphs()

    def _check_input_dim(self, input: torch.Tensor) -> None:  # noqa: A002 - torch's name
        allowed = {2: (2, 3), 3: (2, 3), 4: (4,), 5: (5,)}.get(self.input_dims)
        if (allowed and input.dim() not in allowed) or input.dim() < 2:
            raise ValueError(f"expected {' or '.join(f'{d}D' for d in allowed or (2,))} input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 - torch's name
        self._check_input_dim(input)
        if not (self.training and self.sync is not None and self.sync.reducing):
            return super().forward(input)  # eval, or one process: torch's own BatchNorm
        return _eager_synchronized_forward(self, input)


def _keep_synchronized_forward_out_of_compiled_graphs() -> None:
    """Collectives inside: compiled models break their graph at ``_synchronized_forward`` and run it
    eagerly. Wrapped when the first layer is built, not at import: ``torch.compiler.disable`` imports
    ``torch._dynamo``, about 1.5 s of every process's start-up."""
    global _eager_synchronized_forward
    if _eager_synchronized_forward is _synchronized_forward:
        _eager_synchronized_forward = torch.compiler.disable(_synchronized_forward)


def _synchronized_forward(layer: SyncBatchNorm, input: torch.Tensor) -> torch.Tensor:  # noqa: A002
    """Training forward with global statistics; updates the running statistics as one process would."""
    factor = 0.0 if layer.momentum is None else layer.momentum
    if layer.track_running_stats and layer.num_batches_tracked is not None:
        layer.num_batches_tracked.add_(1)
        factor = 1.0 / float(layer.num_batches_tracked) if layer.momentum is None else layer.momentum
    with torch.autocast(input.device.type, enabled=False):
        return _SyncBatchNormFunction.apply(input, layer.weight, layer.bias, layer.running_mean if
                                            layer.track_running_stats else None,
                                            layer.running_var if layer.track_running_stats else None,
                                            layer.eps, factor, layer.sync)


_eager_synchronized_forward = _synchronized_forward  # until a layer is built: see above


def _reduced_dims(input: torch.Tensor) -> list[int]:
    return [0, *range(2, input.dim())]


def _per_channel(values: torch.Tensor, input: torch.Tensor) -> torch.Tensor:
    """``[C]`` values shaped to broadcast against ``input`` ``[N, C, ...]``."""
    return values.reshape(1, -1, *([1] * (input.dim() - 2)))


class _SyncBatchNormFunction(torch.autograd.Function):
    """``torch.nn.modules._functions.SyncBatchNorm`` in torch ops, reducing through a ``BatchNormSync``."""

    @staticmethod
    def forward(ctx, input, weight, bias, running_mean, running_var, eps, factor, sync):  # noqa: A002
        compute = torch.promote_types(input.dtype, torch.float32)  # float32 at least; float64 kept
        x = input.to(compute)
        channels = x.shape[1]
        dims = _reduced_dims(x)
        # float64 sums: sum(x^2)/n - mean^2 keeps float32 accuracy for any realistic minibatch
        stats = torch.cat([x.sum(dims, dtype=torch.float64), x.double().square().sum(dims),
                           torch.tensor([x.numel() // max(channels, 1)], dtype=torch.float64, device=x.device)])
        stats = sync.allreduce(stats)
        count = float(stats[-1])
        if count <= 1:
            raise ValueError(f"Expected more than 1 value per channel when training over all ranks, got "
                             f"{int(count)} (input size {list(input.shape)} on this rank)")
        mean64 = stats[:channels] / count
        var64 = (stats[channels:2 * channels] / count - mean64.square()).clamp_min(0.0)  # biased, for normalising
        mean, var = mean64.to(compute), var64.to(compute)
        invstd = torch.rsqrt(var + eps)
        if running_mean is not None:
            with torch.no_grad():  # one process's update: unbiased variance over the global count
                running_mean.mul_(1 - factor).add_(mean.to(running_mean.dtype), alpha=factor)
                running_var.mul_(1 - factor).add_((var64 * count / (count - 1)).to(running_var.dtype), alpha=factor)
        xhat = (x - _per_channel(mean, x)) * _per_channel(invstd, x)
        output = xhat
        if weight is not None:
            output = output * _per_channel(weight.to(compute), x)
        if bias is not None:
            output = output + _per_channel(bias.to(compute), x)
        ctx.save_for_backward(xhat, weight, invstd)
        ctx.count = count
        ctx.sync = sync
        ctx.input_dtype = input.dtype
        return output.to(input.dtype)

    @staticmethod
    def backward(ctx, grad_output):
        xhat, weight, invstd = ctx.saved_tensors
        sync = ctx.sync
        dy = grad_output.to(xhat.dtype)
        dims = _reduced_dims(dy)
        sum_dy = dy.sum(dims)
        sum_dy_xhat = (dy * xhat).sum(dims)
        grad_input = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            # every rank's sums in the global-mean loss's scale, added, then back in this rank's scale
            factor = sync.gradient_factor
            local = torch.cat([sum_dy, sum_dy_xhat]).double()
            reduced = sync.allreduce(local / factor if factor != 1.0 else local) * (factor / ctx.count)
            mean_dy, mean_dy_xhat = reduced.to(dy.dtype).chunk(2)
            scale = invstd if weight is None else invstd * weight.to(dy.dtype)
            grad_input = _per_channel(scale, dy) * (dy - _per_channel(mean_dy, dy)
                                                   - xhat * _per_channel(mean_dy_xhat, dy))
            grad_input = grad_input.to(ctx.input_dtype)
        if weight is not None and ctx.needs_input_grad[1]:
            grad_weight = sum_dy_xhat.to(weight.dtype)  # local: the learner adds parameter gradients itself
        if ctx.needs_input_grad[2]:
            grad_bias = sum_dy.to(weight.dtype if weight is not None else dy.dtype)
        return grad_input, grad_weight, grad_bias, None, None, None, None, None


def batchnorm_layers(model: nn.Module) -> Iterator[_BatchNorm]:
    """Every BatchNorm layer of ``model`` (``nn.BatchNorm1d/2d/3d``, ``nn.SyncBatchNorm``, converted ones)."""
    return (module for module in model.modules() if isinstance(module, _BatchNorm))


_INPUT_DIMS = {nn.BatchNorm1d: 2, nn.BatchNorm2d: 4, nn.BatchNorm3d: 5}


def convert_sync_batchnorm(model: nn.Module, sync: BatchNormSync) -> nn.Module:
    """Replaces every ``nn.BatchNorm*d`` (and ``nn.SyncBatchNorm``) in ``model`` by a :class:`SyncBatchNorm`
    reducing through ``sync``; returns ``model`` (or the new layer, when ``model`` is itself one).

    The new layers take over the old ones' parameter and buffer tensors (the same objects, so an
    optimizer built on the model keeps working) and their train/eval mode. Lazy BatchNorm layers
    must be materialised first (one forward).

    Raises:
        ValueError: a lazy BatchNorm layer that has not been materialised yet.
    """
    if isinstance(model, _BatchNorm) and not isinstance(model, SyncBatchNorm):
        if isinstance(model.weight, nn.parameter.UninitializedParameter) or \
                isinstance(model.running_mean, nn.parameter.UninitializedBuffer):
            raise ValueError(f"sync_batchnorm: {type(model).__name__} is lazy and has not seen an input yet; run one "
                             f"forward before converting it")
        dims = next((dims for kind, dims in _INPUT_DIMS.items() if isinstance(model, kind)), 0)
        converted = SyncBatchNorm.__new__(SyncBatchNorm)
        nn.Module.__init__(converted)
        for name in ("num_features", "eps", "momentum", "affine", "track_running_stats"):
            setattr(converted, name, getattr(model, name))
        # the very same tensors: optimizer state, hooks and the state_dict keys carry over
        converted._parameters = model._parameters
        converted._buffers = model._buffers
        converted._non_persistent_buffers_set = model._non_persistent_buffers_set
        converted.training = model.training
        converted.sync = sync
        converted.input_dims = 3 if dims == 2 else dims  # BatchNorm1d takes [N, C] or [N, C, L]
        return converted
    for name, child in model.named_children():
        new = convert_sync_batchnorm(child, sync)
        if new is not child:
            setattr(model, name, new)
    return model


__all__ = ["BatchNormSync", "SyncBatchNorm", "batchnorm_layers", "convert_sync_batchnorm"]
