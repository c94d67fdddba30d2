"""Training precision: autocast for bf16/fp16 and the dynamic loss scale of fp16.

``precision=fp16`` multiplies the loss by a scale before backward so small float16 gradients do
not flush to zero; the learner divides the gradients by it before any exchange (see
``Learner.loss_scale``) and skips the optimizer step on every rank when they overflowed. The
scale follows ``torch.amp.GradScaler``'s rule (halve on an overflow, double after
``growth_interval`` clean steps) and its state is a ``GradScaler`` state dict, stored in checkpoints.
"""
from __future__ import annotations

import contextlib
from typing import Any

import torch

#: autocast dtypes of the reduced precisions (float32 runs without autocast)
AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(precision: str, device: torch.device):
    """``torch.autocast`` for ``bf16``/``fp16`` on ``device``'s type; a no-op context for ``32``."""
    if precision in AUTOCAST_DTYPES:
        return torch.autocast(device_type=device.type, dtype=AUTOCAST_DTYPES[precision])
    return contextlib.nullcontext()


class LossScaler:
    """fp16's dynamic loss scale, kept in a ``torch.amp.GradScaler`` (its state dict is the checkpoint entry).

    The learner unscales and checks the gradients itself (before the exchange, which a
    ``GradScaler.unscale_`` after the exchange could not do), so only the scale's bookkeeping is
    used here: :attr:`scale` before backward, :meth:`update` with the overflow verdict every
    rank agreed on after the step.

    Args:
        device: where training runs (``GradScaler`` is made for its device type).
    """

    def __init__(self, device: torch.device):
        self.grad_scaler = torch.amp.GradScaler(device.type)

    @property
    def scale(self) -> float:
        """The factor the next minibatch's loss is multiplied by."""
        return float(self.grad_scaler.get_scale())

    def update(self, found_inf: bool) -> None:
        """``GradScaler.update``'s rule: on an overflow multiply the scale by ``backoff_factor`` (0.5);
        after ``growth_interval`` steps without one, by ``growth_factor`` (2)."""
        state = self.grad_scaler.state_dict()
        if found_inf:
            state["scale"] *= state["backoff_factor"]
            state["_growth_tracker"] = 0
        else:
            state["_growth_tracker"] += 1
            if state["_growth_tracker"] == state["growth_interval"]:
                state["scale"] *= state["growth_factor"]
                state["_growth_tracker"] = 0
        self.grad_scaler.load_state_dict(state)

    def state_dict(self) -> dict[str, Any]:
        """The ``GradScaler`` state dict (scale, growth tracker, factors, interval)."""
        return self.grad_scaler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores :meth:`state_dict`'s output."""
        self.grad_scaler.load_state_dict(state)


__all__ = ["AUTOCAST_DTYPES", "LossScaler", "autocast"]
