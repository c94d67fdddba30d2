"""LAMB: layer-wise adaptive moments for large-minibatch training (You et al. 2019, arXiv 1904.00962, Algorithm 2)."""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from dtrain.optim._adaptive import mark_groups, trust_ratio
from dtrain.optim.settings import OPTIMIZER
from dtrain.rules import check_settings


class LAMB(torch.optim.Optimizer):
    """Adam's direction plus decoupled weight decay, scaled per parameter tensor by its trust ratio.

    For each parameter tensor ``x`` with gradient ``g`` at step ``t`` (``beta1`` = ``momentum``,
    ``beta2`` = ``variance_momentum``, dtrain's names as in ``optimizer=adam``; weight decay ``lambda``)::

        m <- beta1 * m + (1 - beta1) * g
        v <- beta2 * v + (1 - beta2) * g^2
        m_hat = m / (1 - beta1^t),  v_hat = v / (1 - beta2^t)   (bias correction; off: m, v as they are)
        r = m_hat / (sqrt(v_hat) + eps)
        x <- x - lr * phi(||x||) / ||r + lambda * x|| * (r + lambda * x)

    with ``phi`` the identity and the ratio 1 when either norm is 0. Bias correction is on by default
    (the paper's Algorithm 2). Parameters of a group marked ``excluded`` (normalization parameters and
    biases) get ratio 1 and no weight decay while ``exclude_norm_and_bias`` is true: plain Adam.
    A group's ``momentum`` is read at every step, so momentum schedules apply (as beta1).

    Raises:
        ValueError: ``lr`` or ``eps`` not positive, ``weight_decay`` negative, a beta outside [0, 1).
    """

    uses_norm_and_bias_groups = True  # the command line builds the two groups from the model

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, momentum: float = 0.9,
                 variance_momentum: float = 0.999, eps: float = 1e-6, weight_decay: float = 0.01,
                 bias_correction: bool = True, exclude_norm_and_bias: bool = True) -> None:
        check_settings(OPTIMIZER, lr=lr, momentum=momentum, variance_momentum=variance_momentum, eps=eps,
                       weight_decay=weight_decay, bias_correction=bias_correction,
                       exclude_norm_and_bias=exclude_norm_and_bias)
        super().__init__(params, dict(lr=lr, momentum=momentum, variance_momentum=variance_momentum, eps=eps,
                                      weight_decay=weight_decay, bias_correction=bias_correction))
        mark_groups(self.param_groups, exclude_norm_and_bias)

    @torch.no_grad()
    def step(self, closure=None):
        """One LAMB step on every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = float(group["momentum"]), group["variance_momentum"]
            lr, eps, weight_decay = group["lr"], group["eps"], group["weight_decay"]
            for parameter in group["params"]:
                if parameter.grad is None:
                    continue
                gradient = parameter.grad
                state = self.state[parameter]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float64)
                    state["exp_avg"] = torch.zeros_like(parameter)
                    state["exp_avg_sq"] = torch.zeros_like(parameter)
                state["step"] += 1
                step = float(state["step"])
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                exp_avg.lerp_(gradient, 1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(gradient, gradient, value=1 - beta2)
                if group["bias_correction"]:
                    first, second = exp_avg / (1 - beta1 ** step), exp_avg_sq / (1 - beta2 ** step)
                else:
                    first, second = exp_avg, exp_avg_sq
                update = first / (second.sqrt() + eps)
                if weight_decay:
                    update.add_(parameter, alpha=weight_decay)
                if group.get("adapt", True):
                    update.mul_(trust_ratio(torch.linalg.vector_norm(parameter), torch.linalg.vector_norm(update)))
                parameter.sub_(update, alpha=lr)
        return loss
