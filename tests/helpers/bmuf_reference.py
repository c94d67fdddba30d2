"""CNTK's block momentum update (``docs/semantics.md#block-momentum``) written out per parameter, in one process.

The independent reference both the unit tests and the mpiexec worker compare the learner with:
``len(models)`` simulated workers, each with its own model copy and optimizer, reading their
share of every global minibatch. ``train_learner_shares`` feeds the real learner the same
timeline, one rank's share at a time, the way the training session does.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from dtrain.data.partition import partition_slice


def flat(parameters) -> torch.Tensor:
    """A detached copy of ``parameters`` laid end to end, for comparing whole models."""
    return torch.cat([p.detach().reshape(-1) for p in parameters]).clone()


def simulate_bmuf(models: Sequence[torch.nn.Module], optimizers: Sequence[torch.optim.Optimizer],
                  local_loss: Callable[[torch.nn.Module, int, int], torch.Tensor], global_sizes: Sequence[int],
                  block_size: int, block_momentum_as_time_constant=None, use_nesterov_momentum=True,
                  reset_sgd_momentum_after_aggregation=True, block_learning_rate=1.0,
                  distributed_after=0, local_learning_rate="full") -> tuple[list[torch.Tensor], torch.Tensor]:
    """Direct BMUF: returns (the common model's flat parameters after each sync, final flat parameters).

    ``local_loss(model, start, stop)`` is the mean loss over timeline positions ``[start, stop)``. A
    local step's learning rate is the optimizer's (``local_learning_rate="full"``) or that times the
    worker's share of the global minibatch (``"share"``, CNTK's per-sample rate on its local samples).
    """
    size = len(models)
    if block_momentum_as_time_constant is not None:
        time_constant = block_momentum_as_time_constant
    else:
        time_constant = 0.0 if size == 1 else -block_size / math.log(1 - 1 / size)
    sync_period = block_size // size
    prev = [p.detach().clone() for p in models[0].parameters()]
    smoothed = [torch.zeros_like(p) for p in prev]
    local_counts = [0] * size
    samples_seen, position, snapshots = 0, 0, []

    def sync(partial: bool = False) -> None:
        mean_local = sum(local_counts) / size
        momentum = 0.0 if time_constant == 0 else math.exp(-mean_local / (time_constant / size))
        parameters = [list(model.parameters()) for model in models]
        with torch.no_grad():
            for j in range(len(prev)):
                total_delta = sum(prev[j] - parameters[k][j] for k in range(size))  # SUM, not mean
                if partial:  # the last block ended early: the workers' mean, the filter's state kept
                    new = prev[j] - total_delta / size
                else:
                    smoothed[j] = momentum * smoothed[j] + (1 - momentum) * block_learning_rate * total_delta
                    new = prev[j] - smoothed[j]
                    if use_nesterov_momentum:
                        new = new - momentum * smoothed[j]
                prev[j] = new
                for k in range(size):
                    parameters[k][j].copy_(new)
        if reset_sgd_momentum_after_aggregation:
            for optimizer in optimizers:
                for state in optimizer.state.values():
                    if state.get("momentum_buffer") is not None:
                        state["momentum_buffer"].zero_()
        local_counts[:] = [0] * size
        snapshots.append(flat(prev))

    for global_size in global_sizes:
        warm = samples_seen < distributed_after  # every worker reads the whole minibatch
        for k, (model, optimizer) in enumerate(zip(models, optimizers)):
            start = position if warm else position + k * global_size // size
            stop = position + global_size if warm else position + (k + 1) * global_size // size
            optimizer.zero_grad()
            if stop > start:
                local_loss(model, start, stop).backward()
                share = (stop - start) / global_size if local_learning_rate == "share" else 1.0
                configured = [group["lr"] for group in optimizer.param_groups]
                for group in optimizer.param_groups:
                    group["lr"] *= share
                optimizer.step()
                for group, lr in zip(optimizer.param_groups, configured):
                    group["lr"] = lr
            if not warm:
                local_counts[k] += stop - start
        position += global_size
        samples_seen += global_size
        if warm and samples_seen >= distributed_after:  # rank 0's model is broadcast at the switch
            with torch.no_grad():
                for model in models[1:]:
                    for mine, root in zip(model.parameters(), models[0].parameters()):
                        mine.copy_(root)
            prev = [p.detach().clone() for p in models[0].parameters()]
        elif not warm and max(local_counts) >= sync_period:  # the first worker to reach it decides
            sync()
    if sum(local_counts) > 0:
        sync(partial=True)
    return snapshots, flat(models[0].parameters())


def train_learner_shares(learner, model: torch.nn.Module,
                         local_loss: Callable[[torch.nn.Module, int, int], torch.Tensor],
                         global_sizes: Sequence[int], on_sync: Callable[[], None] | None = None,
                         position: int = 0) -> int:
    """Steps ``learner`` through ``global_sizes`` on this rank's share of each global minibatch,
    starting at timeline ``position``; returns the position after the last one.

    Calls ``on_sync()`` (when given) after every step that made a block sync; the final
    ``synchronize()`` is left to the caller.
    """
    for global_size in global_sizes:
        start, stop = partition_slice(position, global_size, *learner.data_partition())
        position += global_size
        learner.begin_minibatch(stop - start, global_size)
        if stop > start:
            local_loss(model, start, stop).backward()
        syncs = learner.syncs
        learner.step()
        if learner.syncs != syncs and on_sync is not None:
            on_sync()
    return position
