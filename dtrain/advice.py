"""What a run that diverged or collapsed back to chance is told to change (``docs/semantics.md#collapse``).

Each part of the run declares its own share: the learner (its learning rate, a block learner's local steps),
the exchange it sums through (its compression, bits and warm start); the session lists what they declare.
"""
from __future__ import annotations

from typing import NamedTuple


class Advice(NamedTuple):
    """The likely causes and the changes to try, in the words the session's one-line message lists."""

    causes: tuple[str, ...] = ()
    changes: tuple[str, ...] = ()

    def __add__(self, other: Advice) -> Advice:  # type: ignore[override]
        """Both pieces of advice: the causes of each, then the changes of each."""
        return Advice(self.causes + other.causes, self.changes + other.changes)

    def told(self) -> str:
        """The sentence: ``the likely cause is A, or B; lower optimizer.lr, or ...``."""
        return f"the likely cause is {_listed(self.causes)}; {_listed(self.changes)}"


def _listed(items: tuple[str, ...]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + f", or {items[-1]}"


#: the change a lossy exchange that needs a full-precision start (k-bit) asks for
LONGER_WARM_START = "give a longer full-precision warm start (learner.distributed_after=SAMPLES, 'auto' by default)"
