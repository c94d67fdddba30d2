"""Learning-rate scaling with the global minibatch (``session.lr_scaling``) and Goyal et al.'s gradual warm-up.

``linear`` multiplies the optimizer's lr by ``k = minibatch / reference`` (Goyal et al. 2017, "Accurate,
Large Minibatch SGD"), ``sqrt`` by ``sqrt(minibatch / reference)`` (the rule often used with adaptive
optimizers). With ``warmup_samples = N`` the multiplier starts at 1 (the unscaled lr) and grows
linearly to ``k`` over the first N global samples: ``1 + (k - 1) * min(1, (s + 1) / N)`` after ``s``
samples (Goyal et al.'s gradual warm-up, rather than the ramp from ~0 of a schedule's own warm-up).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from dtrain import checks
from dtrain.schedules import schedule_values

#: the values of ``session.lr_scaling``
RULES = ("none", "linear", "sqrt")


@dataclass(frozen=True)
class LearningRateScaling:
    """The multiplier of every parameter group's lr as a function of the global samples seen.

    Raises:
        ValueError: an unknown ``rule``, or sizes that are not positive whole numbers of samples.
    """

    rule: str
    minibatch_size: int
    reference_minibatch_size: int
    warmup_samples: int = 0

    def __post_init__(self) -> None:
        checks.choice("lr_scaling", self.rule, RULES)
        checks.sample_count("minibatch_size", self.minibatch_size)
        checks.sample_count("lr_reference_minibatch_size", self.reference_minibatch_size)
        checks.sample_count("warmup_samples", self.warmup_samples, allow_zero=True)

    @property
    def factor(self) -> float:
        """``k``: the multiplier once warmed up."""
        ratio = self.minibatch_size / self.reference_minibatch_size
        return {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}[self.rule]

    def __call__(self, samples_seen: int) -> float:
        """The multiplier for the step after ``samples_seen`` global samples."""
        if samples_seen >= self.warmup_samples:
            return self.factor
        return 1.0 + (self.factor - 1.0) * (samples_seen + 1) / self.warmup_samples

    def warmup_multiplier(self, samples_seen: int) -> float:
        """The multiplier after ``samples_seen`` samples as a share of ``k`` (1 after the warm-up)."""
        return self(samples_seen) / self.factor

    def describe(self, lr: float) -> str:
        """``lr 0.1 x 16 (linear, minibatch 1024 / reference 64) = 1.6, warm-up from 0.1 over 5,000 samples``."""
        ratio = f"minibatch {self.minibatch_size} / reference {self.reference_minibatch_size}"
        factor = f"{self.factor:g}" if self.rule == "linear" else f"{self.factor:.4g}"
        text = f"lr {lr:g} x {factor} ({self.rule}, {ratio}) = {lr * self.factor:.4g}"
        if self.warmup_samples:
            return text + f", warm-up from {lr:g} over {self.warmup_samples:,} samples"
        return text + ", no warm-up (session.lr_schedule.warmup_samples=N adds Goyal et al.'s)"


def lr_scaling_problems(session) -> list[str]:
    """``session.lr_scaling`` and ``session.lr_reference_minibatch_size``, one line per problem."""
    problems = []
    rule, reference = session.get("lr_scaling", "none"), session.get("lr_reference_minibatch_size")
    if rule not in RULES:
        problems.append(f"session.lr_scaling={rule!r}: expected one of {', '.join(RULES)}")
    elif rule != "none" and reference is None:
        problems.append(f"session.lr_scaling={rule}: expected session.lr_reference_minibatch_size=SAMPLES, the "
                        f"global minibatch the learning rate was tuned at")
    elif rule != "none" and schedule_values(session.get("minibatch_size_schedule")) is not None:
        problems.append(f"session.lr_scaling={rule} with session.minibatch_size_schedule: the minibatch size changes "
                        f"during the run, so the scaling would be ambiguous; expected session.lr_scaling=none (scale "
                        f"with session.lr_schedule instead) or a fixed session.minibatch_size")
    problems += checks.collect([lambda: checks.sample_count("session.lr_reference_minibatch_size", reference,
                                                            allow_none=True)])
    return problems


def lr_warmup_samples(lr_schedule, lr_scaling: LearningRateScaling | None) -> int:
    """The samples over which the learning rate warms up from the start: ``lr_schedule``'s or ``lr_scaling``'s
    warm-up, the longer (0: none; a plain callable as the schedule says nothing)."""
    return max(int(getattr(lr_schedule, "warmup_samples", 0) or 0), int(getattr(lr_scaling, "warmup_samples", 0) or 0))
