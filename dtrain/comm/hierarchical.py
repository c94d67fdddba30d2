"""HierarchicalCommunicator: the job's communicator whose all-reduce crosses the hosts once.

The flat all-reduce of ``n`` bytes over N ranks sends each rank's ``2(N-1)/N * n`` through the
transport's ring, and the ring crosses host boundaries wherever two neighbouring ranks live on
different hosts, so each host's link carries up to ``2(N-1)/N * n`` (the ranks' whole traffic, for
hosts of consecutive ranks). Here, as in ChainerMN's ``hierarchical`` communicator and Horovod's
hierarchical all-reduce, the sum takes three steps:

1. reduce onto each host's leader (its lowest rank), over the host-local communicator;
2. all-reduce between the leaders (one rank per host), over the leaders' communicator;
3. broadcast from each leader over the host-local communicator.

Each host's link then carries ``2(H-1)/H * n`` for H hosts, in one flow per host. ChainerMN's
``two_dimensional`` variant (reduce-scatter within the host, L parallel all-reduces of ``n/L``
between hosts, all-gather) sends exactly the same bytes between hosts; it only wins with several
network cards per host, and needs equal rank counts per host. The reduce/broadcast form is used:
hosts may hold different numbers of ranks.

Every other collective is the job's own (:attr:`world`). The three steps run on one background
thread, in the order they were asked for, so :meth:`allreduce_async` still overlaps the backward
pass. The result is the same on every rank (step 3 copies the leader's), but it is summed in
another order than the flat all-reduce's, so it equals it to float rounding, not bit for bit
(``docs/multi-host.md``).
"""
from __future__ import annotations

import concurrent.futures
from typing import Any, NoReturn

import torch

from dtrain.comm.base import AsyncHandle, Communicator, HostGroups
from dtrain.comm.hosts import describe_hosts

HIERARCHICAL_CHOICES = ("auto", True, False)
"""``comm.hierarchical``: ``auto`` (on when the job spans several hosts and some host has several
ranks), ``true`` or ``false``."""


class _FutureHandle(AsyncHandle):
    """An all-reduce queued on the hierarchical communicator's thread."""

    def __init__(self, future: concurrent.futures.Future) -> None:
        self._future = future

    def wait(self) -> torch.Tensor:
        """Block until the three steps are done; re-raises a failure of any of them."""
        return self._future.result()


