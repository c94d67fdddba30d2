"""A strategy that compresses between hosts only: exact sums inside each host, any strategy between them.

:class:`BetweenHosts` wraps another strategy (k-bit with error feedback, PowerSGD, bf16, float32).
Each tensor set (a gradient bucket) travels in three steps, on one background thread so that it
overlaps backward as the other strategies do:

1. an exact float32 sum onto each host's leader (its lowest rank), over the host-local communicator;
2. the leaders sum the host sums with the wrapped strategy over the leaders' communicator, so its
   ``N`` is the number of hosts and its per-rank state (error-feedback residuals, PowerSGD's P and Q)
   lives on the leaders, one per host;
3. each leader broadcasts the result inside its host.

Every rank ends with the leaders' bits, which the wrapped strategy makes identical on all leaders.
"""
from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import torch

from dtrain.advice import Advice
from dtrain.comm.base import HostGroups
from dtrain.exchange.base import Exchange, ThreadedExchange, full_precision_allreduce_bytes


class BetweenHosts(ThreadedExchange):
    """Runs ``inner`` between the host leaders of ``groups`` after an exact sum inside each host.

    ``bytes_sent_last_step`` counts everything this rank sent (a non-leader: its tensor to the leader;
    a leader: the wrapped strategy's bytes plus one copy to each other rank of its host);
    ``bytes_between_hosts_last_step`` only the wrapped strategy's (0 on non-leaders);
    ``full_precision_bytes_last_step`` a flat float32 ring all-reduce over the whole job.

    Args:
        inner: the strategy the leaders exchange the host sums with (not itself a ``BetweenHosts``).
        groups: the job's ``host_groups()``: ``local`` (this rank's host) and ``leaders`` (None off the leaders).

    Raises:
        TypeError: ``inner`` is not an :class:`Exchange`, or is a ``BetweenHosts``.
    """

    name = "between_hosts"

    def __init__(self, inner: Exchange, groups: HostGroups):
        super().__init__()
        if not isinstance(inner, Exchange) or isinstance(inner, BetweenHosts):
            raise TypeError(f"inner must be a dtrain.exchange.Exchange strategy between hosts (e.g. "
                            f"dtrain.exchange.Quantized), got {type(inner).__name__}")
        self.inner = inner
        self.local, self.leaders = groups.local, groups.leaders
        self.bytes_between_hosts_last_step = 0

    # -- what the learner asks of the wrapped strategy ---------------------------------------------
    @property
    def lossless(self) -> bool:  # type: ignore[override]
        """The wrapped strategy's: the host sums are exact."""
        return self.inner.lossless

    @property
    def stateful(self) -> bool:  # type: ignore[override]
        """The wrapped strategy's (its state lives on the leaders)."""
        return self.inner.stateful

    @property
    def needs_warm_start(self) -> bool:  # type: ignore[override]
        """The wrapped strategy's (k-bit asks for a float32 warm start)."""
        return self.inner.needs_warm_start

    def collapse_advice(self, sent: str) -> Advice:
        """The wrapped strategy's (the host sums are exact)."""
        return self.inner.collapse_advice(sent)

    @property
    def holds_adam_variance(self) -> bool:  # type: ignore[override]
        """The wrapped strategy's among the leaders (off them it sees the host's size: the learner takes rank 0's)."""
        return self.inner.holds_adam_variance

    @property
    def is_leader(self) -> bool:
        """Whether this rank exchanges its host's sum with the other hosts."""
        return self.leaders is not None

    def bind(self, comm) -> None:
        """Attaches the job's communicator; the wrapped strategy gets the leaders' (on non-leaders the host's,
        which it never exchanges over: its one-line warnings then come from rank 0 alone)."""
        super().bind(comm)
        self.inner.bind(self.leaders if self.leaders is not None else self.local)

    def begin_step(self) -> None:
        """Starts this step's counters, the wrapped strategy's too (PowerSGD counts its steps there)."""
        super().begin_step()
        self.bytes_between_hosts_last_step = 0
        self.inner.begin_step()

    def count_steps_as(self, step_name: str) -> None:
        """The wrapped strategy counts the same steps."""
        super().count_steps_as(step_name)
        self.inner.count_steps_as(step_name)

    def plan(self, facts: Any, steps: int | None = None, step_name: str = "step") -> None:
        """The wrapped strategy's plan (e.g. PowerSGD's automatic start, in the same steps)."""
        self.inner.plan(facts, steps=steps, step_name=step_name)

    def identity(self) -> dict[str, Any]:
        """The wrapped strategy's identity (its state only fits the same one), marked as between hosts. Flat,
        so a refused resume names the setting as the user gives it (``learner.exchange.num_bits``)."""
        return {**self.inner.identity(), "between_hosts": True}

    def describe(self) -> str:
        """``1-bit between the 2 host leaders`` and so on (off the leaders without the count)."""
        return self._between_leaders(self.inner.describe())

    def describe_plan(self) -> str:
        """:meth:`describe` with the wrapped strategy's plan among the host leaders."""
        return self._between_leaders(self.inner.describe_plan())

    def _between_leaders(self, words: str) -> str:
        count = f" {self.leaders.size}" if self.leaders is not None else ""
        return f"{words} between the{count} host leaders"

    # -- the exchange --------------------------------------------------------------------------------
    def exchange_now(self, key: Hashable, flat: torch.Tensor, shapes: list[torch.Size]) -> torch.Tensor:
        """Exact sum onto the leader, the wrapped strategy between leaders, broadcast in the host; blocking."""
        num_bytes = flat.numel() * flat.element_size()
        in_host = self.local.size > 1
        if in_host:
            self.local.reduce(flat, root=0, op="sum")
        between = 0
        if self.leaders is not None and self.leaders.size > 1:
            before = self.inner.bytes_sent_last_step
            self.inner.start(key, flat, shapes).wait()
            between = self.inner.bytes_sent_last_step - before
        if in_host:
            self.local.broadcast(flat, root=0)
        sent_in_host = (self.local.size - 1) * num_bytes if self.leaders is not None else num_bytes * in_host
        self.bytes_sent_last_step += between + sent_in_host
        self.bytes_between_hosts_last_step += between
        self.full_precision_bytes_last_step += full_precision_allreduce_bytes(flat.numel(), self.comm.size)
        return flat

    # -- state: the wrapped strategy's ----------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The wrapped strategy's state on this rank (its residuals on a leader; nothing used elsewhere)."""
        self.drain()
        return {"name": self.name, "inner": self.inner.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores :meth:`state_dict`'s output, saved on the same host layout."""
        self.inner.load_state_dict(state.get("inner", {}))

    def reset(self) -> None:
        """Forgets the wrapped strategy's state, after any exchange still running."""
        self.drain()
        self.inner.reset()

    def close(self) -> None:
        """Stops this wrapper's thread, then the wrapped strategy's."""
        super().close()
        self.inner.close()


__all__ = ["BetweenHosts"]
