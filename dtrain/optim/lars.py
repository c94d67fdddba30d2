"""LARS: layer-wise adaptive rate scaling for large-minibatch SGD (You, Gitman, Ginsburg 2017, arXiv 1708.03888)."""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from dtrain.optim._adaptive import mark_groups
from dtrain.optim.settings import OPTIMIZER
from dtrain.rules import check_settings


class LARS(torch.optim.Optimizer):
    """Momentum SGD whose step for each parameter tensor is scaled by its trust ratio (the paper's Algorithm 1).

    For each parameter tensor ``w`` with gradient ``g`` (weight decay ``beta``, trust coefficient ``eta``,
    learning rate ``lr`` and momentum ``m`` of its group)::

        local_lr = eta * ||w|| / (||g|| + beta * ||w|| + eps)     (1 when ||w|| = 0 or ||g|| = 0)
        v <- m * v + lr * local_lr * (g + beta * w)
        w <- w - v

    The learning rate sits inside the momentum, as in the paper. Parameters of a group marked
    ``excluded`` (normalization parameters and biases, from ``dtrain.optim.norm_and_bias_groups``) get
    ``local_lr = 1`` and no weight decay while ``exclude_norm_and_bias`` is true: plain momentum SGD,
    ``v <- m * v + lr * g``. A group's ``momentum`` is read at every step, so momentum schedules apply.

    Raises:
        ValueError: ``lr``, ``eta``, ``eps`` not positive, ``weight_decay`` negative, ``momentum`` outside [0, 1).
    """

    uses_norm_and_bias_groups = True  # the command line builds the two groups from the model

    def __init__(self, params: Iterable[Any], lr: float = 0.1, momentum: float = 0.9, eta: float = 0.001,
                 weight_decay: float = 0.0005, eps: float = 1e-9, exclude_norm_and_bias: bool = True) -> None:
        check_settings(OPTIMIZER, lr=lr, momentum=momentum, eta=eta, weight_decay=weight_decay, eps=eps,
                       exclude_norm_and_bias=exclude_norm_and_bias)
        super().__init__(params, dict(lr=lr, momentum=momentum, eta=eta, weight_decay=weight_decay, eps=eps))
        mark_groups(self.param_groups, exclude_norm_and_bias)

    @torch.no_grad()
    def step(self, closure=None):
        """One LARS step on every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, momentum, eta = group["lr"], float(group["momentum"]), group["eta"]
            weight_decay, eps = group["weight_decay"], group["eps"]
            for parameter in group["params"]:
                if parameter.grad is None:
                    continue
                gradient = parameter.grad
                direction = gradient.add(parameter, alpha=weight_decay) if weight_decay else gradient.clone()
                if group.get("adapt", True):
                    weight_norm = torch.linalg.vector_norm(parameter)
                    gradient_norm = torch.linalg.vector_norm(gradient)
                    usable = (weight_norm > 0) & (gradient_norm > 0)
                    local_lr = torch.where(usable, eta * weight_norm / (gradient_norm + weight_decay * weight_norm + eps),
                                           1.0)
                    direction.mul_(local_lr)
                direction.mul_(lr)
                state = self.state[parameter]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = direction
                else:
                    state["momentum_buffer"].mul_(momentum).add_(direction)
                parameter.sub_(state["momentum_buffer"])
        return loss