class HierarchicalCommunicator(Communicator):
    """``world`` (the job's communicator) with a hierarchical :meth:`allreduce`; see the module docstring.

    ``groups`` is ``world.host_groups(...)`` and ``hosts`` the job's ranks per host
    (``world.host_ranks(...)``). Every other attribute and collective is ``world``'s.
    """

    def __init__(self, world: Communicator, groups: HostGroups, hosts: list[list[int]]) -> None:
        self.world, self.local, self.leaders, self.hosts = world, groups.local, groups.leaders, hosts
        self.launcher = world.launcher
        self.node_label = world.node_label
        device = world.device
        initializer = (lambda: torch.cuda.set_device(device)) if device.type == "cuda" else None
        self._thread = concurrent.futures.ThreadPoolExecutor(1, "dtrain-hierarchical-allreduce", initializer)
        # -- statistics (this rank, since start; the byte model of describe_traffic())
        self.bytes_sent = 0
        self.bytes_between_hosts = 0

    def describe(self) -> str:
        """One line for the start-up summary."""
        return (f"hierarchical all-reduce over {describe_hosts(self.hosts)}: reduce to each host's leader, "
                f"all-reduce between the {len(self.hosts)} leaders, broadcast within each host")

    # -- identity: the job's ------------------------------------------------------------------
    @property
    def rank(self) -> int:
        """Global rank."""
        return self.world.rank

    @property
    def size(self) -> int:
        """World size."""
        return self.world.size

    @property
    def local_rank(self) -> int:
        """The job communicator's node-local rank."""
        return self.world.local_rank

    @property
    def local_size(self) -> int:
        """The job communicator's node-local size."""
        return self.world.local_size

    @property
    def backend(self) -> str:
        """The job communicator's transport."""
        return self.world.backend

    @property
    def device(self) -> torch.device:
        """The job communicator's device."""
        return self.world.device

    @property
    def reduce_alone_bytes(self) -> int:  # type: ignore[override]
        """The job communicator's threshold."""
        return self.world.reduce_alone_bytes

    @property
    def store_endpoint(self) -> tuple[str, int] | None:
        """The job's rendezvous store (heartbeats and agreements use it)."""
        return getattr(self.world, "store_endpoint", None)

    @property
    def heartbeat(self) -> Any:
        """The job communicator's heartbeat (set by :func:`dtrain.comm.start_heartbeat`)."""
        return getattr(self.world, "heartbeat", None)

    @heartbeat.setter
    def heartbeat(self, value: Any) -> None:
        self.world.heartbeat = value

    def __getattr__(self, name: str) -> Any:
        # attributes only some transports have (e.g. a capability flag) are the job communicator's
        if name.startswith("__") or name == "world":
            raise AttributeError(name)
        return getattr(self.world, name)

    # -- the hierarchical all-reduce -------------------------------------------------------------
    def allreduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Reduce in place over all ranks through the three steps; return ``tensor``."""
        return self.allreduce_async(tensor, op).wait()

    def allreduce_async(self, tensor: torch.Tensor, op: str = "sum") -> AsyncHandle:
        """Queue the three steps on this communicator's thread; ``wait()`` returns ``tensor``."""
        self._check_reduce(tensor, op)
        return _FutureHandle(self._thread.submit(self._allreduce_now, tensor, op))

    def _allreduce_now(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        step_op = "sum" if op == "mean" else op
        if self.local.size > 1:
            self.local.reduce(tensor, root=0, op=step_op)
        if self.leaders is not None and self.leaders.size > 1:
            self.leaders.allreduce(tensor, op=step_op)
        if self.local.size > 1:
            self.local.broadcast(tensor, root=0)
        if op == "mean":
            tensor.div_(self.size)
        sent, between = self.allreduce_traffic(tensor.numel() * tensor.element_size())
        self.bytes_sent += sent
        self.bytes_between_hosts += between
        return tensor

    def allreduce_bytes_sent(self, num_bytes: int) -> int:
        """Bytes this rank sends in one all-reduce of ``num_bytes`` (what the exchanges count per step)."""
        return self.allreduce_traffic(num_bytes)[0]

    def allreduce_traffic(self, num_bytes: int) -> tuple[int, int]:
        """(bytes this rank sends, of them between hosts) in one all-reduce of ``num_bytes``, by the
        model: a non-leader sends its tensor to the leader once; a leader sends ``2(H-1)/H`` of it to
        the other leaders (a ring) and one copy to each other rank of its host."""
        if self.leaders is None:
            return (num_bytes if self.local.size > 1 else 0), 0
        hosts = self.leaders.size
        between = round(2 * (hosts - 1) * num_bytes / hosts)
        return between + (self.local.size - 1) * num_bytes, between

    # -- everything else: the job's collectives ---------------------------------------------------
    def broadcast(self, tensor: torch.Tensor, root: int = 0) -> torch.Tensor:
        """The job communicator's broadcast."""
        return self.world.broadcast(tensor, root)

    def reduce(self, tensor: torch.Tensor, root: int = 0, op: str = "sum") -> torch.Tensor:
        """The job communicator's reduce."""
        return self.world.reduce(tensor, root, op)

    def allgather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """The job communicator's all-gather."""
        return self.world.allgather(tensor)

    def all_to_all(self, sends: list[torch.Tensor], receive_sizes: list[int] | None = None) -> list[torch.Tensor]:
        """The job communicator's all-to-all."""
        return self.world.all_to_all(sends, receive_sizes)

    def allgather_object(self, obj: Any) -> list[Any]:
        """The job communicator's."""
        return self.world.allgather_object(obj)

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        """The job communicator's."""
        return self.world.broadcast_object(obj, root)

    def gather_object(self, obj: Any, root: int = 0) -> list[Any] | None:
        """The job communicator's."""
        return self.world.gather_object(obj, root)

    def split(self, color: int | None, key: int = 0) -> Communicator | None:
        """The job communicator's split (its sub-communicators are flat)."""
        return self.world.split(color, key)

    def host_ranks(self, ranks_per_host: int | None = None) -> list[list[int]]:
        """The job communicator's."""
        return self.world.host_ranks(ranks_per_host)

    def host_groups(self, ranks_per_host: int | None = None) -> HostGroups:
        """The job communicator's (the groups this communicator uses, for the same ``ranks_per_host``)."""
        return self.world.host_groups(ranks_per_host)

    def barrier(self) -> None:
        """Waits for the queued all-reduces, then the job communicator's barrier."""
        self._thread.submit(lambda: None).result()
        self.world.barrier()

    def abort(self, message: str, exit_code: int = 1) -> NoReturn:
        """Ends the whole job (the job communicator's abort)."""
        self.world.abort(message, exit_code)

    def finalize(self) -> None:
        """Finishes the queued all-reduces, stops the thread, then finalizes the job communicator."""
        self._thread.shutdown(wait=True)
        self.world.finalize()


def hierarchical_setting(value: Any) -> str | bool:
    """``comm.hierarchical`` as ``"auto"``, True or False. Raises ValueError for anything else."""
    if isinstance(value, bool) or value == "auto":
        return value
    raise ValueError(f"comm.hierarchical={value!r}: expected auto, true or false")


def make_hierarchical(world: Communicator, setting: Any = "auto", ranks_per_host: int | None = None
                      ) -> tuple[Communicator, str]:
    """``(communicator, start-up line)`` for ``comm.hierarchical=setting``: ``world`` itself or a
    :class:`HierarchicalCommunicator` over it. Collective (host detection, two splits when on).

    ``auto`` turns it on when the job spans several hosts and some host has several ranks (otherwise
    there is nothing to save). ``true`` where it would do nothing (one host, or one rank per host)
    is refused, not silently run flat. Raises ValueError for a bad ``setting`` or ``ranks_per_host``.
    """
    setting = hierarchical_setting(setting)
    if setting is False:
        return world, ""
    if world.size == 1:
        if setting is True:
            raise ValueError("comm.hierarchical=true needs a job of several processes on several hosts; this one "
                             "has 1 process: use comm.hierarchical=auto or false")
        return world, ""
    if ranks_per_host is None and world.local_size == world.size:
        hosts = [list(range(world.size))]  # the launcher put every rank on this node
    else:
        hosts = world.host_ranks(ranks_per_host)
    useful = len(hosts) > 1 and max(len(ranks) for ranks in hosts) > 1
    source = f"comm.ranks_per_host={ranks_per_host}" if ranks_per_host is not None else f"the {world.launcher} launcher"
    if not useful:
        if setting is True:
            raise ValueError(f"comm.hierarchical=true: the job runs on {describe_hosts(hosts)} (from {source}), where "
                             "a hierarchical all-reduce is the flat one; use comm.hierarchical=auto or false")
        if len(hosts) == 1:
            return world, ""
        return world, f"flat all-reduce: {describe_hosts(hosts)} (from {source}; comm.hierarchical={_word(setting)})"
    groups = world.host_groups(ranks_per_host)
    communicator = HierarchicalCommunicator(world, groups, hosts)
    return communicator, f"{communicator.describe()} (hosts from {source}; comm.hierarchical={_word(setting)})"


def _word(setting: str | bool) -> str:
    return setting if isinstance(setting, str) else str(setting).lower()


__all__ = ["HIERARCHICAL_CHOICES", "HierarchicalCommunicator", "hierarchical_setting", "make_hierarchical"]
