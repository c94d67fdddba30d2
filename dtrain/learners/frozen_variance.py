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

A held variance is a stale second-moment estimate, and a stale estimate lets the steps outgrow the
gradients it was taken from: after a 1-bit exchange a weight whose own gradient is small receives its
column's magnitude, divided by its own small variance (on a 1-D convolutional classifier with Adam at
lr 0.01 the final layer's steps reached 12 times the learning rate, and at lr 0.03 the run collapsed
to chance). So each held step is also clipped as Adafactor clips its updates (Shazeer & Stern 2018,
https://arxiv.org/abs/1804.04235, section 6, "update clipping", threshold 1): a tensor's update whose
root mean square exceeds the learning rate is scaled down to it. Adam's own steps mostly stay below that
(their RMS is 0.1-0.6 of the learning rate on the convolutional model), and an update within the limit is
the optimizer's own, bit for bit; on the language-model recipe 2.5% of the held tensor updates were clipped.
"""
from __future__ import annotations

from typing import Any

import torch

#: the optimizer state that is frozen: the second moment, as torch's Adam, AdamW, NAdam and RAdam name it
VARIANCE_STATE_KEY = "exp_avg_sq"

#: a held step's largest update, per tensor: its root mean square at most this many learning rates
#: (Adafactor's update clipping threshold ``d = 1``)
UPDATE_RMS_LIMIT = 1.0


class FrozenVariance:
    """A copy of every ``exp_avg_sq`` an optimizer keeps, and the step count it was taken at, from the
    first :meth:`hold`; :meth:`hold` before each step writes the copy back scaled to that step's bias
    correction, :meth:`restore` after it writes the copy back as taken (so a checkpoint's optimizer
    state holds the frozen values, and a resumed run freezes the same ones bit for bit).

    torch's step first mixes the step's own gradient into the variance and then divides by its
    bias-corrected value; every held step therefore divides by ``beta2 * v0_hat + (1 - beta2) * g**2 /
    (1 - beta2**t)``, where ``v0_hat`` is the warm start's last bias-corrected variance and ``g`` the step's
    own gradient: nothing accumulates from one step to the next. :meth:`restore` then clips each
    tensor's update to a root mean square of :data:`UPDATE_RMS_LIMIT` learning rates.
    """

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer
        self._kept: list[_Held] | None = None
        self._restored_steps: list[float] | None = None  # the step counts a checkpoint's run held its copy at
        self.held_updates = 0        # statistics: tensors' updates made with the variance held, in this process
        self._clipped: torch.Tensor | None = None  # statistics: how many of them were clipped (read on demand: no sync)

    def hold(self) -> None:
        """Before a step: copies the variances now in the optimizer's state (the first call that finds any;
        before the optimizer's first step there are none, and the copy waits for the next call), then
        writes them scaled to the coming step's bias correction."""
        if self._kept is None:
            self._kept = self._copy() or None
        for held in self._kept or ():
            held.live.copy_(held.kept)
            held.live.mul_(held.scale_for_next_step())
            held.before.copy_(held.parameter.detach())

    def restore(self) -> None:
        """After a step: clips each tensor's update to :data:`UPDATE_RMS_LIMIT` learning rates (root mean
        square), then writes the copy back into the optimizer's state, in place, as it was taken."""
        clipped = []
        for held in self._kept or ():
            clipped.append(held.clip_update())
            held.live.copy_(held.kept)
        if clipped:
            self.held_updates += len(clipped)
            count = torch.stack(clipped).sum()
            self._clipped = count if self._clipped is None else self._clipped + count

    @property
    def clipped_updates(self) -> int:
        """How many tensors' updates :meth:`restore` clipped in this process (a sync on a GPU: read it rarely)."""
        return 0 if self._clipped is None else int(self._clipped)

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
                    kept.append(_Held(parameter, state, group))
        restored, self._restored_steps = self._restored_steps, None
        if restored is not None and len(restored) == len(kept):
            for held, step in zip(kept, restored):
                held.held_at_step = step
        return kept


class _Held:
    """One parameter's held variance: the live state tensor, its copy, and the step count of the copy; and
    the parameter as it was before the step, to clip the step's update."""

    def __init__(self, parameter: torch.Tensor, state: dict[str, Any], group: dict[str, Any]):
        self.parameter = parameter
        self.before = parameter.detach().clone()
        self.group = group
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

    def clip_update(self) -> torch.Tensor:
        """Scales the step just made down to a root mean square of :data:`UPDATE_RMS_LIMIT` times the group's
        learning rate where it was larger (on the device, without a sync); whether it was clipped (a 0-D bool).
        An update within the limit is left bit for bit as the optimizer made it."""
        parameter = self.parameter.detach()
        update = parameter - self.before
        rms = update.pow(2).mean().sqrt()
        limit = UPDATE_RMS_LIMIT * float(self.group["lr"])
        clipped = rms > limit
        parameter.copy_(torch.where(clipped, self.before + update * (limit / rms.clamp_min(1e-30)), parameter))
        return clipped


def keeps_variance(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` is of the Adam family (its groups have ``betas``), whose state has a variance."""
    return bool(optimizer.param_groups) and "betas" in optimizer.param_groups[0]


__all__ = ["UPDATE_RMS_LIMIT", "VARIANCE_STATE_KEY", "FrozenVariance", "keeps_variance"]
