"""BatchNorm statistics recomputed at the end of training (Akiba et al. 2017, "Batch normalization
without moving averages"): each layer's mean and variance measured exactly over a number of training
samples with the final weights, instead of the running averages of moving weights.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from dtrain.nn.sync_batchnorm import BatchNormSync, batchnorm_layers
from dtrain.session.binding import StreamBinding
from dtrain.session.precision import autocast


def recompute_batchnorm_statistics(model: torch.nn.Module, source, minibatch_size: int, num_samples: int,
                                   sync: BatchNormSync, device: torch.device, binding: StreamBinding | None = None,
                                   precision: str = "32", forward: Callable | None = None) -> int:
    """Replaces every BatchNorm layer's running mean and variance by the exact mean and unbiased variance
    of its inputs over the next ``num_samples`` global samples of ``source``; returns the samples used.

    The samples are read in global minibatches of ``minibatch_size`` split over the ranks as training
    splits them, with no gradient; BatchNorm layers normalise with the global minibatch's statistics
    (reduced through ``sync``, so the inputs of deeper layers, and the result, do not depend on the world
    size) while the rest of the model is in eval mode (no dropout). Every layer's sums are all-reduced once
    at the end. The source's position, the random state and the model's modes are put back, so a resumed
    run reads what it would have read. ``num_batches_tracked`` becomes the number of minibatches read.
    ``forward(model, minibatch)`` runs the model (default: ``binding.forward``; an objective's run: the objective).
    """
    binding = binding if binding is not None else StreamBinding()
    comm = sync.comm
    layers = [layer for layer in batchnorm_layers(model) if layer.track_running_stats]
    sums = [torch.zeros(2 * layer.num_features + 1, dtype=torch.float64, device=device) for layer in layers]

    def accumulate(index: int):
        def hook(_layer, inputs):
            x = inputs[0].detach().float()
            dims = [0, *range(2, x.dim())]
            channels = x.shape[1]
            sums[index][:channels] += x.sum(dims, dtype=torch.float64)
            sums[index][channels:2 * channels] += x.double().square().sum(dims)
            sums[index][-1] += x.numel() // max(channels, 1)
        return hook

    hooks = [layer.register_forward_pre_hook(accumulate(index)) for index, layer in enumerate(layers)]
    position = source.get_checkpoint_state()
    modes = {module: module.training for module in model.modules()}
    was_active = sync.active
    read = minibatches = 0
    try:
        model.eval()
        for layer in layers:
            layer.train()
        sync.active = True
        with torch.no_grad(), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            while read < num_samples:
                batch = source.next_minibatch(min(minibatch_size, num_samples - read), comm.size, comm.rank)
                if batch is None:
                    break
                read += batch.global_num_samples
                minibatches += 1
                with autocast(precision, device):
                    # a rank without samples forwards an empty share: the others' reductions wait for it
                    (forward or binding.forward)(model, batch.to(device))
    finally:
        for hook in hooks:
            hook.remove()
        sync.active = was_active
        for module, training in modes.items():
            module.train(training)
        source.restore_from_checkpoint(position)
    if layers:
        totals = sync.allreduce(torch.cat(sums)).split([2 * layer.num_features + 1 for layer in layers])
        for layer, total in zip(layers, totals):
            count = float(total[-1])
            if count < 2:
                raise ValueError(f"batchnorm_statistics=recomputed: {count:.0f} values per channel reached a "
                                 f"{type(layer).__name__} layer; raise batchnorm_recompute_samples")
            mean = total[:layer.num_features] / count
            variance = (total[layer.num_features:2 * layer.num_features] / count - mean.square()).clamp_min(0.0)
            with torch.no_grad():
                layer.running_mean.copy_(mean)
                layer.running_var.copy_(variance * count / (count - 1))
                if layer.num_batches_tracked is not None:
                    layer.num_batches_tracked.fill_(minibatches)
    return read


__all__ = ["recompute_batchnorm_statistics"]
