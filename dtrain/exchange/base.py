"""The exchange seam: how a learner's tensors are summed over ranks, as a strategy object.

In the spirit of PyTorch DDP's ``register_comm_hook``: the learner owns WHAT is exchanged and
WHEN (gradient buckets overlapped with backward, block momentum's model delta at a sync); an
:class:`Exchange` owns HOW (the transport, any compression, and the state that goes with it:
error-feedback residuals, PowerSGD's P and Q). Every strategy is selectable from the config
(``learner.exchange``) and saves its per-rank state into checkpoints.

Contract, for anyone writing a strategy:

* ``bind(comm)`` is called once by the learner before the first exchange, then ``count_steps_as(step_name)``
  (what one exchange step is: ``"step"``, a minibatch; ``"sync"``, a block learner's sync), both when the
  learner is built, so defaults that follow from them hold however the learner is driven; and
  ``plan(facts, steps, step_name)`` once before training (``training_session`` calls the learner's
  ``plan``): the run's exchange steps (``begin_step`` calls) when known.
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
  Read them after every handle of the step has been waited (a strategy that runs on a
  background thread counts there).
* ``lossless`` says whether the result is the exact float32 sum (then anything, e.g. the
  data-parallel learner's "has a gradient" flags, may travel in ``flat``); a lossy strategy is
  handed gradient values only.
* ``loss_scaled`` is set by the learner when the gradients come from an fp16 loss-scaled
  backward, where an inf or NaN is expected now and then: a stateful strategy must then not let
  it into its state (the step is skipped on every rank, see :class:`ThreadedExchange`).
* ``close()`` releases any thread the strategy started (the learner's ``finalize`` calls it).
"""
from __future__ import annotations

import abc
import math
import warnings
from collections.abc import Hashable, Sequence
from typing import Any

import torch

from dtrain.advice import LONGER_WARM_START, Advice
from dtrain.comm.base import AsyncHandle


def full_precision_allreduce_bytes(numel: int, world_size: int) -> int:
    """Bytes one rank sends in a float32 ring (reduce-scatter + all-gather) all-reduce of ``numel`` values.

    ``2 * (N - 1) / N * 4 * numel``: the yardstick every compression ratio is measured against.
    """
    return round(2 * (world_size - 1) * 4 * numel / world_size)


class ByteCounters:
    """The bytes one exchange step sent against what a float32 all-reduce would have: every strategy
    (and :class:`~dtrain.exchange.quantized.QuantizedExchange`) counts with these."""

    def __init__(self) -> None:
        self.bytes_sent_last_step = 0             # bytes this rank handed to the transport this step
        self.full_precision_bytes_last_step = 0   # what a float32 ring all-reduce of the same values sends

    @property
    def compression_ratio(self) -> float:
        """Float32 all-reduce bytes over bytes actually sent, last step (nan before any)."""
        if not self.bytes_sent_last_step:
            return float("nan")
        return self.full_precision_bytes_last_step / self.bytes_sent_last_step


class Exchange(ByteCounters, abc.ABC):
    """A strategy that sums flat tensors over ranks; see the module docstring for the contract."""

    name: str = "exchange"
    """Short name, used in progress lines and checkpoint identities."""

    lossless: bool = True
    """Whether the result is the exact float32 sum (lossy strategies get gradient values only)."""

    stateful: bool = False
    """Whether the strategy keeps per-rank state between steps (saved by :meth:`state_dict`)."""

    needs_warm_start: bool = False
    """Whether the learner should start with a full-precision warm start (``distributed_after="auto"``)."""

    step_name: str = "step"
    """What one exchange step (``begin_step`` call) is: ``"step"``, a minibatch, or ``"sync"``, a block learner's sync."""

    holds_adam_variance: bool = False
    """Whether ``freeze_variance="auto"`` holds an Adam-family optimizer's variance under this strategy: where
    every value of the sums carries its column's 1-bit magnitude (``dtrain.learners.frozen_variance``)."""

    def __init__(self) -> None:
        super().__init__()
        self.comm = None
        self.loss_scaled = False  # set by the learner: inf/NaN may come from an fp16 loss-scaled backward

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

    def identity(self) -> dict[str, Any]:
        """What a checkpoint must match to restore this strategy's state (its name and settings)."""
        return {"name": self.name}

    def describe(self) -> str:
        """A few words for progress lines and the start-up summary (e.g. ``powersgd rank 1``)."""
        return self.name

    def describe_plan(self) -> str:
        """The start-up summary's words: :meth:`describe` and, where a strategy has one, how it runs on this job."""
        return self.describe()

    def collapse_advice(self, sent: str) -> Advice:
        """What this strategy may have done to a run that diverged or collapsed, where several ranks sum ``sent``
        (``"gradients"``, ``"model changes"``) through it: nothing when lossless; else its compression, and a
        longer warm start where it needs one (``needs_warm_start``) or the float32 exchange where it does not."""
        if self.lossless:
            return Advice()
        if self.needs_warm_start:
            return Advice((f"{sent} compressed by {self.describe()} started too early",), (LONGER_WARM_START,))
        return Advice((f"{sent} compressed by {self.describe()}",),
                      ("exchange them in float32 (learner/exchange=allreduce)",))

    def count_steps_as(self, step_name: str) -> None:
        """Told by the learner when it is built what one exchange step is (``"step"`` or ``"sync"``): a strategy
        whose defaults depend on it (PowerSGD's error feedback and start) derives them here, so that a learner
        driven by hand through ``step()`` gets the same defaults as one ``training_session`` plans."""
        self.step_name = step_name

    def plan(self, facts: Any, steps: int | None = None, step_name: str = "step") -> None:
        """Told the run's facts (a :class:`dtrain.learners.base.RunFacts`) by the learner's ``plan``,
        before training, to derive ``"auto"`` settings: ``steps`` is how many exchange steps
        (``begin_step`` calls) the run will make, when known, and ``step_name`` what one step is
        (``"step"``: a minibatch of the data-parallel learner; ``"sync"``: a block learner's sync), and
        ``facts.warmup_exchange_steps`` how many of them come before the learning rate's warm-up ends.
        Nothing to derive here."""

    def close(self) -> None:
        """Releases threads or buffers the strategy holds (a later ``start`` may create them again)."""

    def state_dict(self) -> dict[str, Any]:
        """This rank's own state (residuals, warm-start factors), tensors on the CPU; {} when stateless."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores :meth:`state_dict`'s output saved at the same world size."""

    def reset(self) -> None:
        """Forgets this rank's state (a resume at another world size): residuals to zero, factors re-drawn."""


