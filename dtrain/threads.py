"""How many torch (intra-op) threads a training process uses, and why: one line for the start-up summary.

torch's default is one thread per physical core. Its OpenMP threads wait for each other at the end
of every operation, so when other processes keep some cores busy, a thread that is not scheduled
holds up all the others: on a 2-core machine loaded by 2 other processes the digits recipe ran
19-54x slower with torch's 2 threads than with 1 (``benchmarks/thread_choice.py``). Too few threads
on an idle machine costs at most the parallel speed-up; too many on a busy one costs far more. So
the choice is deliberate and errs on the side of fewer:

* ``session.num_threads`` (or ``OMP_NUM_THREADS`` in the environment) when given;
* several ranks: the CPUs this process may run on divided by the ranks on its node;
* one process: those CPUs minus the ones other processes already keep busy (the 1-minute load
  average at start-up, rounded), at least 1, and never more than torch's own default.
"""
from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class ThreadChoice:
    """The thread count for one process, and the reason in words (for the start-up line)."""

    threads: int
    reason: str

    def describe(self, per_process: bool = False) -> str:
        """``2 torch threads (...)``: the start-up line's text."""
        noun = "thread" if self.threads == 1 else "threads"
        return f"{self.threads} torch {noun}{' per process' if per_process else ''} ({self.reason})"


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask, e.g. a Slurm or container limit), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not on Linux
        return max(1, os.cpu_count() or 1)


def busy_cpus() -> float:
    """Other processes' demand for CPUs: the 1-minute load average (0 where the system has none)."""
    try:
        return max(0.0, os.getloadavg()[0])
    except (AttributeError, OSError):
        return 0.0


def choose_threads(requested: int | None, local_ranks: int, torch_default: int, *, environment=None,
                   cpus: int | None = None, load: float | None = None, node_cpus: int | None = None) -> ThreadChoice:
    """The torch thread count for one process of a job with ``local_ranks`` processes on this node.

    Args:
        requested: ``session.num_threads`` (``None``: choose).
        local_ranks: processes of this job on this node (1: a single process).
        torch_default: ``torch.get_num_threads()`` before any change (torch's one per physical core,
            or what ``OMP_NUM_THREADS`` set).
        environment: the environment to look for ``OMP_NUM_THREADS`` in (default: ``os.environ``).
        cpus, load, node_cpus: CPUs this process may use, the load average and the node's CPUs
            (default: measured now); for tests.
    """
    environment = os.environ if environment is None else environment
    if requested:
        return ThreadChoice(int(requested), "session.num_threads")
    if environment.get("OMP_NUM_THREADS", "").strip().isdigit() and int(environment["OMP_NUM_THREADS"]) > 0:
        return ThreadChoice(int(environment["OMP_NUM_THREADS"]), "OMP_NUM_THREADS")
    cpus = usable_cpus() if cpus is None else cpus
    if local_ranks > 1:
        # a launcher that binds each rank to its cores (Open MPI binds 2 ranks to a core each) already
        # gave it its share: never more than the CPUs it may run on, nor than the node's CPUs / ranks
        node_cpus = max(cpus, os.cpu_count() or 1) if node_cpus is None else node_cpus
        threads = max(1, min(cpus, node_cpus // local_ranks))
        return ThreadChoice(threads, f"{node_cpus} CPUs / {local_ranks} processes on this node"
                            + (f", bound to {_cpus(cpus)}" if cpus < node_cpus else ""))
    load = busy_cpus() if load is None else load
    busy = min(cpus, int(load + 0.5))
    threads = max(1, min(cpus - busy, torch_default))
    if busy == 0:
        reason = f"{_cpus(cpus)}, idle" + (f"; torch's default is {torch_default}" if threads < cpus else "")
    else:
        reason = (f"{_cpus(cpus)}, {busy} kept busy by other processes (load {load:.1f}): more threads would wait "
                  f"for each other; session.num_threads=N to choose")
    return ThreadChoice(threads, reason)


def _cpus(count: int) -> str:
    return f"{count} CPU{'' if count == 1 else 's'}"


__all__ = ["ThreadChoice", "busy_cpus", "choose_threads", "usable_cpus"]
