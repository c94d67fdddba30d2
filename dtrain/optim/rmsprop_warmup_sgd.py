"""RMSprop warm-up then momentum SGD (Akiba, Suzuki, Fukuda 2017, arXiv 1711.04325, "RMSprop warm-up")."""
from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

from dtrain.optim.settings import OPTIMIZER
from dtrain.rules import check_settings


def alpha_sgd(samples_seen: int, center_samples: int, period_samples: int) -> float:
    """The paper's share of SGD in the update after ``samples_seen`` global samples, an ELU-shaped rise.

    ``1/2 exp(2 (s - c) / p)`` before the center ``c``, then ``1/2 + (s - c) / p`` up to ``c + p/2``, then 1:
    continuous with a continuous slope (``1/p`` at ``c``). The paper's β_center and β_period count epochs
    (10 and 5 of ResNet-50's 90); here they count global samples.
    """
    offset = (samples_seen - center_samples) / period_samples
    if offset < 0:
        return 0.5 * math.exp(2 * offset)
    return min(1.0, 0.5 + offset)


class RMSpropWarmupSGD(torch.optim.Optimizer):
    """Starts as RMSprop with momentum and becomes momentum SGD as ``alpha_sgd`` rises from ~0 to 1.

    For each parameter ``theta`` with gradient ``g`` (``mu1`` = ``momentum``, ``mu2`` = ``variance_momentum``,
    learning rate ``eta``, ``alpha_rmsprop = rmsprop_scale * (1 - alpha_sgd)``), the paper's section 3.1::

        m     <- mu2 * m + (1 - mu2) * g^2
        delta <- mu1 * delta - (alpha_sgd + alpha_rmsprop / (sqrt(m) + eps)) * g
        theta <- theta + eta * delta

    At ``alpha_sgd = 1`` this is ``torch.optim.SGD`` with momentum (dampening 0), op for op in effect; near 0
    it is RMSprop with momentum at the learning rate ``eta * rmsprop_scale``: the paper's update has one
    ``eta`` for both parts, and SGD's ``eta`` (0.1 x minibatch / 256 in the paper) would make RMSprop's steps,
    about ``eta`` per coordinate, diverge; ``rmsprop_scale`` (default 0.01) sizes them. ``alpha_sgd`` follows
    :func:`alpha_sgd` of the global samples seen, from ``center_samples`` and ``period_samples``; ``training_session`` calls :meth:`set_samples_seen` before every
    step. ``weight_decay`` adds ``weight_decay * theta`` to ``g`` (L2, as torch's SGD).

    Raises:
        ValueError: ``lr`` or ``eps`` not positive, a momentum outside [0, 1), ``weight_decay`` negative,
            ``center_samples`` negative, ``period_samples`` not a positive whole number, ``rmsprop_scale``
            not positive.
    """

    def __init__(self, params: Iterable[Any], lr: float = 0.1, momentum: float = 0.9,
                 variance_momentum: float = 0.99, eps: float = 1e-8, weight_decay: float = 0.0,
                 center_samples: int = 100_000, period_samples: int = 50_000, rmsprop_scale: float = 0.01) -> None:
        check_settings(OPTIMIZER, lr=lr, momentum=momentum, variance_momentum=variance_momentum, eps=eps,
                       weight_decay=weight_decay, center_samples=center_samples, period_samples=period_samples,
                       rmsprop_scale=rmsprop_scale)
        super().__init__(params, dict(lr=lr, momentum=momentum, variance_momentum=variance_momentum, eps=eps,
                                      weight_decay=weight_decay, center_samples=center_samples,
                                      period_samples=period_samples, rmsprop_scale=rmsprop_scale,
                                      alpha_sgd=alpha_sgd(0, center_samples, period_samples)))

    def set_samples_seen(self, samples_seen: int) -> None:
        """Sets each group's ``alpha_sgd`` for the step that follows ``samples_seen`` global samples."""
        for group in self.param_groups:
            group["alpha_sgd"] = alpha_sgd(samples_seen, group["center_samples"], group["period_samples"])

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's, refusing in one line a state saved with another transition (its keys differ)."""
        for group in state_dict.get("param_groups", []):
            if "center_samples" not in group:
                raise ValueError("the checkpoint's rmsprop_warmup_sgd state has a linear transition "
                                 f"({', '.join(sorted(key for key in group if key.startswith('transition')))}); "
                                 "expected center_samples and period_samples (the paper's schedule): start "
                                 "a new run")
        super().load_state_dict(state_dict)

    @torch.no_grad()
    def step(self, closure=None):
        """One step with each group's current ``alpha_sgd``."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            share_sgd = group["alpha_sgd"]
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
                # coefficient = alpha_sgd + alpha_rmsprop / (sqrt(m) + eps)
                alpha_rmsprop = group["rmsprop_scale"] * (1 - share_sgd)
                coefficient = (square_avg.sqrt() + group["eps"]).reciprocal_().mul_(alpha_rmsprop).add_(share_sgd)
                # momentum_buffer holds -delta (torch's SGD convention), so block momentum's reset of it applies
                state["momentum_buffer"].mul_(mu1).addcmul_(coefficient, gradient)
                parameter.add_(state["momentum_buffer"], alpha=-group["lr"])
        return loss
