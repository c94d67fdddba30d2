"""Adam's second moment held where the float32 warm start left it, once k-bit gradients take over.

An Adam-family optimizer divides each update by the running RMS of the gradients it is given. After
a 1-bit exchange every value of a column carries one of two magnitudes, so that RMS would follow
the quantizer's column means instead of each weight's own scale. 1-bit Adam (Tang et al. 2021,
https://arxiv.org/abs/2102.02888) freezes the variance at the end of a full-precision warm-up:
the update is then linear in the gradient, and error feedback returns what the quantizer delays.
Measured on the language-model recipe in ``docs/sequence-recipes.md`` (1-bit SGD with AdamW).
"""
from __future__ import annotations

import torch

#: the optimizer state that is frozen: the second moment, as torch's Adam, AdamW, NAdam and RAdam name it
VARIANCE_STATE_KEY = "exp_avg_sq"


class FrozenVariance:
    """A copy of every ``exp_avg_sq`` an optimizer keeps, taken at the first :meth:`hold` and written back
    after each step by :meth:`restore` (so a checkpoint's optimizer state holds the frozen values, and a
    resumed run freezes the same ones).

    torch's step first mixes the step's own gradient into the variance and then divides by it; the
    copy is put back after the step, so every step divides by ``beta2 * frozen + (1 - beta2) * g**2``
    with its own ``g`` alone, and nothing accumulates from one step to the next.
    """

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer
        self._kept: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    def hold(self) -> None:
        """Copies the variances now in the optimizer's state (the first call that finds any; before the
        optimizer's first step there are none, and the copy waits for the next call)."""
        if self._kept is None:
            kept = [(state[VARIANCE_STATE_KEY], state[VARIANCE_STATE_KEY].clone())
                    for state in self.optimizer.state.values() if VARIANCE_STATE_KEY in state]
            self._kept = kept or None

    def restore(self) -> None:
        """Writes the copy back into the optimizer's state, in place."""
        for live, kept in self._kept or ():
            live.copy_(kept)

    def release(self) -> None:
        """Forgets the copy (the optimizer's state was replaced, e.g. by a checkpoint): the next
        :meth:`hold` copies again."""
        self._kept = None


def keeps_variance(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` is of the Adam family (its groups have ``betas``), whose state has a variance."""
    return bool(optimizer.param_groups) and "betas" in optimizer.param_groups[0]


__all__ = ["VARIANCE_STATE_KEY", "FrozenVariance", "keeps_variance"]