class ThreadedExchange(Exchange):
    """A strategy whose exchange is several dependent collectives plus compute, run on one
    background thread (:class:`~dtrain.exchange._worker.ExchangeWorker`) so it overlaps backward.

    Subclasses implement :meth:`exchange_now` (the blocking exchange, run on the worker thread
    in launch order). With ``loss_scaled`` set, the worker first agrees with every rank whether
    any rank's input holds an inf or NaN (one tiny all-reduce); if so the result is inf on every
    rank (the learner then skips the step everywhere) and the strategy's state is not touched.
    Inf, not NaN: a lossless strategy's input carries the "has a gradient" flags (``> 0``), which
    must still say "present", so that the learner sees the inf and skips the step.
    """

    lossless = False
    stateful = True

    def __init__(self) -> None:
        super().__init__()
        from dtrain.exchange._worker import ExchangeWorker  # here: the base module stays import-light

        self._worker = ExchangeWorker()

    def start(self, key: Hashable, flat: torch.Tensor, shapes: Sequence[torch.Size]) -> AsyncHandle:
        """Queues the exchange of ``flat`` on the worker thread; ``wait()`` returns ``flat`` summed."""
        shapes = [torch.Size(shape) for shape in shapes]
        return self._worker.submit(lambda: self._guarded(key, flat, shapes))

    def _guarded(self, key: Hashable, flat: torch.Tensor, shapes: list[torch.Size]) -> torch.Tensor:
        if self.loss_scaled:
            bad = torch.tensor([0.0 if bool(torch.isfinite(flat).all()) else 1.0], device=flat.device)
            if self.comm.allreduce(bad, op="max").item():
                return flat.fill_(float("inf"))
        return self.exchange_now(key, flat, shapes)

    @abc.abstractmethod
    def exchange_now(self, key: Hashable, flat: torch.Tensor, shapes: list[torch.Size]) -> torch.Tensor:
        """Replaces ``flat`` by its (approximate) sum over ranks, blocking; returns ``flat``."""

    def drain(self) -> None:
        """Blocks until every exchange started so far has finished (call before touching the state)."""
        self._worker.drain()

    def close(self) -> None:
        """Waits for queued exchanges and stops the worker thread."""
        self._worker.close()


def warn_residuals_dropped(strategy: Exchange, setting: str) -> None:
    """One line (rank 0) at a resume: the checkpoint holds error-feedback residuals, but error feedback
    is now off (``setting=false``), so they are dropped and the run goes on without them."""
    if strategy.comm is None or strategy.comm.is_main:
        warnings.warn(f"{setting}=false: the error-feedback residuals of the {strategy.describe()} exchange saved in "
                      f"the checkpoint are dropped (error feedback is off now); set {setting}=true to use them",
                      RuntimeWarning, stacklevel=3)


def split_views(flat: torch.Tensor, shapes: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """Views of ``flat`` holding tensors of ``shapes`` back to back (a bucket's layout)."""
    sizes = [math.prod(shape) for shape in shapes]
    return [part.view(tuple(shape)) for part, shape in zip(flat[:sum(sizes)].split(sizes), shapes)]


__all__ = ["ByteCounters", "Exchange", "ThreadedExchange", "full_precision_allreduce_bytes", "split_views", "warn_residuals_dropped"]
