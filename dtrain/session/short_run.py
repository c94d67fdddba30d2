"""The start-up note of a run too short for its learner's automatic settings (``docs/learners.md#defaults-that-work``).

The settings a learner derives from the run (a warm start of a quarter of it, blocks for 50 syncs, the
1-bit exchange's held variance) were measured to train as ``data_parallel`` does where the learning-rate
warm-up ends early in the run and the schedule lowers the rate before the end. A recipe shortened with
``session.max_samples`` keeps its schedule's lengths, so it may warm up for most of the run and never lower
the rate: there these settings were measured behind ``data_parallel``, and the note says so and what to set.
The learner declares its automatic settings and the name the note uses (``Learner.automatic_settings``,
``Learner.label``).
"""
from __future__ import annotations

from dtrain.learners.base import WARM_START_FRACTION

#: the start-up line's reference for the promise's conditions
CONDITIONS = "docs/learners.md#defaults-that-work"


def short_run_note(kind: str, settings: list[str], max_samples: int | None, warmup_samples: int,
                   first_change_at: int | None) -> str:
    """The note for a learner ``kind`` with the automatic ``settings`` on a run of ``max_samples`` whose
    learning rate warms up over ``warmup_samples`` and first changes at ``first_change_at`` samples (None: a
    constant after the warm-up); empty when the run meets the conditions, or nothing is derived from it.

    Too short: more than the warm start's share of the run (a quarter) inside the learning-rate warm-up, so
    the learner starts communicating less while the rate still rises, or a schedule whose first change comes
    after the end, so the rate is never lowered."""
    if not settings or max_samples is None:
        return ""
    reasons = []
    if warmup_samples > WARM_START_FRACTION * max_samples:
        inside = min(warmup_samples, max_samples) / max_samples
        reasons.append(f"{inside:.0%} of its {max_samples:,} samples inside the learning-rate warm-up of "
                       f"{warmup_samples:,}")
    if first_change_at is not None and first_change_at >= max_samples:
        reasons.append(f"session.lr_schedule's first change (at {first_change_at:,} samples) never reached")
    if not reasons:
        return ""
    return (f"dtrain: note: this run is too short for learner {kind}'s automatic settings ({', '.join(settings)}): "
            f"{' and '.join(reasons)}, where they were measured with the warm-up ending early and the rate lowered "
            f"before the end ({CONDITIONS}); shorten session.lr_schedule (warmup_samples, values) with "
            f"session.max_samples, or set {', '.join(settings)} yourself, and compare with learner=data_parallel "
            f"at this length")
