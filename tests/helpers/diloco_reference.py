"""DiLoCo's outer step written out with torch's own SGD, in one process: the independent reference
the unit tests and the mpiexec worker compare ``DiLoCoLearner`` with.

``len(models)`` simulated workers, each with its own model copy and inner optimizer, read their
share of every global minibatch (the session's partitioning); at a sync ``torch.optim.SGD(lr,
momentum, nesterov)`` steps the global model ``W_prev`` with ``p.grad = W_prev - mean_i W_i``,
parameter by parameter (DiLoCo, arXiv 2311.08105, Algorithm 1), and every worker continues from it.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from dtrain.data.partition import partition_slice


def flat(parameters) -> torch.Tensor:
    """A detached copy of ``parameters`` laid end to end."""
    return torch.cat([p.detach().reshape(-1) for p in parameters]).clone()


def simulate_diloco(models: Sequence[torch.nn.Module], inner: Sequence[torch.optim.Optimizer],
                    local_loss: Callable[[torch.nn.Module, int, int], torch.Tensor], global_sizes: Sequence[int],
                    block_size: int, outer_learning_rate: float = 0.7, outer_momentum: float = 0.9,
                    outer_nesterov: bool = True, distributed_after: int = 0) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Returns (the global model's flat parameters after each outer step, final flat parameters)."""
    size = len(models)
    prev = [p.detach().clone() for p in models[0].parameters()]
    outer = torch.optim.SGD(prev, lr=outer_learning_rate, momentum=outer_momentum, nesterov=outer_nesterov)
    period = block_size // size
    largest_share, position, seen, snapshots = 0, 0, 0, []

    def outer_step(partial: bool = False) -> None:
        with torch.no_grad():
            for j, p in enumerate(prev):
                mean_model = sum(list(model.parameters())[j] for model in models) / size
                if partial:  # the last block ended early: the workers' mean, no outer step
                    p.copy_(mean_model)
                else:
                    p.grad = p - mean_model  # DiLoCo's outer gradient
        if not partial:
            outer.step()
        with torch.no_grad():
            for model in models:  # every worker continues from the new global model
                for mine, new in zip(model.parameters(), prev):
                    mine.copy_(new)
        snapshots.append(flat(prev))

    for global_size in global_sizes:
        warm = seen < distributed_after  # every worker reads the whole minibatch
        for k, (model, optimizer) in enumerate(zip(models, inner)):
            start, stop = partition_slice(position, global_size, 1, 0) if warm else \
                partition_slice(position, global_size, size, k)
            optimizer.zero_grad()
            if stop > start:
                local_loss(model, start, stop).backward()
                optimizer.step()
        position += global_size
        seen += global_size
        if warm:
            if seen >= distributed_after:  # rank 0's model is broadcast and becomes W_prev
                with torch.no_grad():
                    for model in models[1:]:
                        for mine, root in zip(model.parameters(), models[0].parameters()):
                            mine.copy_(root)
                    for p, root in zip(prev, models[0].parameters()):
                        p.copy_(root)
            continue
        largest_share += -(-global_size // size)  # the most-loaded worker's count decides (as BMUF)
        if largest_share >= period:
            outer_step()
            largest_share = 0
    if largest_share:
        outer_step(partial=True)
    return snapshots, flat(models[0].parameters())
