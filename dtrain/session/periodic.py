"""When a periodic action of the training loop (progress, cross-validation, checkpoint) fires, counted in
global samples as CNTK counts them."""
from __future__ import annotations

import math


class Periodic:
    """Fires when ``samples_seen // frequency`` changes (frequency 0: never; ``sys.maxsize``: at the end)."""

    def __init__(self, frequency: int):
        self.frequency = frequency
        self.last_index = 0
        self.fired_at = 0  # samples seen when it last fired (or was restored)

    def reset(self, samples_seen: int) -> None:
        if self.frequency:
            self.last_index = samples_seen // self.frequency
        self.fired_at = samples_seen

    def pending(self, samples_seen: int) -> bool:
        """Whether samples were seen since it last fired (the end-of-training partial period)."""
        return bool(self.frequency) and samples_seen != self.fired_at

    def next_end(self) -> int | float:
        """The samples seen at which the current period ends (``due`` may fire from then on; inf: never)."""
        return (self.last_index + 1) * self.frequency if self.frequency else math.inf

    def due(self, samples_seen: int, ready: bool = True) -> bool:
        """Whether to fire now: a new period began and ``ready`` (else it stays due until ready)."""
        if not self.frequency:
            return False
        index = samples_seen // self.frequency
        if index != self.last_index and ready:
            self.last_index = index
            self.fired_at = samples_seen
            return True
        return False
