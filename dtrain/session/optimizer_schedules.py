"""What changes the optimizer's settings as samples are seen: the lr schedule and scaling, the momentum
schedule, and an optimizer's own clock; set before every minibatch by the training loop."""
from __future__ import annotations

from collections.abc import Callable

import torch

from dtrain.schedules import momentum_from_time_constant
from dtrain.session.lr_scaling import LearningRateScaling, lr_warmup_samples


class OptimizerSchedules:
    """Sets each parameter group's lr (and momentum) for the next minibatch from the samples seen.

    Args:
        optimizer: the learner's optimizer; its configured lrs are the base the multipliers scale.
        lr_schedule: multipliers of each group's base lr, by samples seen (``None``: 1).
        lr_scaling: a :class:`~dtrain.session.lr_scaling.LearningRateScaling` multiplying them too (``None``: none).
        momentum_time_constant_schedule: momentum as time constants in samples (``exp(-mb/tc)`` per minibatch).
        unit_gain_momentum: set SGD's dampening to the momentum, so steps are ``lr``-sized (CNTK).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, lr_schedule: Callable | None = None,
                 lr_scaling: LearningRateScaling | None = None,
                 momentum_time_constant_schedule: Callable | None = None, unit_gain_momentum: bool = False):
        self.optimizer = optimizer  # its param_groups are read at every step: loading its state replaces them
        self.base_learning_rates = [group["lr"] for group in optimizer.param_groups]  # configured; multipliers scale them
        self.lr_schedule, self.lr_scaling = lr_schedule, lr_scaling
        self.momentum_time_constant_schedule = momentum_time_constant_schedule
        self.unit_gain_momentum = unit_gain_momentum
        clock = getattr(optimizer, "set_samples_seen", None)  # told the samples seen before every step
        self.optimizer_clock = clock if callable(clock) else None  # e.g. RMSpropWarmupSGD

    @property
    def in_use(self) -> bool:
        """Whether anything changes the optimizer's settings as samples are seen (the loop skips :meth:`apply`
        otherwise)."""
        return (self.lr_schedule is not None or self.lr_scaling is not None
                or self.momentum_time_constant_schedule is not None or self.optimizer_clock is not None)

    def warmup_samples(self) -> int:
        """The samples over which the learning rate warms up from the start (``lr_scaling.lr_warmup_samples``)."""
        return lr_warmup_samples(self.lr_schedule, self.lr_scaling)

    def apply(self, samples_seen: int, minibatch_size: int) -> None:
        """Sets each parameter group's lr (and momentum) for the minibatch of ``minibatch_size`` samples that
        follows ``samples_seen``."""
        groups = self.optimizer.param_groups
        if self.lr_schedule is not None or self.lr_scaling is not None:
            multiplier = (self.lr_schedule(samples_seen) if self.lr_schedule is not None else 1.0) \
                * (self.lr_scaling(samples_seen) if self.lr_scaling is not None else 1.0)
            for group, base in zip(groups, self.base_learning_rates):
                group["lr"] = base * multiplier
        if self.momentum_time_constant_schedule is not None:
            momentum = momentum_from_time_constant(self.momentum_time_constant_schedule(samples_seen), minibatch_size)
            for group in groups:
                group["momentum"] = momentum
                if self.unit_gain_momentum:
                    group["dampening"] = momentum
        if self.optimizer_clock is not None:
            self.optimizer_clock(samples_seen)


__all__ = ["OptimizerSchedules"]
