"""``session.profile``: a ``torch.profiler`` trace of a few training minibatches (CNTK's ``-profile``).

The profiler waits ``wait`` minibatches (start-up, the compile check), warms up over ``warmup``,
records ``active`` and then stops, so the rest of the run pays nothing. The trace is written with
``torch.profiler.tensorboard_trace_handler`` into ``run_dir/profile/``: one ``rank<r>.<time>.pt.trace.json``
per profiled rank, a Chrome trace that ``chrome://tracing`` and https://ui.perfetto.dev open and that
TensorBoard's profiler plugin (``torch-tb-profiler``) reads with ``tensorboard --logdir run_dir/profile``.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from dtrain import checks
from dtrain.rules import KeyChecks, check_fields


#: the value rules of ``session.profile``, used by :class:`ProfileConfig` and by ``validate``
PROFILE: KeyChecks = {
    "wait": partial(checks.whole_number, low=0, unit="minibatches"),
    "warmup": partial(checks.whole_number, low=0, unit="minibatches"),
    "active": partial(checks.whole_number, low=1, unit="minibatches"),
    "ranks": partial(checks.choice, choices=checks.PROFILE_RANKS),
}


@dataclass
class ProfileConfig:
    """Which minibatches ``session.profile`` traces, and on which ranks.

    Args:
        wait: minibatches trained before the profiler starts.
        warmup: minibatches traced and then discarded (the profiler's own warm-up).
        active: minibatches recorded in the trace.
        ranks: ``main`` (rank 0) or ``all`` (every rank writes its own trace).
    """

    wait: int = 1
    warmup: int = 1
    active: int = 3
    ranks: str = "main"

    def __post_init__(self):
        check_fields(PROFILE, vars(self), "profile")

    @property
    def window(self) -> tuple[int, int]:
        """The recorded minibatches, numbered from 1 in this run: ``(first, last)``."""
        first = self.wait + self.warmup + 1
        return first, first + self.active - 1


class StepProfiler:
    """A ``torch.profiler.profile`` over one window of minibatches: :meth:`step` after every minibatch,
    :meth:`close` at the end (a run that ends inside the recorded window writes what it recorded)."""

    def __init__(self, config: ProfileConfig, directory: Path, rank: int, device: torch.device):
        self.config = config
        self.directory = directory
        self.rank = rank
        self.enabled = config.ranks == "all" or rank == 0
        self.steps = 0
        self._earlier = set(self._rank_traces())  # a resumed run's directory may hold an earlier run's traces
        self._profiler: torch.profiler.profile | None = None
        if self.enabled:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._profiler = torch.profiler.profile(
                activities=activities,
                schedule=torch.profiler.schedule(wait=config.wait, warmup=config.warmup, active=config.active, repeat=1),
                on_trace_ready=torch.profiler.tensorboard_trace_handler(str(directory), worker_name=f"rank{rank}"),
                record_shapes=True)
            self._profiler.start()

    def step(self) -> None:
        """Marks the end of a minibatch; stops the profiler once its window is recorded (and written)."""
        if self._profiler is None:
            return
        self.steps += 1
        self._profiler.step()
        if self.steps >= self.config.wait + self.config.warmup + self.config.active:
            self.close()

    def close(self) -> None:
        """Stops profiling (idempotent)."""
        if self._profiler is not None:
            profiler, self._profiler = self._profiler, None
            profiler.stop()

    def traces(self) -> list[Path]:
        """The trace files this profiler wrote (none before its window was reached)."""
        return [path for path in self._rank_traces() if path not in self._earlier]

    def _rank_traces(self) -> list[Path]:
        return sorted(self.directory.glob(f"rank{self.rank}.*.pt.trace.json"))

    def describe(self) -> str:
        """The start-up line's words: which minibatches, which ranks, where."""
        first, last = self.config.window
        which = "every rank" if self.config.ranks == "all" else "rank 0"
        return f"profiling minibatches {first}-{last} on {which} into {self.directory}"


__all__ = ["ProfileConfig", "StepProfiler"]
