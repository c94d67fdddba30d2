"""Outer optimizers: the torch optimizers a block learner steps the model of the last sync with.

A :class:`~dtrain.learners.block.BlockLearner` keeps ``W_prev``, the model of the last sync, as one flat
tensor, and at every sync hands an outer optimizer the workers' model change as its gradient, ``g = (1/N)
sum_i (W_prev - W_i)`` (DiLoCo's outer gradient), then calls its ``step()``. Any ``torch.optim.Optimizer``
serves (torch's SGD with Nesterov momentum is DiLoCo's; Adam if a user wants it), and its state is
checkpointed, resumed and moved to the model's device by the learner, like the inner optimizer's.

What an outer optimizer may declare, beyond torch's interface
(``docs/writing-a-learner.md#outer-optimizers-a-new-block-learner-in-a-config-line``):

* ``sums_deltas = True``: its gradient is the sum ``D = sum_i (W_prev - W_i)``, not the mean (CNTK's
  block momentum filters the sum);
* param-group keys named in :data:`SYNC_FACTS` (``workers``, ``samples_in_block``): the learner sets them
  before each step, so a filter that depends on the block's length (BMUF's ``exp(-n / (TC / N))``) reads them;
* ``gives_back_model(gradient)``: True when this step would give back the workers' own model (then the
  learner skips it, sparing its rounding; the method may record state as the step would).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from omegaconf import DictConfig, ListConfig, OmegaConf

from dtrain.schedules import momentum_from_time_constant

#: the param-group keys a block learner sets before each outer step, when the outer optimizer has them
SYNC_FACTS = ("workers", "samples_in_block")

#: Optimizer state entries holding a first moment: the momentum buffers of torch's optimizers (SGD/RMSprop
#: ``momentum_buffer``; Adam, AdamW, NAdam, RAdam, Adamax ``exp_avg``) and of :class:`BlockMomentumFilter`. The
#: block learners' momentum reset zeroes the inner optimizer's, their momentum correction scales the outer
#: optimizer's, and a checkpoint written before outer optimizers restores its one outer tensor into them. Second
#: moments (``exp_avg_sq``, ``square_avg``, ...) and step counts are left alone: they scale the steps, and zeroing
#: them while bias correction is already ~1 would make the next steps several times larger than the lr asks for.
FIRST_MOMENT_KEYS = ("momentum_buffer", "exp_avg")

OuterOptimizerFactory = Callable[[list[torch.Tensor]], torch.optim.Optimizer]


class BlockMomentumFilter(torch.optim.Optimizer):
    """CNTK's block momentum (BMUF) as an outer optimizer over the summed model change ``D``.

    With ``n = samples_in_block / workers`` (the workers' mean samples since the last sync) and ``bm =
    exp(-n / (time_constant / workers))``: ``sg <- bm sg + (1 - bm) lr D``; ``W = W_prev - sg``, and with
    Nesterov ``W <- W - bm sg`` (``docs/semantics.md#block-momentum``). ``sg`` starts at 0 and is the state's
    ``momentum_buffer``. ``lr`` is CNTK's ``block_learning_rate``; ``time_constant`` is in samples (0: no
    block momentum).

    Raises:
        ValueError: ``lr`` not above 0, or ``time_constant`` below 0.
    """

    sums_deltas = True

    def __init__(self, params: Iterable[torch.Tensor], lr: float = 1.0, time_constant: float = 0.0,
                 nesterov: bool = True):
        if not lr > 0:
            raise ValueError(f"block momentum filter: lr={lr!r}: expected a number above 0 (the block learning rate)")
        if not time_constant >= 0:
            raise ValueError(f"block momentum filter: time_constant={time_constant!r}: expected samples >= 0")
        super().__init__(params, {"lr": lr, "time_constant": time_constant, "nesterov": nesterov, "workers": 1,
                                  "samples_in_block": 0})

    @staticmethod
    def block_momentum(group: dict[str, Any]) -> float:
        """``bm = exp(-n / (TC / N))`` for ``group``'s time constant and block."""
        workers = group["workers"]
        return momentum_from_time_constant(group["time_constant"] / workers, group["samples_in_block"] / workers)

    def gives_back_model(self, gradient: torch.Tensor) -> bool:
        """One worker, ``bm`` 0 and lr 1: ``W = W_prev - D`` is the worker's model. Then ``sg <- D``, as the step would."""
        group = self.param_groups[0]
        if group["workers"] != 1 or self.block_momentum(group) != 0.0 or group["lr"] != 1.0:
            return False
        for parameter in group["params"]:
            self.state[parameter]["momentum_buffer"] = gradient.clone()
        return True

    @torch.no_grad()
    def step(self, closure=None):  # noqa: D102 (torch's)
        for group in self.param_groups:
            momentum, lr = self.block_momentum(group), group["lr"]
            for parameter in group["params"]:
                if parameter.grad is None:
                    continue
                state = self.state[parameter]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(parameter)
                smoothed = state["momentum_buffer"]
                smoothed.mul_(momentum).add_(parameter.grad, alpha=(1.0 - momentum) * lr)
                parameter.sub_(smoothed)  # W = W_prev - sg
                if group["nesterov"]:
                    parameter.sub_(smoothed, alpha=momentum)  # W -= bm * sg
        return None


@dataclass
class LearningRateTrace:
    """The inner learning rate over one block's local steps, for the outer momentum's correction.

    Its :meth:`mean` is the value itself when the rate did not change in the block (so a constant rate
    gives a correction of exactly 1), else the mean over the steps.
    """

    total: float = 0.0
    steps: int = 0
    low: float = math.inf
    high: float = -math.inf

    def add(self, lr: float) -> None:
        """Counts one local step at ``lr``."""
        self.total += lr
        self.steps += 1
        self.low, self.high = min(self.low, lr), max(self.high, lr)

    def mean(self) -> float | None:
        """The block's learning rate (None: no step counted)."""
        if self.steps == 0:
            return None
        return self.low if self.low == self.high else self.total / self.steps


def gives_back_model(optimizer: torch.optim.Optimizer, gradient: torch.Tensor, workers: int) -> bool:
    """Whether ``optimizer``'s step on ``gradient`` would give back the one worker's model: its own
    ``gives_back_model`` where it has one; torch's SGD at lr 1 without momentum or weight decay with one worker."""
    own = getattr(optimizer, "gives_back_model", None)
    if own is not None:
        return bool(own(gradient))
    if type(optimizer) is not torch.optim.SGD or workers != 1:
        return False
    return all(group["lr"] == 1.0 and group["momentum"] == 0 and group["weight_decay"] == 0
               and not group["maximize"] for group in optimizer.param_groups)


def first_moments(states: Iterable[dict[str, Any]]) -> Iterator[torch.Tensor]:
    """The first-moment tensors (:data:`FIRST_MOMENT_KEYS`) in an optimizer's per-parameter ``states``."""
    for state in states:
        for key in FIRST_MOMENT_KEYS:
            value = state.get(key)
            if isinstance(value, torch.Tensor):
                yield value


def first_moment(optimizer: torch.optim.Optimizer) -> torch.Tensor | None:
    """The outer optimizer's first-moment tensor (SGD's velocity, BMUF's ``sg``, Adam's ``exp_avg``), or None."""
    return next(first_moments(optimizer.state.values()), None)


def saved_first_moment(saved: dict[str, Any]) -> torch.Tensor | None:
    """The first moment in a saved outer state (an outer optimizer's ``state_dict``, or a checkpoint's from before
    outer optimizers), or None."""
    if "legacy_first_moment" in saved:
        return saved["legacy_first_moment"]
    return next(first_moments(saved.get("state", {}).values()), None)


def first_moment_key(optimizer: torch.optim.Optimizer) -> str | None:
    """Where ``optimizer`` keeps its first moment, for a checkpoint written before outer optimizers (None: it has none)."""
    if isinstance(optimizer, BlockMomentumFilter):
        return "momentum_buffer"
    if isinstance(optimizer, torch.optim.SGD):
        return "momentum_buffer" if optimizer.param_groups[0]["momentum"] != 0 else None
    return None


def _factory_target(factory: OuterOptimizerFactory) -> Any:
    """The class (or function) a factory builds with: a partial's ``func``, else the factory itself."""
    while isinstance(factory, partial):
        factory = factory.func
    return factory


def outer_optimizer_name(factory: OuterOptimizerFactory) -> str:
    """The qualified name of what ``factory`` builds (``torch.optim.sgd.SGD``): a checkpoint's outer state fits only it."""
    target = _factory_target(factory)
    return f"{getattr(target, '__module__', '?')}.{getattr(target, '__qualname__', type(target).__qualname__)}"


def describe_outer_factory(factory: OuterOptimizerFactory) -> str:
    """The outer optimizer in words for the start-up line: its name and the settings a partial gives it."""
    target = _factory_target(factory)
    keywords = factory.keywords if isinstance(factory, partial) else {}
    shown = ", ".join(f"{key} {value:g}" if isinstance(value, float) else f"{key} {value}"
                      for key, value in keywords.items())
    return f"outer optimizer {getattr(target, '__name__', repr(target))}" + (f" ({shown})" if shown else "")


def load_outer_state(optimizer: torch.optim.Optimizer, parameter: torch.Tensor, saved: dict[str, Any] | None) -> None:
    """Loads a checkpoint's outer optimizer state onto ``parameter``'s device and dtype (torch's ``load_state_dict``
    casts), the configured hyper-parameters kept, as the session does for the inner optimizer. A checkpoint written
    before outer optimizers holds one flat tensor, the first moment, which goes where ``optimizer`` keeps its own."""
    if saved is None:
        return
    if "legacy_first_moment" in saved:
        key, tensor = first_moment_key(optimizer), saved["legacy_first_moment"]
        if key is not None and tensor is not None:
            optimizer.state[parameter][key] = tensor.to(parameter).clone()
        return
    configured = [{key: value for key, value in group.items() if key != "params"} for group in optimizer.param_groups]
    optimizer.load_state_dict(saved)
    for group, settings in zip(optimizer.param_groups, configured):
        group.update(settings)


def cpu_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``optimizer.state_dict()`` with every tensor a CPU copy (a checkpoint's replicated outer state)."""
    def on_cpu(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value.detach().cpu().clone()
        if isinstance(value, dict):
            return {key: on_cpu(item) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(on_cpu(item) for item in value)
        return value
    return on_cpu(optimizer.state_dict())


def refuse_replaced_settings(factory: OuterOptimizerFactory | None, settings: dict[str, tuple[Any, Any]]) -> None:
    """Refuses a learner's own outer-step settings changed from their defaults beside an ``outer_optimizer`` that
    replaces that step (they would be accepted and ignored). ``settings``: name -> (value, default).

    Raises:
        ValueError: one line naming the first such setting.
    """
    if factory is None:
        return
    for name, (value, default) in settings.items():
        if value != default:
            raise ValueError(f"learner.{name}={value!r} sets the learner's own outer step, which learner.outer_optimizer "
                             f"replaces: give the setting to the outer optimizer (learner.outer_optimizer.lr, ...) or "
                             f"leave {name} at its default {default!r}")


def plain_factory(factory: OuterOptimizerFactory) -> OuterOptimizerFactory:
    """``factory`` with a config's lists and dicts among a partial's keywords made plain Python (``betas: [0.9,
    0.99]`` arrives as an OmegaConf list, which would go into the optimizer's state and its checkpoints)."""
    if not isinstance(factory, partial):
        return factory
    keywords = {key: OmegaConf.to_container(value) if isinstance(value, (DictConfig, ListConfig)) else value
                for key, value in factory.keywords.items()}
    return partial(factory.func, *factory.args, **keywords)


def build_outer_optimizer(factory: OuterOptimizerFactory, parameter: torch.Tensor) -> torch.optim.Optimizer:
    """``factory([parameter])``, refused in one line when it is not a torch optimizer.

    Raises:
        TypeError: the factory is not callable or did not return a ``torch.optim.Optimizer``.
    """
    if not callable(factory):
        raise TypeError(f"learner.outer_optimizer={factory!r}: expected a torch optimizer class or a partial of one "
                        f"(a config node with _target_ and _partial_: true)")
    try:
        optimizer = factory([parameter])
    except (TypeError, ValueError) as error:  # torch's own checks: "Invalid learning rate: -1", an unknown keyword
        raise type(error)(f"learner.outer_optimizer: {error}") from None
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"learner.outer_optimizer built {type(optimizer).__qualname__}, not a torch.optim.Optimizer: "
                        f"expected a torch optimizer class or a partial of one")
    return optimizer


__all__ = ["BlockMomentumFilter", "FIRST_MOMENT_KEYS", "LearningRateTrace", "OuterOptimizerFactory", "SYNC_FACTS", "build_outer_optimizer",
           "cpu_state", "describe_outer_factory", "first_moment", "first_moment_key", "first_moments", "gives_back_model",
           "load_outer_state", "outer_optimizer_name", "plain_factory", "refuse_replaced_settings",
           "saved_first_moment"]
