"""The exchange seam: how a learner's tensors are summed over ranks, as a strategy object.

In the spirit of PyTorch DDP's ``register_comm_hook``: the learner owns WHAT is exchanged and
WHEN (gradient buckets overlapped with backward, block momentum's model delta at a sync); an
:class:`Exchange` owns HOW (the transport, any compression, and the state that goes with it:
error-feedback residuals, PowerSGD's P and Q). Every strategy is selectable from the config
(``learner.exchange``) and saves its per-rank state into checkpoints.

Contract, for anyone writing a strategy:

* ``bind(comm)`` is called once by the learner before the first exchange.
* ``start(key, flat, shapes)`` begins replacing ``flat`` (a 1-D tensor holding tensors of
  ``shapes`` back to back) by its SUM over ranks, in place, and returns an
  :class:`~dtrain.comm.AsyncHandle` whose ``wait()`` completes it and returns ``flat``. ``key``
  names the set of tensors (a bucket index, or ``"model"``): a strategy keeps its state per key,
  and the same key always comes with the same shapes. Every rank calls ``start`` for the same
  keys in the same order, and all ranks end with bit-identical results (lossy strategies decode
  the same bytes everywhere).
* ``state_dict()`` / ``load_state_dict()`` hold this rank's state (not replicated);
  ``identity()`` is what a checkpoint must agree with to be restored.
* ``bytes_sent_last_step`` counts the bytes this rank handed to the transport since the last
  ``begin_step()``; ``full_precision_bytes_last_step`` what a float32 all-reduce would have sent.
"""
from __future__ import annotations

import abc
from collections.abc import Hashable, Sequence
from typing import Any

import torch

from dtrain.comm.base import AsyncHandle


def full_precision_allreduce_bytes(numel: int, world_size: int) -> int:
    """Bytes one rank sends in a float32 ring (reduce-scatter + all-gather) all-reduce of ``numel`` values.

    ``2 * (N - 1) / N * 4 * numel``: the yardstick every compression ratio is measured against.
    """
    return round(2 * (world_size - 1) * 4 * numel / world_size)


class Exchange(abc.ABC):
    """A strategy that sums flat tensors over ranks; see the module docstring for the contract."""

    name: str = "exchange"
    """Short name, used in progress lines and checkpoint identities."""

    def __init__(self) -> None:
        self.comm = None
        self.bytes_sent_last_step = 0
        self.full_precision_bytes_last_step = 0

    def bind(self, comm) -> None:
        """Attaches the job's communicator (called once by the learner, before the first exchange)."""
        self.comm = comm

    def begin_step(self) -> None:
        """Starts a new step's byte counters (the learner calls it before the step's first ``start``)."""
        self.bytes_sent_last_step = 0
        self.full_precision_bytes_last_step = 0

    @abc.abstractmethod
    def start(self, key: Hashable, flat: torch.Tensor, shapes: Sequence[torch.Size]) -> AsyncHandle:
        """Begins summing ``flat`` over ranks in place; ``wait()`` on the result completes it."""

    def allreduce_(self, key: Hashable, flat: torch.Tensor, shapes: Sequence[torch.Size]) -> torch.Tensor:
        """``start(...).wait()``: the blocking form."""
        return self.start(key, flat, shapes).wait()

    @property
    def compression_ratio(self) -> float:
        """Float32 all-reduce bytes over bytes actually sent, last step (nan before any)."""
        if not self.bytes_sent_last_step:
            return float("nan")
        return self.full_precision_bytes_last_step / self.bytes_sent_last_step

    def identity(self) -> dict[str, Any]:
        """What a checkpoint must match to restore this strategy's state (its name and settings)."""
        return {"name": self.name}

    def state_dict(self) -> dict[str, Any]:
        """This rank's own state (residuals, warm-start factors), tensors on the CPU; {} when stateless."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores :meth:`state_dict`'s output saved at the same world size."""

    def reset(self) -> None:
        """Forgets this rank's state (a resume at another world size): residuals to zero, factors re-drawn."""


__all__ = ["Exchange", "full_precision_allreduce_bytes"]
