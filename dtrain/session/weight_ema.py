"""An exponential moving average of the model's weights (``session.ema_decay``), kept beside the live model.

Built on ``torch.optim.swa_utils.AveragedModel`` with ``get_ema_multi_avg_fn(decay)``:
``ema <- decay * ema + (1 - decay) * weights`` after each update, starting from the weights themselves.
Buffers (BatchNorm's running statistics) are *copied* from the live model, not averaged: they are
already a moving average of batch statistics, and averaging integer counters is not defined; so the
averaged weights are evaluated with the live model's statistics (an approximation, as torch's
default; ``torch.optim.swa_utils.update_bn`` recomputes them with a pass over the data).

When it is updated: at every step where the learner's ranks meet (``Learner.is_sync_point``), from
the model after that step. Data-parallel learners meet every minibatch and hold one model, so the
average is updated after every optimizer step and is the same on every rank. Block learners (block
momentum, DiLoCo) hold one model only at block ends: the average is updated there, from the
synchronized model, once per block (so ``decay`` counts blocks), and stays the same on every rank.
"""
from __future__ import annotations

import math
import numbers
from typing import Any

import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn


def check_ema_decay(name: str, value: Any) -> float | None:
    """``null`` (off) or a number strictly between 0 and 1; raises ValueError naming ``name`` otherwise."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) \
            or not 0.0 < value < 1.0:
        raise ValueError(f"{name}={value!r}: expected a number in (0, 1), e.g. 0.999, or null (no weight average)")
    return float(value)


class WeightEMA:
    """The averaged copy of ``model`` (``.module``) and when to update it; ``state_dict`` goes in checkpoints."""

    def __init__(self, model: torch.nn.Module, decay: float) -> None:
        self.decay = check_ema_decay("ema_decay", decay)
        self.averaged = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(self.decay), use_buffers=False)

    @property
    def module(self) -> torch.nn.Module:
        """The averaged model, to evaluate or export."""
        return self.averaged.module

    @property
    def updates(self) -> int:
        """How many times the average took in the weights."""
        return int(self.averaged.n_averaged)

    def to(self, device: torch.device) -> "WeightEMA":
        self.averaged.to(device)
        return self

    @torch.no_grad()
    def update(self, model: torch.nn.Module) -> None:
        """Takes in ``model``'s current weights (and copies its buffers)."""
        self.averaged.update_parameters(model)

    @torch.no_grad()
    def take_rank0s(self, comm) -> None:
        """Every rank's average becomes rank 0's (a collective; nothing to do in one process).

        The rule above keeps the ranks' averages equal; a block learner's warm start with per-rank noise
        (dropout) is the exception, so the session calls this before the average is evaluated."""
        if comm.size == 1:
            return
        for tensor in self.averaged.state_dict().values():
            if tensor.device != comm.device:
                tensor.copy_(comm.broadcast(tensor.to(comm.device), root=0))
            else:
                comm.broadcast(tensor, root=0)

    def state_dict(self) -> dict[str, Any]:
        return self.averaged.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.averaged.load_state_dict(state)

    def describe(self) -> str:
        return (f"weight EMA, decay {self.decay:g} (about {1 / (1 - self.decay):,.0f} updates), updated after every "
                f"step where the ranks hold one model; evaluated beside the model, saved as model_ema.safetensors")
