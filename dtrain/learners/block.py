"""The block learner base: local steps on each worker, and every block a sync of the model deltas.

:class:`BlockLearner` holds what block momentum (BMUF), DiLoCo and local SGD share: block
counting (a sync every ``block_size`` global samples, decided alike on every rank without a
collective), the warm start (local training on the full stream before ``distributed_after``,
then rank 0's model for all), the delta exchange (``d_i = W_prev - W_i`` summed over workers by
any :mod:`dtrain.exchange` strategy), the sync points the session agrees on, and the checkpoint
state. How the summed delta ``D`` moves the model of the last sync is the outer optimizer's: a torch
optimizer over ``W_prev`` (:mod:`dtrain.learners.outer`; local SGD's average by default), checkpointed and
moved to the device here, so a new block learner is a config line (``docs/writing-a-learner.md``,
``docs/semantics.md#block-learners``).
"""
from __future__ import annotations

import math
import time
from dataclasses import astuple, replace
from functools import partial
from typing import Any

import torch

from dtrain import checks
from dtrain.advice import Advice
from dtrain.exchange import Exchange, full_precision_allreduce_bytes
from dtrain.learners.flat_copies import broadcast, cpu_copy, pack, unpack
from dtrain.learners.base import AUTO, Learner, RunFacts, auto_warm_start, bind_exchange, exchange_identity
from dtrain.learners.block_size import auto_block_size, largest_block_size
from dtrain.learners.overlap import DelayedOuterStep
from dtrain.learners.outer import (FIRST_MOMENT_KEYS, SYNC_FACTS, LearningRateTrace, OuterOptimizerFactory,
                                   build_outer_optimizer, cpu_state, describe_outer_factory, first_moment,
                                   first_moments, gives_back_model, load_outer_state, outer_optimizer_name,
                                   plain_factory, saved_first_moment)
from dtrain.learners.settings import BLOCK_SIZE, BLOCK_SYNC, MOMENTUM_CORRECTION
from dtrain.rules import check_settings

#: Optimizer state entries the momentum reset zeroes: the first moments of :data:`~dtrain.learners.outer.FIRST_MOMENT_KEYS`
MOMENTUM_STATE_KEYS = FIRST_MOMENT_KEYS


