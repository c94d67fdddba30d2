"""An exponential moving average of the model's weights (``session.ema_decay``), kept beside the live model.

Built on ``torch.optim.swa_utils.AveragedModel`` with ``get_ema_multi_avg_fn(decay)``:
``ema <- decay * ema + (1 - decay) * weights`` after each update, starting from the weights after the first
update (``AveragedModel`` copies them then): the initial weights get no weight in the average.
Buffers (BatchNorm's running statistics) are *copied* from the live model, not averaged: they are
already a moving average of batch statistics, and averaging integer counters is not defined; so the
averaged weights are evaluated with the live model's statistics (an approximation, as torch's
default; ``torch.optim.swa_utils.update_bn`` recomputes them with a pass over the data).

When it is updated: at every step where the learner's ranks meet (``Learner.is_sync_point``), from
the model after that step, and once more after the run's last synchronisation. Data-parallel
learners meet every minibatch and hold one model, so the average is updated after every optimizer
step and is the same on every rank. Block learners (block momentum, DiLoCo) hold one model only at
block ends: the average is updated there, from the synchronized model, with ``decay ** k`` for the
block's ``k`` optimizer steps, so ``decay`` counts optimizer steps under every learner (about
``1 / (1 - decay)`` of them) and the average stays the same on every rank. Counted per block, the
G2P recipe's 0.999 under DiLoCo (500 steps a block) kept 92% of the first block's model to the end.
"""
from __future__ import annotations

import contextlib
import math
import numbers
from collections.abc import Iterator
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


#: the key of the steps not yet taken in, beside ``AveragedModel``'s own in a checkpoint's ``weight_ema``
STEPS_KEY = "steps_since_update"
#: the key of the optimizer steps taken in so far (absent from checkpoints written before it was kept)
TAKEN_KEY = "steps_taken"
#: ``AveragedModel``'s key of how many times the average took in the weights (the parameters are ``module.<name>``)
UPDATES_KEY = "n_averaged"


class AverageClock:
    """When a weight average takes in the weights and how far it has come (the counters a checkpoint keeps): shared
    by the whole model's average (:class:`WeightEMA`) and a sharded model's (``sharded_weight_ema``)."""

    def __init__(self, decay: float) -> None:
        self.decay = check_ema_decay("ema_decay", decay)
        self.steps_since_update = 0  # state: optimizer steps not yet taken in (a block learner between syncs)
        self.steps_taken = 0  # state: optimizer steps taken in, the first update's included

    @property
    def horizon(self) -> float:
        """The optimizer steps the average spans, ``1 / (1 - decay)``: after that many steps the weights of
        its first update keep ``decay ** horizon``, about e^-1 (37%), of it."""
        return 1.0 / (1.0 - self.decay)

    def too_few_steps(self) -> str | None:
        """Why the average is not yet worth evaluating, or ``None``: below :attr:`horizon` optimizer steps it is
        mostly the weights of its first update (those after the first step), not an average of training."""
        if self.steps_taken >= self.horizon:
            return None
        first = self.decay ** max(self.steps_taken - 1, 0)
        return (f"the weight EMA has taken in {self.steps_taken:,} optimizer steps, fewer than its horizon of "
                f"{self.horizon:,.0f} (1 / (1 - session.ema_decay={self.decay:g})): about {100 * first:.0f}% of it is "
                f"still the weights after the first step")

    def after_step(self, model: torch.nn.Module, ranks_hold_one_model: bool) -> None:
        """Counts the optimizer step just made; takes in ``model`` if the ranks hold one model now."""
        self.steps_since_update += 1
        if ranks_hold_one_model:
            self.update(model)

    def after_last_sync(self, model: torch.nn.Module) -> None:
        """Takes in the steps since the last update (a block learner's last, partial block), if any."""
        if self.steps_since_update:
            self.update(model)

    @torch.no_grad()
    def update(self, model: torch.nn.Module) -> None:
        """Takes in ``model``'s current weights (and copies its buffers), as ``decay ** k`` for the ``k`` steps
        counted since the last update (at least one)."""
        steps = max(self.steps_since_update, 1)
        self._take_in(model, self.decay ** steps)
        self.steps_taken += steps
        self.steps_since_update = 0

    def _take_in(self, model: torch.nn.Module, decay: float) -> None:
        """``average <- decay * average + (1 - decay) * weights`` (a copy at the first update), buffers copied."""
        raise NotImplementedError

    def _counters(self) -> dict[str, torch.Tensor]:
        return {STEPS_KEY: torch.tensor(self.steps_since_update), TAKEN_KEY: torch.tensor(self.steps_taken)}

    def _load_counters(self, state: dict[str, Any]) -> dict[str, Any]:
        """Restores the counters from ``state`` (a checkpoint's entry); returns the rest of it."""
        state = dict(state)
        steps = state.pop(STEPS_KEY, None)  # absent from checkpoints written before it was kept: none pending
        taken = state.pop(TAKEN_KEY, None)
        self.steps_since_update = int(steps) if steps is not None else 0
        # written before it was kept: the updates (AveragedModel's n_averaged), one step each
        self.steps_taken = int(taken) if taken is not None else int(state.get(UPDATES_KEY, 0))
        return state

    def describe(self) -> str:
        return (f"weight EMA, decay {self.decay:g} per optimizer step (about {1 / (1 - self.decay):,.0f} steps), "
                f"updated where the ranks hold one model (a block learner's block end: decay^k for its k steps); "
                f"tested beside the model once it has taken in that many, saved as model_ema.safetensors")


class WeightEMA(AverageClock):
    """The averaged copy of ``model`` (``.module``) and when to update it; ``state_dict`` goes in checkpoints."""

    #: whether the average is kept in shards (``sharded_weight_ema.ShardedWeightEMA``): not this one
    sharded = False

    def __init__(self, model: torch.nn.Module, decay: float) -> None:
        super().__init__(decay)
        self._per_step = get_ema_multi_avg_fn(self.decay)  # every update under data-parallel learners
        self.averaged = AveragedModel(model, multi_avg_fn=self._per_step, use_buffers=False)

    @property
    def module(self) -> torch.nn.Module:
        """The averaged model, to evaluate or export."""
        return self.averaged.module

    @contextlib.contextmanager
    def evaluated(self, model: torch.nn.Module) -> Iterator[torch.nn.Module]:
        """The model holding the average's weights, to evaluate or export: here the averaged copy itself."""
        yield self.averaged.module

    @property
    def updates(self) -> int:
        """How many times the average took in the weights."""
        return int(self.averaged.n_averaged)

    def to(self, device: torch.device) -> "WeightEMA":
        self.averaged.to(device)
        return self

    def _take_in(self, model: torch.nn.Module, decay: float) -> None:
        self.averaged.multi_avg_fn = self._per_step if decay == self.decay else get_ema_multi_avg_fn(decay)
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
        """``AveragedModel``'s state, plus the steps not yet taken in and those taken in."""
        return {**self.averaged.state_dict(), **self._counters()}

    def tensors_to_read(self, saved: dict[str, Any]) -> dict[str, torch.Tensor]:
        """The tensors a sharded checkpoint holds of this average (those ``saved`` has as ``meta`` placeholders),
        keyed as saved: the average's own, which ``torch.distributed.checkpoint`` fills in place, whole."""
        own = self.averaged.state_dict()
        return {key: own[key] for key, value in saved.items()
                if isinstance(value, torch.Tensor) and value.is_meta and key in own}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.averaged.load_state_dict(self._load_counters(state))
