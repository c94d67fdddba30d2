"""Optimizers whose hyper-parameters carry the names the rest of dtrain uses.

``session.momentum_time_constant_schedule`` and a recipe's ``optimizer.momentum`` set a
parameter group's ``momentum``; SGD reads it directly, and :class:`Adam` reads it as its
beta1 (CNTK's ``adam(momentum=..., variance_momentum=...)`` naming), so every optimizer
combines with every recipe and schedule.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from dtrain.optim.torch_settings import ADAM
from dtrain.rules import check_settings

__all__ = ["Adam", "AdamW"]


class _MomentumAsBeta1:
    """Mixin for torch's Adam family: ``momentum`` is beta1 and ``variance_momentum`` beta2, and each
    parameter group's ``momentum`` is read again at every step (so momentum schedules apply)."""

    def _set_up(self, base: type, params: Iterable[Any], lr: float, momentum: float, variance_momentum: float,
                eps: float, weight_decay: float) -> None:
        check_settings(ADAM, lr=lr, momentum=momentum, variance_momentum=variance_momentum, eps=eps,
                       weight_decay=weight_decay)
        base.__init__(self, params, lr=lr, betas=(momentum, variance_momentum), eps=eps, weight_decay=weight_decay)
        self.defaults["momentum"] = momentum
        for group in self.param_groups:
            group.setdefault("momentum", momentum)

    @torch.no_grad()
    def step(self, closure=None):
        """One step of the wrapped optimizer, with each group's ``momentum`` as its beta1."""
        for group in self.param_groups:
            group["betas"] = (float(group["momentum"]), group["betas"][1])
        return super().step(closure)


class Adam(_MomentumAsBeta1, torch.optim.Adam):
    """``torch.optim.Adam`` with ``momentum`` (beta1) and ``variance_momentum`` (beta2) as parameters.

    Each parameter group keeps a ``momentum`` entry; ``step`` copies it into ``betas[0]``
    first, so a momentum schedule that changes ``group["momentum"]`` acts on Adam as on SGD.
    Raises ValueError naming the argument for a value out of range.
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, momentum: float = 0.9,
                 variance_momentum: float = 0.999, eps: float = 1e-8, weight_decay: float = 0.0) -> None:
        self._set_up(torch.optim.Adam, params, lr, momentum, variance_momentum, eps, weight_decay)


class AdamW(_MomentumAsBeta1, torch.optim.AdamW):
    """``torch.optim.AdamW`` (decoupled weight decay) with ``momentum`` (beta1) and
    ``variance_momentum`` (beta2) as parameters, as :class:`Adam`; DiLoCo's inner optimizer.

    ``weight_decay`` defaults to torch's 0.01. Raises ValueError naming the argument for a value
    out of range.
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, momentum: float = 0.9,
                 variance_momentum: float = 0.999, eps: float = 1e-8, weight_decay: float = 0.01) -> None:
        self._set_up(torch.optim.AdamW, params, lr, momentum, variance_momentum, eps, weight_decay)