class BlockLearner(Learner):
    """Local steps, and every ``block_size`` global samples a sync: ``D = sum_i (W_prev - W_i)``
    through the exchange strategy, then the outer optimizer's step on ``W_prev`` (:meth:`outer_update`).

    Every minibatch, ``step()`` runs the wrapped optimizer on this worker's gradient of its LOCAL
    mean loss, with the optimizer's learning rate (``local_learning_rate="full"``) or with ``lr *
    n_i / B`` (``"share"``, CNTK's per-sample rate on the worker's ``n_i`` samples of ``B``). When
    a block is complete, every worker takes part in a sync, with ``W_prev`` the model of the last
    sync (flat, ``prev_parameters``) and ``W_i`` worker i's model:

    1. ``d_i = W_prev - W_i``, summed over the workers of ``outer_comm`` by ``exchange`` into
       ``D`` (not divided); the model's floating-point buffers (BatchNorm statistics) are averaged
       exactly, its other buffers taken from rank 0 at :meth:`synchronize`;
    2. :meth:`outer_update` ``(D)`` writes the new model into ``prev_parameters``: the outer optimizer
       (a torch optimizer over ``W_prev``) steps with the gradient ``D / outer_comm.size`` (``D`` itself
       for one that declares ``sums_deltas``); with one model and a step that would give it back
       (:func:`~dtrain.learners.outer.gives_back_model`) the step is skipped;
    3. every worker continues from it (``W_i <- W_prev``); with ``reset_sgd_momentum_after_aggregation``
       the optimizer's momentum buffers are zeroed (``MOMENTUM_STATE_KEYS``); then :meth:`after_sync`.

    A block is complete when the most-loaded worker has trained ``block_size // N`` samples since
    the last sync (counted from the global minibatch sizes every rank is told: ``ceil(B / N)`` per
    minibatch), CNTK's rule, the same on every rank. Warm start: while ``samples_seen <
    distributed_after`` every worker steps on the full data stream without communicating; at the
    switch rank 0's parameters and buffers are broadcast and become ``W_prev``.

    Two communicators: ``comm`` (the job) partitions the data, counts blocks and broadcasts;
    ``outer_comm`` (default: ``comm``) is the one the delta exchange runs over, and
    ``outer_comm.size`` the number of contributions summed into ``D``. A learner whose workers
    exchange exactly inside a host and compressed between hosts passes the hosts' communicator.

    The outer optimizer's state (DiLoCo's velocity, BMUF's ``sg``, Adam's moments) is replicated: it is
    in :meth:`state_dict`, restored bit for bit and moved to the model's device by :meth:`prepare`.
    Subclass contract: set ``kind`` (the checkpoint name) and, for an outer step of its own,
    :meth:`default_outer_optimizer` (or override :meth:`outer_update`); optionally :meth:`after_sync`,
    :meth:`describe_block`.

    Args:
        optimizer: the (inner) torch optimizer of the model's parameters.
        comm: the job's communicator (None: a size-1 ``LocalCommunicator``).
        block_size: global samples per block (at least N); ``"auto"``: :func:`auto_block_size` of
            the run's facts, derived in :meth:`plan`.
        distributed_after: global samples of local-only training before the first block (>= 0);
            ``"auto"``: :func:`~dtrain.learners.base.auto_warm_start` (0 with one worker).
        exchange: the :class:`~dtrain.exchange.Exchange` that sums the deltas (None: float32
            all-reduce); its per-rank state is in :meth:`local_state_dict`.
        local_learning_rate: ``"full"`` or ``"share"`` (``checks.LOCAL_LEARNING_RATES``).
        reset_sgd_momentum_after_aggregation: zero the optimizer's momentum buffers at each sync.
        outer_comm: the communicator of the delta exchange (None: ``comm``).
        momentum_correction: at each sync, before the outer update, scale the outer state by the
            ratio of this block's inner learning rate to the last block's (:meth:`correct_outer_momentum`).
        outer_optimizer: a callable that builds the outer optimizer from ``[W_prev]`` (a torch optimizer
            class, or a ``functools.partial`` of one: ``learner/outer_optimizer=NAME`` in a config); None:
            :meth:`default_outer_optimizer`.
        overlap: the exchange of each block runs while the next block trains, and its outer step is taken at
            that block's end (:mod:`dtrain.learners.overlap`; with several models only).

    Raises:
        ValueError: a value out of range, or ``block_size // N`` is 0.
        TypeError: the optimizer is not a ``torch.optim.Optimizer``, or ``exchange`` not an ``Exchange``.
    """

    kind = "block"
    exchanged = "model changes"

    def __init__(self, optimizer: torch.optim.Optimizer, comm=None, block_size: int | str = AUTO,
                 distributed_after: int | str = AUTO, exchange: Exchange | None = None,
                 local_learning_rate: str = "full", reset_sgd_momentum_after_aggregation: bool = False,
                 outer_comm=None, momentum_correction: bool = False,
                 outer_optimizer: OuterOptimizerFactory | None = None, overlap: bool = False):
        super().__init__(optimizer, comm, distributed_after)
        # the overlapped outer step (dtrain.learners.overlap): block t's exchange runs while block t+1 trains
        self.overlap = checks.boolean("overlap", overlap)
        self._overlap = DelayedOuterStep(self) if self.overlap else None
        if outer_optimizer is not None:  # refused now, in one line, not at the first sync
            outer_optimizer = plain_factory(outer_optimizer)
            build_outer_optimizer(outer_optimizer, torch.zeros(1))
        self.outer_optimizer_factory = outer_optimizer  # None: default_outer_optimizer()
        self.outer_comm = self.comm if outer_comm is None else outer_comm
        # before any restore: a strategy's state loads onto its communicator; an overlapped exchange gets one of its
        # own (a split of outer_comm), so its collectives in flight never interleave with the session's on the job's
        exchange_comm = self.outer_comm
        if self.overlap and self.outer_comm.size > 1 and hasattr(self.outer_comm, "split"):
            exchange_comm = self.outer_comm.split(0, key=self.outer_comm.rank)
        self.exchange = bind_exchange(exchange, exchange_comm, step_name="sync")
        self.block_size_is_auto = block_size == AUTO
        check_settings({**BLOCK_SYNC, **BLOCK_SIZE, **MOMENTUM_CORRECTION}, local_learning_rate=local_learning_rate,
                       block_size=block_size, momentum_correction=momentum_correction,
                       reset_sgd_momentum_after_aggregation=reset_sgd_momentum_after_aggregation)
        self.local_learning_rate = local_learning_rate
        self.momentum_correction = bool(momentum_correction)
        self.reset_sgd_momentum_after_aggregation = bool(reset_sgd_momentum_after_aggregation)
        self.block_size = self.sync_period = 0
        self._restored_block_size: int | None = None  # what "auto" stood for in the run a checkpoint began
        self._replaced_block: tuple[int, int] | None = None  # (block, replicas) of a checkpoint's other world size
        if not self.block_size_is_auto:
            self.set_block_size(int(block_size))

        # -- state (saved in checkpoints)
        self.local_samples_in_block = 0     # n_loc: this worker's samples since the last sync (CNTK's; recorded)
        self.global_samples_in_block = 0    # all workers' samples since the last sync
        self.largest_share_in_block = 0     # the most-loaded worker's samples since the last sync
        self.syncs = 0                      # block syncs done so far
        self.prev_parameters: torch.Tensor | None = None     # W_prev, flat: the model of the last sync
        self.outer_optimizer: torch.optim.Optimizer | None = None  # steps W_prev; built by prepare()
        self._restored_outer: dict[str, Any] | None = None   # a checkpoint's outer state, until prepare()
        self.block_lr = LearningRateTrace()                  # the inner lr over this block's local steps
        self.previous_block_lr: float | None = None          # the last block's (momentum_correction)

        # -- working memory, set by prepare()
        self._model: torch.nn.Module | None = None
        self._float_buffers: list[torch.Tensor] = []
        self._other_buffers: list[torch.Tensor] = []
        self._num_parameter_elements = 0
        self._scratch: torch.Tensor | None = None  # [W or d_i | floating-point buffers]
        self._met = True  # the last step ended with the ranks meeting (see is_sync_point)
        # -- an elastic run (make_elastic): the torchft replica groups this process is one of
        self.elastic = None
        self._source = None  # the training source (attach_source): an elastic run rewinds it
        self._contributors = 0  # an elastic sync's models summed into D
        # -- statistics of the last sync (the session reads them)
        self.exchange_seconds_last_step = 0.0  # seconds in the last step's exchange (0.0: no sync in that step)
        self._bytes_sent_last_sync = 0
        self._full_precision_bytes_last_sync = 0

    def set_block_size(self, block_size: int) -> None:
        """Sets the block size and the per-worker sync period ``block_size // N``.

        Raises ValueError when the sync period is 0."""
        num_workers = self.comm.size
        if block_size // num_workers < 1:
            raise ValueError(f"block_size={block_size}: expected at least {num_workers} samples for {num_workers} "
                             f"workers: the per-worker sync period block_size // N is 0 (CNTK: 'Sync period is "
                             f"too small')")
        self.block_size = block_size
        self.sync_period = block_size // num_workers  # per-worker samples between syncs (CNTK)

    # -- the outer step, and what a subclass may change -----------------------------------------------
    # -- elastic runs ---------------------------------------------------------------------------------
    def has_own_sync(self) -> bool:
        """Whether this learner's class replaces the block learner's sync or outer update (not elastic then)."""
        return type(self)._sync is not BlockLearner._sync or type(self).outer_update is not BlockLearner.outer_update

    def make_elastic(self, groups) -> None:
        """Makes this learner one replica group of an elastic job (:mod:`dtrain.learners.elastic`): its syncs are
        rounds of torchft's quorum, each block's minibatches split among the groups of the last round.

        Raises:
            ValueError: a setting an elastic run cannot honour yet, in one line that says which and why.
        """
        from dtrain.learners.elastic import elastic_problems

        problems = elastic_problems(self)
        if problems:
            raise ValueError(problems[0])
        self.elastic = groups
        groups.learner = self

    def attach_source(self, source) -> None:
        """Told the training source by the session: an elastic run reads a discarded block again from it, and a
        joiner takes its position from a peer."""
        self._source = source

    def data_partition(self) -> tuple[int, int]:
        """The base's, or in an elastic run this group's share of the block: ``(groups of the plan, its index)``."""
        if self.elastic is not None:
            return self.elastic.partition
        return super().data_partition()

    def default_outer_optimizer(self) -> OuterOptimizerFactory:
        """The outer optimizer when none is given: torch's SGD at lr 1, ``W = W_prev - D / N``, the workers'
        mean model (local SGD)."""
        return partial(torch.optim.SGD, lr=1.0)

    def outer_factory(self) -> OuterOptimizerFactory:
        """What builds this learner's outer optimizer: the one given, else :meth:`default_outer_optimizer`."""
        return self.outer_optimizer_factory or self.default_outer_optimizer()

    def outer_update(self, total_delta: torch.Tensor) -> None:
        """Writes the new model into ``prev_parameters`` (which holds ``W_prev``) from ``total_delta``,
        ``D = sum_i (W_prev - W_i)`` over ``outer_comm.size`` workers (it may be overwritten): the outer
        optimizer's step with the gradient ``D / outer_comm.size`` (``D`` where it ``sums_deltas``)."""
        optimizer = self.outer_optimizer
        if not getattr(optimizer, "sums_deltas", False):
            total_delta = total_delta.div_(self.sync_contributors())  # g = mean_i (W_prev - W_i)
        self.prev_parameters.grad = total_delta
        try:
            optimizer.step()
        finally:
            self.prev_parameters.grad = None

    def sync_contributors(self) -> int:
        """The models summed into ``D`` at a sync: ``outer_comm.size``, or an elastic sync's groups."""
        return self._contributors if self.elastic is not None else self.outer_comm.size

    def set_sync_facts(self, samples_in_block: int | None = None) -> None:
        """Tells the outer optimizer a block's facts (:data:`~dtrain.learners.outer.SYNC_FACTS`) where it reads them:
        this block's samples unless ``samples_in_block`` is given (the block an overlapped step belongs to)."""
        samples = self.global_samples_in_block if samples_in_block is None else samples_in_block
        facts = {"workers": self._contributors if self.elastic is not None else self.comm.size,
                 "samples_in_block": samples}
        for group in self.outer_optimizer.param_groups:
            for key in SYNC_FACTS:
                if key in group:
                    group[key] = facts[key]

    def sync_keeps_model(self, total_delta: torch.Tensor) -> bool:
        """Whether the outer step on ``total_delta`` would give back the one model there is (then it is skipped,
        sparing its rounding: ``W_prev <- W``): the outer optimizer says (:func:`~dtrain.learners.outer.gives_back_model`).
        Never with several models, nor where a subclass writes its own :meth:`outer_update`."""
        if self.outer_comm.size != 1 or type(self).outer_update is not BlockLearner.outer_update:
            return False
        return gives_back_model(self.outer_optimizer, total_delta, self.outer_comm.size)

    def after_sync(self) -> None:
        """Called on every rank at the end of each sync; nothing here."""

    def describe_block(self) -> str:
        """The subclass's part of the start-up line (after the block size): the outer optimizer when one was given."""
        return describe_outer_factory(self.outer_optimizer_factory) if self.outer_optimizer_factory else ""

    @property
    def smoothed_gradient(self) -> torch.Tensor | None:
        """The outer optimizer's first moment (BMUF's ``sg``, DiLoCo's velocity, Adam's ``exp_avg``), or None; before
        :meth:`prepare`, a restored checkpoint's."""
        if self.outer_optimizer is not None:
            return first_moment(self.outer_optimizer)
        return None if self._restored_outer is None else saved_first_moment(self._restored_outer)

    # -- the loop -------------------------------------------------------------------------------
    def plan(self, facts: RunFacts) -> None:
        """Derives ``block_size="auto"`` (:func:`auto_block_size`), then plans the exchange, whose
        steps are the syncs (e.g. PowerSGD's start counts syncs)."""
        super().plan(facts)
        if self.block_size_is_auto:
            # a resumed run keeps the block it was planned with (DiLoCo's depends on max_samples)
            restored = self._restored_block_size
            self.set_block_size(restored if restored is not None else self.auto_block_size(facts))
        warmup = self.exchange_steps_until(facts, facts.warmup_samples) if facts.warmup_samples else 0
        self.exchange.plan(replace(facts, warmup_exchange_steps=warmup), steps=self.expected_syncs(facts),
                           step_name="sync")

    def auto_block_size(self, facts: RunFacts) -> int:
        """What ``block_size="auto"`` stands for in a run of ``facts`` (the warm start is known by now):
        :func:`auto_block_size` (CNTK's bound for block momentum, and 50 syncs) here."""
        return auto_block_size(facts, self.model_replicas(), self.distributed_after)

    def expected_syncs(self, facts: RunFacts) -> int | None:
        """The syncs a run of ``facts`` makes after the warm start (None when its length is unknown):
        a sync every ``ceil(sync_period / ceil(B / N))`` global minibatches of ``B``, and one at the end."""
        return self.exchange_steps_until(facts, facts.max_samples)

    def exchange_steps_until(self, facts: RunFacts, samples: int | None) -> int | None:
        """The syncs whose blocks begin before ``samples`` global samples (after the warm start; the one at a run's
        end included); None when unknown."""
        if not samples or not facts.minibatch_size or not self.block_size:
            return None
        minibatches = math.ceil(max(samples - self.distributed_after, 0) / facts.minibatch_size)
        return math.ceil(minibatches / self.minibatches_per_sync(facts.minibatch_size))

    def minibatches_per_sync(self, minibatch_size: int) -> int:
        """Global minibatches of ``minibatch_size`` from one sync to the next: a block is complete at the
        first minibatch end where the most-loaded worker's ``ceil(B / N)`` per minibatch reach ``sync_period``."""
        return math.ceil(self.sync_period / math.ceil(minibatch_size / self.comm.size))

    def auto_distributed_after(self, facts: RunFacts) -> int:
        """``distributed_after="auto"``: :func:`~dtrain.learners.base.auto_warm_start` (0 with one
        worker): local SGD from a warmed-up model (post-local SGD) generalises as well as
        synchronous SGD, started from scratch it measurably does not (``docs/semantics.md#warm-start``)."""
        return auto_warm_start(facts) if self.model_replicas() > 1 else 0

    def model_replicas(self) -> int:
        """How many models train apart between syncs (the ``N`` of the ``"auto"`` rules): one per worker here."""
        return self.comm.size

    def describe(self) -> str:
        """The warm start, the block size and sync period, the subclass's part and the exchange."""
        self._require_block_size()
        auto = ""
        if self.block_size_is_auto:
            auto = (" (auto, as planned when the run began)" if self._restored_block_size is not None
                    else self.describe_auto_block_size())
            if self._replaced_block is not None and self._replaced_block[0] != self.block_size:
                block, replicas = self._replaced_block
                auto += (f" [derived again for {self.model_replicas()} model replicas: the checkpoint's run had "
                         f"{block:,} at {replicas}]")
        own = self.describe_block()
        return (f"{super().describe()}: block of {self.block_size:,} samples{auto} = {self.sync_period:,} per worker "
                f"between syncs{self.describe_minibatch_rounding()}{', ' + own if own else ''}, "
                f"exchange {self.exchange.describe_plan()}{self.describe_overlap()}")

    def describe_overlap(self) -> str:
        """The overlapped outer step, where it runs (start-up line)."""
        if self._overlap is None:
            return ""
        if self.outer_comm.size == 1:
            return " (overlap: nothing to overlap with one model)"
        return ", overlapped: each block's exchange runs while the next block trains, its outer step one block late"

    def describe_minibatch_rounding(self) -> str:
        """Where a block does not end at a minibatch's end: the syncs as they happen (a block is complete
        at the first minibatch end past ``sync_period``, CNTK's rule), so the line says what the run does."""
        minibatch = self.run_facts.minibatch_size
        if not minibatch:
            return ""
        minibatches = self.minibatches_per_sync(minibatch)
        if minibatches * minibatch == self.block_size:  # the block asked for (uneven shares included)
            return ""
        plural = "es" if minibatches > 1 else ""
        return (f" (blocks end at a minibatch's end: a sync every {minibatches:,} minibatch{plural} of {minibatch:,}, "
                f"{minibatches * minibatch:,} samples)")

    def describe_auto_block_size(self) -> str:
        """How ``block_size="auto"`` was derived, for :meth:`describe`."""
        return " (auto)"

    def describe_momentum_correction(self) -> str:
        """Whether the outer state follows the inner learning rate's schedule (start-up line)."""
        return f"momentum correction {'on' if self.momentum_correction else 'off'}"

    # -- statistics of the last sync --------------------------------------------------------------
    @property
    def bytes_sent_last_step(self) -> int:
        """Bytes this rank sent in the last block sync's exchange (0 before any sync, and with one worker)."""
        return self._bytes_sent_last_sync

    @property
    def compression_ratio(self) -> float:
        """A float32 all-reduce's bytes over the bytes actually sent, last sync (nan before any)."""
        if not self._bytes_sent_last_sync:
            return float("nan")
        return self._full_precision_bytes_last_sync / self._bytes_sent_last_sync

    def automatic_settings(self) -> list[str]:
        """The base's, and ``learner.block_size`` where it is ``"auto"``."""
        block = ["learner.block_size"] if self.comm.size > 1 and self.block_size_is_auto else []
        return super().automatic_settings() + block

    def collapse_advice(self) -> Advice:
        """An outer optimizer given in the config first (its lr is a step per sync, not an inner lr), then the base's,
        and on several workers local steps from an untrained model: a longer start on one model (the exchange's
        longer warm start says the same where it asks for one)."""
        advice = super().collapse_advice()
        if self.outer_optimizer_factory is not None:
            advice = Advice((f"the {describe_outer_factory(self.outer_optimizer_factory)}",),
                            ("set learner.outer_optimizer.lr to the scale of a block's model change (an outer Adam "
                             "moves every parameter by about its lr at each sync)",)) + advice
        if self.comm.size > 1:
            change = () if self.exchange.needs_warm_start else \
                ("train longer on one model first (learner.distributed_after=SAMPLES)",)
            advice += Advice(("local steps started from an untrained model",), change)
        return advice

    def progress_note(self) -> str:
        """Bytes this rank sent in the last sync, and with a compressing strategy the saving
        against a float32 all-reduce; empty before the first sync."""
        if self.elastic is not None:
            return f"elastic: {self.elastic.participants} groups, {self.elastic.discards} blocks discarded"
        if not self._bytes_sent_last_sync:
            return ""
        note = f"{self.exchange.name}: {self._bytes_sent_last_sync / 1e3:,.0f} kB sent/sync"
        if self._bytes_sent_last_sync < self._full_precision_bytes_last_sync:
            note += f" ({self.compression_ratio:.1f}x less than 32-bit)"
        return note

    def prepare(self, model: torch.nn.Module) -> None:
        """Broadcasts rank 0's parameters and buffers, then takes them as ``W_prev`` and builds the outer
        optimizer over it (on the model's device).

        After ``load_state_dict`` the restored ``W_prev`` and outer optimizer state are kept instead.

        Raises:
            ValueError: the optimizer has no parameters, or they are not all on one device.
        """
        self._require_block_size()
        parameters = self.synced_tensors
        if not parameters:
            raise ValueError("the optimizer has no parameters; build it from model.parameters()")
        devices = {p.device for p in parameters}
        if len(devices) > 1:
            raise ValueError(f"a block learner keeps one flat copy of the model, but its parameters are on "
                             f"{sorted(map(str, devices))}; put the model on one device")
        self._model = model
        buffers = list(model.buffers())
        self._float_buffers = [b for b in buffers if b.is_floating_point()]
        self._other_buffers = [b for b in buffers if not b.is_floating_point()]
        # one dtype that holds every parameter and float buffer exactly (float32 for usual models)
        dtype = parameters[0].dtype
        for tensor in parameters + self._float_buffers:
            dtype = torch.promote_types(dtype, tensor.dtype)
        device = parameters[0].device
        self._num_parameter_elements = sum(p.numel() for p in parameters)
        self._scratch = torch.empty(self._num_parameter_elements + sum(b.numel() for b in self._float_buffers),
                                    dtype=dtype, device=device)
        if self.comm.size > 1:
            self.broadcast_model()
        restored_prev = self.prev_parameters
        self.prev_parameters = self.flat_parameters().clone()
        if restored_prev is not None:
            self.prev_parameters.copy_(restored_prev)
        factory = self.outer_factory()
        self.outer_optimizer = build_outer_optimizer(factory, self.prev_parameters)
        if self._restored_outer is not None:
            load_outer_state(self.outer_optimizer, self.prev_parameters, self._restored_outer)
            self._restored_outer = None
        if self._overlap is not None:
            self._overlap.start_blocks()  # progress measured from W_prev
        if self.elastic is not None:
            if self._source is None:
                raise RuntimeError("an elastic learner rewinds its training source: call learner.attach_source("
                                   "source) before prepare() (training_session does)")
            self.elastic.model, self.elastic.source = model, self._source
            self.elastic.join()  # healed from a live peer when the job is running

    def apply_update(self) -> None:
        """The local optimizer step, then the block logic (a sync when the block is complete).

        Raises:
            RuntimeError: ``prepare(model)`` was not called first (``training_session`` calls it).
        """
        if self._scratch is None:
            raise RuntimeError("call learner.prepare(model) before training; training_session does it for you")
        blocks_started = self.blocks_started()  # decided before this minibatch was read
        self._met = False
        self.exchange_seconds_last_step = 0.0
        self._local_step()
        if blocks_started:
            self.block_lr.add(float(self.optimizer.param_groups[0]["lr"]))  # the configured lr (share restored)
            self.local_samples_in_block += self.local_samples
            self.global_samples_in_block += self.global_samples
            self.largest_share_in_block += -(-self.global_samples // self.comm.size)
            if self.largest_share_in_block >= self.sync_period:
                self._met = self._sync(in_step=True)
            elif self.elastic is not None and self._reaches_the_end():
                # an elastic run's last partial block syncs inside the step: a discarded one is trained again
                self._met = self._sync(end_of_block=False, in_step=True)
        elif self.blocks_started(after=self.global_samples):  # step() counts this minibatch when we return
            self._start_blocks()
            self._met = True
        else:  # warm start: no collective at all; a meeting point every block_size samples
            self._met = (self.samples_seen + self.global_samples) // self.block_size != self.samples_seen // self.block_size

    def _local_step(self) -> None:
        """The wrapped optimizer's step on this worker's gradient; with ``local_learning_rate="share"``
        each parameter group's lr is ``lr * local_samples / global_samples`` for this step (1 during the
        warm start, where every worker reads the whole minibatch). No step for a worker without samples."""
        if self.local_samples == 0:
            return
        self._step_with_share(self.local_samples / self.global_samples)

    def _step_with_share(self, share: float) -> None:
        """The optimizer step, at ``lr * share`` with ``local_learning_rate="share"`` (else at lr)."""
        if self.local_learning_rate == "full" or share == 1:
            self._step_optimizer()
            return
        groups = self.optimizer.param_groups
        configured = [group["lr"] for group in groups]
        for group, lr in zip(groups, configured):
            group["lr"] = lr * share
        try:
            self._step_optimizer()
        finally:
            for group, lr in zip(groups, configured):
                group["lr"] = lr

    def _reaches_the_end(self) -> bool:
        """Whether this minibatch reaches the run's ``max_samples``."""
        end = self.run_facts.max_samples
        return bool(end) and self.samples_seen + self.global_samples >= end

    def is_sync_point(self) -> bool:
        """Whether the step just made ended a block (a sync, or the broadcast that starts blocks),
        or, during the warm start, crossed a multiple of ``block_size`` samples.

        Between these points a block learner makes no collective, so the session agrees on
        preemption only here: a signal stops the job at most one block of samples later.
        """
        return self._met

    def _require_block_size(self) -> None:
        if self.block_size_is_auto and not self.block_size:
            raise ValueError("block_size='auto' is derived from the run's facts: call learner.plan(RunFacts(...)) "
                             "before prepare() (training_session does), or give block_size in samples")

    def synchronize(self) -> None:
        """Brings every worker to one model: a sync if any samples were trained on since the last.

        Called by the session before cross-validation, before every checkpoint and at the end.
        Floating-point buffers (BatchNorm statistics) are averaged over workers and other buffers
        (``num_batches_tracked``) taken from rank 0. During the warm start (before
        ``distributed_after``) rank 0's parameters and buffers are broadcast instead. A learner
        not yet prepared has nothing to synchronize.
        """
        if self._model is None:
            return
        if self.blocks_started():
            if self._overlap is not None:
                self._overlap.flush()  # the step in flight taken, each worker's progress moved onto it
            if self.global_samples_in_block > 0:
                self._sync(end_of_block=False)  # float buffers are averaged inside it
            if self._overlap is not None:
                self._overlap.after_average()
            if self.comm.size > 1 and self._other_buffers:
                broadcast(self._other_buffers, self.comm)
        elif self.comm.size > 1:
            self.broadcast_model()

    @property
    def synced_tensors(self) -> list[torch.Tensor]:
        """The tensors a sync packs, exchanges and writes back (``W`` flat is their concatenation): the optimizer's
        parameters here; a learner whose ranks hold slices of them (sharded hosts) gives its local slices."""
        return self.parameters

    def broadcast_model(self) -> None:
        """Overwrites every worker's parameters and buffers with rank 0's (at :meth:`prepare`, the start of blocks,
        and a warm start's :meth:`synchronize`)."""
        broadcast(self.synced_tensors + self._float_buffers + self._other_buffers, self.comm)

    # -- the block sync ---------------------------------------------------------------------------
    def blocks_started(self, after: int = 0) -> bool:
        """Whether blocks have started once ``after`` more samples are counted in ``samples_seen``."""
        # not is_distributed(): one worker runs blocks too (CNTK resets momentum at its syncs)
        return self.samples_seen + after >= self.distributed_after

    def _sync(self, end_of_block: bool = True, in_step: bool = False) -> bool:
        """The block sync (steps 1-3 of the class docstring), on every rank at once.

        A sync before the block is complete (``end_of_block=False``: :meth:`synchronize` at the end
        of training, or when training stops early) takes no outer step: the workers' models are
        averaged, ``W = W_prev - D / N``, and the outer state is kept as it is. An outer step there
        would apply a whole block's momentum after a fraction of a block (block momentum's
        ``bm = exp(-n / (TC / N))`` even grows as the block shrinks): measured on the language model,
        block momentum ended 0.041 to 0.085 nats worse that way than with the last block averaged, and
        DiLoCo 0.009 (``docs/semantics.md#the-last-partial-block``).

        In an elastic run the sync is a round of the replica groups (:mod:`dtrain.learners.elastic`); it returns
        whether the block was committed (False: discarded, its samples to be read again). ``in_step``: called from
        :meth:`apply_update`.
        """
        if self.elastic is not None:
            return self.elastic.round(in_step=in_step, end_of_block=end_of_block)
        scratch, parameter_count = self._scratch, self._num_parameter_elements
        model_delta = scratch[:parameter_count]
        self.flat_parameters(out=model_delta)  # W_i for now
        if end_of_block and self._overlap is not None and self.outer_comm.size > 1:
            self._overlap.end_of_block(model_delta)  # last block's outer step now, this block's exchange started
        elif not end_of_block and self.outer_comm.size == 1:
            self.prev_parameters.copy_(model_delta)  # one model: the mean is the model itself
        else:
            torch.sub(self.prev_parameters, model_delta, out=model_delta)  # d_i = W_prev - W_i
            if self.outer_comm.size > 1:
                self._exchange_model_delta()  # D = sum_i d_i; float buffers averaged
            if end_of_block:
                self.set_sync_facts()
            if end_of_block and self.sync_keeps_model(model_delta):
                self.flat_parameters(out=self.prev_parameters)  # W <- W_prev - D = W: the model stays as it is
            else:
                if end_of_block:
                    self.correct_outer_momentum()
                    self.outer_update(model_delta)
                else:  # the workers' mean, the outer state kept
                    self.prev_parameters.sub_(model_delta, alpha=1.0 / self.outer_comm.size)
                unpack(self.prev_parameters, self.synced_tensors)  # W_prev <- W on every worker
        self._finish_sync(end_of_block)
        return True

    def elastic_outer_step(self, contributors: int, end_of_block: bool) -> None:
        """An elastic sync's outer step: the scratch buffer holds the sum over ``contributors`` groups of their
        sample-weighted deltas and float buffers; every group present takes this step alike (a joiner too)."""
        self._contributors = contributors
        scratch, parameter_count = self._scratch, self._num_parameter_elements
        model_delta = scratch[:parameter_count]
        unpack(scratch[parameter_count:].div_(contributors), self._float_buffers)
        if end_of_block:
            self.set_sync_facts()
            self.correct_outer_momentum()
            self.outer_update(model_delta)
        else:  # the groups' mean, the outer state kept
            self.prev_parameters.sub_(model_delta, alpha=1.0 / contributors)
        unpack(self.prev_parameters, self.synced_tensors)
        self._finish_sync(end_of_block)

    def reset_block_counters(self) -> None:
        """No samples in the block yet: at the start of blocks, after a sync, and for an elastic block discarded."""
        self.local_samples_in_block = self.global_samples_in_block = self.largest_share_in_block = 0
        self.block_lr = LearningRateTrace()

    def _finish_sync(self, end_of_block: bool) -> None:
        """The end of every sync: the block's counters, the lr the next momentum correction compares with, the
        momentum reset, :meth:`after_sync`."""
        if end_of_block and self._overlap is None:  # the outer state's lr (the momentum correction's reference)
            self.previous_block_lr = self.block_lr.mean()
        self.reset_block_counters()
        self.syncs += 1
        if self.reset_sgd_momentum_after_aggregation:
            self.reset_local_momentum()
        self.after_sync()

    def correct_outer_momentum(self, block_lr: float | None = None) -> None:
        """Goyal et al. 2017's momentum correction (section 2.2), at the level of blocks: with
        ``momentum_correction``, the outer state is multiplied by ``lr_block / lr_previous_block``.

        The outer state (BMUF's ``sg``, DiLoCo's velocity, an outer Adam's first moment: the outer optimizer's
        :data:`~dtrain.learners.outer.FIRST_MOMENT_KEYS`) is a sum of earlier blocks' model changes,
        each in proportion to the inner learning rate its local steps took. When the schedule lowers
        the rate, uncorrected stale changes keep moving the model at the old rate for about
        ``1 / (1 - momentum)`` syncs, just when the schedule asks for small steps
        (``docs/semantics.md#momentum-correction``). A constant rate gives a factor of exactly 1.
        """
        block_lr = self.block_lr.mean() if block_lr is None else block_lr  # an overlapped step: its block's
        previous = self.previous_block_lr
        if not self.momentum_correction or not block_lr or not previous or block_lr == previous:
            return
        for moment in first_moments(self.outer_optimizer.state.values()):
            moment.mul_(block_lr / previous)

    def _exchange_model_delta(self) -> None:
        """Sums the deltas ``d_i`` (the first part of the scratch buffer) over ``outer_comm`` through
        the exchange strategy and averages the floating-point buffers exactly; records the bytes sent
        and the seconds taken (``exchange_seconds_last_step``)."""
        started = time.perf_counter()
        comm, scratch = self.outer_comm, self._scratch
        parameter_count = self._num_parameter_elements
        buffers = scratch[parameter_count:]
        self.exchange.begin_step()
        extra_bytes = 0
        if self.exchange.lossless:
            # the buffers ride along: one all-reduce per sync, as before strategies existed
            pack(self._float_buffers, buffers)
            self.exchange.allreduce_("model", scratch, [torch.Size([parameter_count]), torch.Size([buffers.numel()])])
            unpack(buffers.div_(comm.size), self._float_buffers)
        else:
            # a lossy strategy compresses only the parameter deltas; BatchNorm statistics stay exact
            self.exchange.allreduce_("model", scratch[:parameter_count], [p.shape for p in self.synced_tensors])
            self.average_float_buffers(comm)
            if buffers.numel():
                extra_bytes = full_precision_allreduce_bytes(buffers.numel(), comm.size) * buffers.element_size() // 4
        self.count_exchanged_bytes(extra_bytes)
        self.exchange_seconds_last_step = time.perf_counter() - started

    def count_exchanged_bytes(self, extra_bytes: int) -> None:
        """Records the last sync's bytes: the exchange's, plus ``extra_bytes`` sent beside it (exact buffers)."""
        self._bytes_sent_last_sync = self.exchange.bytes_sent_last_step + extra_bytes
        self.bytes_sent_total += self._bytes_sent_last_sync
        self._full_precision_bytes_last_sync = self.exchange.full_precision_bytes_last_step + extra_bytes

    def average_float_buffers(self, comm=None) -> None:
        """Averages the floating-point buffers (BatchNorm statistics) exactly over ``comm``'s ranks (None: the job's)."""
        if not self._float_buffers:
            return
        comm = self.comm if comm is None else comm
        buffers = self._scratch[self._num_parameter_elements:]
        pack(self._float_buffers, buffers)
        comm.allreduce(buffers, op="sum")
        unpack(buffers.div_(comm.size), self._float_buffers)

    def load_flat(self, flat: torch.Tensor) -> None:
        """Copies the flat ``flat`` into the parameters (casting to their dtypes)."""
        unpack(flat, self.synced_tensors)

    def _start_blocks(self) -> None:
        """End of the warm start: every worker continues from rank 0's model, which becomes W_prev."""
        if self.comm.size > 1:
            self.broadcast_model()
        self.flat_parameters(out=self.prev_parameters)
        self.reset_block_counters()
        if self._overlap is not None:
            self._overlap.start_blocks()

    def reset_local_momentum(self) -> None:
        """Zeroes the optimizer's first-moment buffers in place (CNTK's ResetSmoothedGradients)."""
        for moment in first_moments(self.optimizer.state.values()):
            moment.zero_()

    def flat_parameters(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """The parameters as one flat tensor (into ``out`` when given, casting to its dtype)."""
        if out is None:
            out = torch.empty(self._num_parameter_elements, dtype=self._scratch.dtype, device=self._scratch.device)
        pack(self.synced_tensors, out)
        return out

    def finalize(self) -> None:
        """Stops the exchange's thread, if it has one; an elastic group leaves the job."""
        self.exchange.close()
        if self.elastic is not None:
            self.elastic.close()

    # -- checkpoints ----------------------------------------------------------------------------
    def checkpoint_identity(self) -> dict[str, Any]:
        """The kind, the exchange strategy when it is not the default fp32 all-reduce (a checkpoint's
        residuals restore only into the same strategy and settings) and the outer optimizer's type when one
        was given (its state fits only its own kind)."""
        identity = exchange_identity(super().checkpoint_identity(), self.exchange)
        if self.outer_optimizer_factory is not None:
            identity["outer_optimizer"] = outer_optimizer_name(self.outer_optimizer_factory)
        return identity

    def local_state_dict(self) -> dict[str, Any]:
        """This rank's own state: its optimizer's (the local steps make every rank's momentum and
        Adam moments different, and :meth:`state_dict` holds only rank 0's) and the exchange
        strategy's (e.g. the quantized strategy's error-feedback residuals)."""
        return {"optimizer": self.optimizer.state_dict(), "exchange": self.exchange.state_dict()}

    def load_local_state_dict(self, state: dict[str, Any]) -> None:
        """Restores :meth:`local_state_dict`'s output. The session calls it only at the same world
        size; at another, every rank continues with rank 0's optimizer state (from
        :meth:`state_dict`) and a fresh exchange state, and the session says so.

        The optimizer's hyper-parameters (learning rate, momentum, ...) stay as they are now: the
        configured ones, which the session has put back after :meth:`load_state_dict`.
        """
        if "optimizer" in state:
            configured = [{key: value for key, value in group.items() if key != "params"}
                          for group in self.optimizer.param_groups]
            self.optimizer.load_state_dict(state["optimizer"])
            for group, settings in zip(self.optimizer.param_groups, configured):
                group.update(settings)
        if "exchange" in state:
            self.exchange.load_state_dict(state["exchange"])

    def state_dict(self) -> dict[str, Any]:
        """Base state plus ``W_prev``, the outer optimizer's state (CPU copies) and the block counters.

        The session calls ``synchronize()`` first, so the counters are 0 and ``W_prev`` is the
        model in the same checkpoint; the outer state is what carries e.g. block momentum across a resume.
        """
        if self._overlap is not None and self._overlap.pending is not None:
            raise RuntimeError("an overlapped outer step is in flight: call synchronize() before state_dict() "
                               "(training_session does)")
        state = super().state_dict()
        prev_parameters, outer_state = self.block_tensors()
        state["block"] = {
            "prev_parameters": prev_parameters,
            "outer_optimizer": outer_state,
            "outer_optimizer_type": outer_optimizer_name(self.outer_factory()),
            "local_samples_in_block": self.local_samples_in_block,
            "global_samples_in_block": self.global_samples_in_block,
            "largest_share_in_block": self.largest_share_in_block,
            "syncs": self.syncs,
            "block_lr": astuple(self.block_lr),  # (sum, steps, low, high) of the inner lr in this block
            "previous_block_lr": self.previous_block_lr,
            "block_size": self.block_size,  # what "auto" stood for, kept by a resume at the same replicas
            "replicas": self.model_replicas(),
        }
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores what ``state_dict`` returned (applied to the model's device by ``prepare``).

        Raises:
            ValueError: the checkpoint was written by another learner, or its block state does not
                fit this model's parameters.
        """
        block = state.get("block") if state.get("kind") == self.kind else None
        expected = sum(p.numel() for p in self.synced_tensors)
        for key in ("prev_parameters", "smoothed_gradient"):  # before the optimizer's less clear complaint
            tensor = None if block is None else block.get(key)
            if tensor is not None and tensor.numel() != expected:
                raise ValueError(f"checkpoint block state {key!r} has {tensor.numel()} values but the model has "
                                 f"{expected} parameters; restore into the model the checkpoint was made with")
        mine = outer_optimizer_name(self.outer_factory())
        saved_type = None if block is None else block.get("outer_optimizer_type")
        if saved_type is not None and saved_type != mine:
            raise ValueError(f"the checkpoint's outer optimizer is {saved_type}, this run's is {mine}: its state "
                             f"fits only its own kind; use the same learner.outer_optimizer or a new run directory")
        super().load_state_dict(state)  # refuses another learner's checkpoint
        block = state["block"]
        if block.get("sharded") and not self.shards_model:
            raise ValueError(f"the checkpoint's block state is sharded over each host's ranks (learner.shard=true); "
                             f"this run's {self.kind} learner does not shard: set learner.shard=true on several ranks "
                             f"per host, or use a new run directory")
        self.local_samples_in_block = int(block["local_samples_in_block"])
        self.global_samples_in_block = int(block["global_samples_in_block"])
        self.largest_share_in_block = int(block["largest_share_in_block"])
        self.syncs = int(block["syncs"])
        # checkpoints before the momentum correction: no rate recorded, so the first sync leaves the state
        self.block_lr = LearningRateTrace(*block.get("block_lr", ()))
        self.previous_block_lr = block.get("previous_block_lr")
        if self.block_size_is_auto and block.get("block_size"):
            if block.get("replicas") == self.model_replicas():
                self._restored_block_size = int(block["block_size"])  # plan() keeps it, whatever max_samples is now
            else:
                self._replaced_block = (int(block["block_size"]), int(block["replicas"]))
        if block["prev_parameters"] is None:
            return
        # a checkpoint from before outer optimizers: their one flat outer tensor (None where the learner kept none)
        outer = block["outer_optimizer"] if "outer_optimizer" in block else \
            {"legacy_first_moment": block.get("smoothed_gradient")}
        if self._scratch is None:  # prepare() will move them to the model's device
            self.prev_parameters = block["prev_parameters"].clone()
            self._restored_outer = outer
        else:
            self.prev_parameters.copy_(block["prev_parameters"])
            load_outer_state(self.outer_optimizer, self.prev_parameters, outer)

    def block_tensors(self) -> tuple[torch.Tensor | None, dict[str, Any] | None]:
        """``W_prev`` and the outer optimizer's state as the replicated checkpoint holds them: CPU copies."""
        return cpu_copy(self.prev_parameters), self._outer_state()

    def _outer_state(self) -> dict[str, Any] | None:
        """The outer optimizer's ``state_dict`` as CPU copies (a restored one not yet loaded as it came)."""
        return self._restored_outer if self.outer_optimizer is None else cpu_state(self.outer_optimizer)


__all__ = ["MOMENTUM_STATE_KEYS", "BlockLearner", "auto_block_size", "broadcast", "largest_block_size", "pack",
           "unpack"]
