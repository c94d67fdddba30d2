"""RMSprop warm-up then momentum SGD (Akiba, Suzuki, Fukuda 2017, arXiv 1711.04325, "RMSprop warm-up")."""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from dtrain.optim.settings import OPTIMIZER
from dtrain.rules import check_settings


class RMSpropWarmupSGD(torch.optim.Optimizer):
    """Starts as RMSprop with momentum and moves to momentum SGD as ``alpha_sgd`` goes from 0 to 1.

    For each parameter ``theta`` with gradient ``g`` (``mu1`` = ``momentum``, ``mu2`` = ``variance_momentum``,
    learning rate ``eta``, ``alpha_rmsprop = 1 - alpha_sgd``)::

        m     <- mu2 * m + (1 - mu2) * g^2
        delta <- mu1 * delta - eta * g / (alpha_sgd + alpha_rmsprop * (sqrt(m) + eps))
        theta <- theta + delta

    At ``alpha_sgd = 0`` this is RMSprop with momentum, at 1 momentum SGD (``delta`` keeps the learning
    rate inside, as the paper writes it). ``alpha_sgd`` is a function of the global samples seen ``s``,
    linear over the transition: ``clamp((s - transition_start) / transition_samples, 0, 1)``;
    ``training_session`` calls :meth:`set_samples_seen` before every step. The second moment ``m`` keeps
    being updated after the transition (it no longer acts). ``weight_decay`` adds ``weight_decay * theta``
    to ``g`` (L2, as torch's SGD).

    Raises:
        ValueError: ``lr`` or ``eps`` not positive, a momentum outside [0, 1), ``weight_decay`` negative,
            ``transition_samples`` not a positive whole number, ``transition_start`` negative.
    """

    def __init__(self, params: Iterable[Any], lr: float = 0.1, momentum: float = 0.9,
                 variance_momentum: float = 0.99, eps: float = 1e-8, weight_decay: float = 0.0,
                 transition_samples: int = 100_000, transition_start: int = 0) -> None:
        check_settings(OPTIMIZER, lr=lr, momentum=momentum, variance_momentum=variance_momentum, eps=eps,
                       weight_decay=weight_decay, transition_samples=transition_samples,
                       transition_start=transition_start)
        super().__init__(params, dict(lr=lr, momentum=momentum, variance_momentum=variance_momentum, eps=eps,
                                      weight_decay=weight_decay, transition_samples=transition_samples,
                                      transition_start=transition_start, alpha_sgd=0.0))

    def set_samples_seen(self, samples_seen: int) -> None:
        """Sets each group's ``alpha_sgd`` for the step that follows ``samples_seen`` global samples."""
        for group in self.param_groups:
            progress = (samples_seen - group["transition_start"]) / group["transition_samples"]
            group["alpha_sgd"] = min(1.0, max(0.0, progress))

    @torch.no_grad()
    def step(self, closure=None):
        """One step with each group's current ``alpha_sgd``."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            alpha_sgd = group["alpha_sgd"]
            mu1, mu2 = float(group["momentum"]), group["variance_momentum"]
            for parameter in group["params"]:
                if parameter.grad is None:
                    continue
                gradient = parameter.grad
                if group["weight_decay"]:
                    gradient = gradient.add(parameter, alpha=group["weight_decay"])
                state = self.state[parameter]
                if not state:
                    state["square_avg"] = torch.zeros_like(parameter)
                    state["momentum_buffer"] = torch.zeros_like(parameter)
                square_avg = state["square_avg"]
                square_avg.mul_(mu2).addcmul_(gradient, gradient, value=1 - mu2)
                denominator = (square_avg.sqrt() + group["eps"]).mul_(1 - alpha_sgd).add_(alpha_sgd)
                # momentum_buffer holds -delta, so block momentum's reset of "momentum_buffer" applies
                state["momentum_buffer"].mul_(mu1).addcdiv_(gradient, denominator, value=group["lr"])
                parameter.sub_(state["momentum_buffer"])
        return loss
