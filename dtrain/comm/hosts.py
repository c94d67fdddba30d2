"""Which ranks share a host: pure functions over what every rank reported (no communication).

A host is what the launcher calls a node: the ranks ``mpiexec`` placed on one hostfile line's
machine (found by MPI's shared-memory split), one torchrun agent's ranks (``GROUP_RANK``), one
Slurm node (``SLURM_NODEID``), else one host name. ``ranks_per_host`` (``comm.ranks_per_host``)
overrides it with consecutive blocks of ranks, to rehearse several hosts on one machine.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence


def node_label(kind: str, environ: Mapping[str, str]) -> str | None:
    """This rank's node as the launcher ``kind`` names it in ``environ``, or None when it does not say
    (``mpiexec``'s node is found at start-up from MPI's shared-memory split; the fallback is the host name)."""
    if kind == "torchrun" and environ.get("GROUP_RANK", "") != "":
        return f"torchrun-node-{environ['GROUP_RANK']}"
    if kind == "slurm" and environ.get("SLURM_NODEID", "") != "":
        return f"slurm-node-{environ['SLURM_NODEID']}"
    return None


def ranks_by_label(labels: Sequence[str]) -> list[list[int]]:
    """The ranks of each host given every rank's node label (indexed by rank); hosts ordered by their
    lowest rank, ranks ascending within a host."""
    hosts: dict[str, list[int]] = {}
    for rank, label in enumerate(labels):
        hosts.setdefault(label, []).append(rank)
    return list(hosts.values())


def ranks_by_block(size: int, ranks_per_host: int) -> list[list[int]]:
    """Consecutive blocks of ``ranks_per_host`` ranks, one block per host (the ``comm.ranks_per_host``
    override). Raises ValueError unless ``ranks_per_host`` is a positive divisor of ``size``."""
    if isinstance(ranks_per_host, bool) or not isinstance(ranks_per_host, int) or ranks_per_host < 1:
        raise ValueError(f"comm.ranks_per_host={ranks_per_host!r}: expected a positive whole number of ranks, "
                         "or null to take the hosts from the launcher")
    if size % ranks_per_host:
        raise ValueError(f"comm.ranks_per_host={ranks_per_host} does not divide the job's {size} ranks into whole "
                         f"hosts; use a divisor of {size}, or null to take the hosts from the launcher")
    return [list(range(first, first + ranks_per_host)) for first in range(0, size, ranks_per_host)]


def describe_hosts(hosts: Sequence[Sequence[int]]) -> str:
    """``2 hosts x 2 ranks`` or ``3 hosts (2, 2, 1 ranks)``."""
    counts = [len(ranks) for ranks in hosts]
    plural = "s" if len(counts) != 1 else ""
    if len(set(counts)) == 1:
        return f"{len(counts)} host{plural} x {counts[0]} rank{'s' if counts[0] != 1 else ''}"
    return f"{len(counts)} host{plural} ({', '.join(map(str, counts))} ranks)"
