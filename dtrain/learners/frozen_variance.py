"""Adam's second moment held where the float32 warm start left it, once 1-bit gradients take over.

An Adam-family optimizer divides each update by the running RMS of the gradients it is given. After
a 1-bit exchange every value of a column carries one of two magnitudes, so that RMS would follow
the quantizer's column means instead of each weight's own scale. 1-bit Adam (Tang et al. 2021,
https://arxiv.org/abs/2102.02888) freezes the variance at the end of a full-precision warm-up:
the update is then linear in the gradient, and error feedback returns what the quantizer delays.
Measured on the language-model recipe in ``docs/sequence-recipes.md`` (1-bit SGD with AdamW).

What is held is the *bias-corrected* variance ``v / (1 - beta2**t)`` that the step divides by: torch's
Adam divides the stored ``v`` by a correction that still grows with the step count ``t``, so holding
``v`` alone would shrink the denominator step after step (on the digits recipe by 1.8x over the
run) and let the updates grow until the run collapsed.
"""
from __future__ import annotations

from typing import Any

import torch

#: the optimizer state that is frozen: the second moment, as torch's Adam, AdamW, NAdam and RAdam name it
VARIANCE_STATE_KEY = "exp_avg_sq"


class FrozenVariance:
    """A copy of every ``exp_avg_sq`` an optimizer keeps, and the step count it was taken at, from the
    first :meth:`hold`; :meth:`hold` before each step writes the copy back scaled to that step's bias
    correction, :meth:`restore` after it writes the copy back as taken (so a checkpoint's optimizer
    state holds the frozen values, and a resumed run freezes the same ones bit for bit).

    torch's step first mixes the step's own gradient into the variance and then divides by its
    bias-corrected value; every held step therefore divides by ``beta2 * v0_hat + (1 - beta2) * g**2 /
    (1 - beta2**t)``, where ``v0_hat`` is the warm start's last bias-corrected variance and ``g`` the step's
    own gradient: nothing accumulates from one step to the next.
    """

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer
        self._kept: list[_Held] | None = None
        self._restored_steps: list[float] | None = None  # the step counts a checkpoint's run held its copy at

    def hold(self) -> None:
        """Before a step: copies the variances now in the optimizer's state (the first call that finds any;
        before the optimizer's first step there are none, and the copy waits for the next call), then
        writes them scaled to the coming step's bias correction."""
        if self._kept is None:
            self._kept = self._copy() or None
        for held in self._kept or ():
            held.live.copy_(held.kept)
            held.live.mul_(held.scale_for_next_step())

    def restore(self) -> None:
        """After a step: writes the copy back into the optimizer's state, in place, as it was taken."""
        for held in self._kept or ():
            held.live.copy_(held.kept)

    def state_dict(self) -> dict[str, Any]:
        """The step counts the copy was taken at (empty before the first :meth:`hold`), for a resumed run."""
        if self._kept is None:
            return {}
        return {"held_at_steps": [held.held_at_step for held in self._kept]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Forgets the copy (the optimizer's state was replaced by a checkpoint's) and takes :meth:`state_dict`'s
        output: the next :meth:`hold` copies the (restored) variances and
        corrects them as from those step counts. Without it (a checkpoint written before they were
        saved) the copy is corrected as from the step it is taken at."""
        self._kept = None
        steps = state.get("held_at_steps")
        self._restored_steps = [float(step) for step in steps] if steps else None

    def _copy(self) -> list[_Held]:
        kept = []
        for group in self.optimizer.param_groups:
            for parameter in group["params"]:
                state = self.optimizer.state.get(parameter, {})
                if VARIANCE_STATE_KEY in state and "step" in state:
                    kept.append(_Held(state, group))
        restored, self._restored_steps = self._restored_steps, None
        if restored is not None and len(restored) == len(kept):
            for held, step in zip(kept, restored):
                held.held_at_step = step
        return kept


class _Held:
    """One parameter's held variance: the live state tensor, its copy, and the step count of the copy."""

    def __init__(self, state: dict[str, Any], group: dict[str, Any]):
        self.state = state
        self.live: torch.Tensor = state[VARIANCE_STATE_KEY]
        self.kept = self.live.clone()
        self.held_at_step = float(state["step"])
        self.beta2 = float(group["betas"][1])
        self.corrected = bool(group.get("bias_correction", True))  # LAMB-style switch; torch's Adams always correct

    def scale_for_next_step(self) -> float:
        """``(1 - beta2**(t+1)) / (1 - beta2**t0)``: the stored variance that the next step's bias correction
        turns into the held one (1 without bias correction, or before any step)."""
        if not self.corrected or self.held_at_step <= 0:
            return 1.0
        return (1.0 - self.beta2 ** (float(self.state["step"]) + 1.0)) / (1.0 - self.beta2 ** self.held_at_step)


def keeps_variance(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` is of the Adam family (its groups have ``betas``), whose state has a variance."""
    return bool(optimizer.param_groups) and "betas" in optimizer.param_groups[0]


__all__ = ["VARIANCE_STATE_KEY", "FrozenVariance", "keeps_variance"]
