"""Block momentum (BMUF): local steps on each worker, and every block a filtered model sync.

``block_momentum_distributed_learner`` is CNTK's factory of the same name and follows CNTK's
update literally (``docs/semantics.md#block-momentum``, with CNTK's sums of model deltas): each worker
trains its own copy of the model with the wrapped optimizer (the factory's local steps take the
worker's share of the global minibatch's learning rate: CNTK's per-sample rate on its local
samples); when a block of samples has been trained on, the workers' model deltas are SUMMED,
filtered by the block momentum and applied to the model of the last sync, so every worker
continues from one model.
"""
from __future__ import annotations

import math
import time
import warnings
from collections.abc import Sequence
from typing import Any

import torch

from dtrain import checks
from dtrain.exchange import AllReduce, Exchange, full_precision_allreduce_bytes
from dtrain.learners._buckets import coalesced
from dtrain.learners.base import AUTO, Learner, RunFacts, auto_warm_start
from dtrain.schedules import momentum_from_time_constant

#: Optimizer state entries the momentum reset zeroes: the first-moment (momentum) buffers of
#: torch's optimizers (SGD/RMSprop ``momentum_buffer``; Adam, AdamW, NAdam, RAdam, Adamax
#: ``exp_avg``). Second moments (``exp_avg_sq``, ``square_avg``, ...) and step counts are kept:
#: they scale the steps, and zeroing them while bias correction is already ~1 would make the next
#: steps several times larger than the learning rate asks for.
MOMENTUM_STATE_KEYS = ("momentum_buffer", "exp_avg")

#: the one misspelt keyword CNTK's Python API has, accepted for ported scripts
_NESTEROV_ALIAS = "use_nestrov_momentum"


def largest_block_size(samples_per_sweep: int, num_workers: int) -> float:
    """CNTK's bound on the block size, in global samples: the largest ``B`` with default time
    constant ``TC = -B / ln(1 - 1/N)`` that keeps ``samples_per_sweep >= TC * N``.

    CNTK's "Multiple GPUs and machines" article (block momentum section) asks that the unique
    training samples be at least the block momentum time constant times the number of workers;
    above it BMUF trains measurably worse (``docs/semantics.md#block-momentum``). Infinite for one
    worker.
    """
    if num_workers == 1:
        return math.inf
    return samples_per_sweep * -math.log(1.0 - 1.0 / num_workers) / num_workers


def auto_block_size(facts: RunFacts, num_workers: int) -> int:
    """``block_size="auto"``: the largest whole number of global minibatches within
    :func:`largest_block_size` (at least one minibatch, and at least ``num_workers`` samples).

    With the data set's size unknown: 32 global minibatches.
    """
    minibatch = facts.minibatch_size or num_workers
    if facts.samples_per_sweep is None:
        return max(32 * minibatch, num_workers)
    bound = largest_block_size(facts.samples_per_sweep, num_workers)
    if math.isinf(bound):
        return max(facts.samples_per_sweep, num_workers)
    return max(int(bound // minibatch) * minibatch, minibatch, num_workers)


def default_time_constant(block_size: int, num_workers: int) -> float:
    """CNTK's default block momentum time constant ``-block_size / ln(1 - 1/N)``, in samples.

    It makes the block momentum ``1 - 1/N`` at a sync of nominal size. One worker gives 0
    (block momentum 0: a sync leaves the model unchanged).
    """
    if num_workers == 1:
        return 0.0
    return -block_size / math.log(1.0 - 1.0 / num_workers)


class BlockMomentumLearner(Learner):
    """Blockwise model-update filtering (CNTK's block momentum distributed learner).

    Every minibatch, ``step()`` first runs the wrapped optimizer on this worker's gradient of its
    LOCAL mean loss, with the optimizer's learning rate ``lr`` (``local_learning_rate="full"``: each
    worker trains as if alone), or with ``lr * n_i / B`` (``"share"``, CNTK's: its per-sample rate
    ``lr / B`` on the worker's ``n_i`` samples of the global minibatch of ``B``), so that the N local
    steps of one minibatch sum to the data-parallel step. When a block is complete, every worker
    takes part in a sync. With ``W_prev`` the model of
    the last sync, ``W_i`` worker i's model, ``sg`` the block-level smoothed gradient:

    1. ``d_i = W_prev - W_i``, and ``D = sum_i d_i`` (all-reduce SUM, not divided by N);
    2. ``sg <- bm * sg + (1 - bm) * block_learning_rate * D``;
    3. ``W <- W_prev - sg``, then with Nesterov ``W <- W - bm * sg``;
    4. ``W_prev <- W`` on every worker; with ``reset_sgd_momentum_after_aggregation`` the
       optimizer's momentum buffers are zeroed (see ``MOMENTUM_STATE_KEYS``).

    The deltas ``d_i`` travel as ONE flat buffer through the ``exchange`` strategy (one exchange
    per sync, key ``"model"``). With a lossless strategy (the default fp32 :class:`~dtrain.exchange.AllReduce`) the
    floating-point buffers of the model (BatchNorm running statistics) ride in the same buffer,
    one all-reduce as always; with a lossy strategy (e.g. :class:`~dtrain.exchange.Quantized`,
    k-bit with error feedback) only the parameter deltas are compressed and the buffers take a
    separate exact all-reduce. Either way the buffers are averaged.

    When a block is complete (the decision must be the same on every rank, and costs no extra
    communication): each rank counts, from the global minibatch sizes it is told, the samples of
    the most-loaded worker since the last sync, ``ceil(B / N)`` per global minibatch of ``B``
    samples. The session's partitioning gives every worker ``floor`` or ``ceil`` of ``B / N``
    (the last rank always ``ceil``), so this count is the largest local count ``n_loc`` of any
    worker, and a sync happens exactly when the first worker's ``n_loc`` reaches the per-worker
    sync period ``block_size // N``: CNTK's rule, where one worker asking to aggregate makes all
    aggregate. With even shares that is every ``N * (block_size // N)`` global samples.

    Block momentum: ``bm = exp(-n / (TC / N))`` (CNTK's per-worker time constant), with ``n``
    the workers' MEAN local count since the last sync (global samples since the sync / N). With
    even shares this is every worker's own ``n_loc``, as in CNTK; with uneven shares CNTK's
    per-worker ``n_loc`` would give each worker a different ``bm`` and so different models after
    the sync, which the mean avoids. The default ``TC = -block_size / ln(1 - 1/N)`` gives
    ``bm = 1 - 1/N``; with one worker ``TC = 0`` and ``bm = 0``, so (with ``block_learning_rate``
    1) a sync leaves the model as it is: the update is then skipped, which also spares its
    rounding, and only the momentum reset remains.

    Warm start: while ``samples_seen < distributed_after`` (global samples) every worker steps
    on the full data stream with no communication; at the switch, rank 0's parameters and
    buffers are broadcast and become ``W_prev``.

    Args:
        optimizer: the torch optimizer of the model's parameters.
        comm: the job's communicator (None: a size-1 ``LocalCommunicator``).
        block_size: global samples per block (> 0, at least N): CNTK's ``block_size``; ``"auto"``
            (the default) = :func:`auto_block_size` of the run's facts, derived in :meth:`plan`.
        block_momentum_as_time_constant: the block momentum's time constant in samples (>= 0; 0 is
            block momentum 0, as in CNTK), or None for CNTK's default ``-block_size / ln(1 - 1/N)``.
        use_nesterov_momentum: apply the Nesterov look-ahead ``W <- W - bm * sg`` at each sync.
        reset_sgd_momentum_after_aggregation: zero the optimizer's momentum buffers at each sync.
        block_learning_rate: scale of the block update (> 0); 1 is CNTK's default.
        distributed_after: global samples of local-only training on the full stream before the
            first block starts (>= 0); ``"auto"`` (the default): a warm start relative to the run,
            :meth:`auto_distributed_after`.
        exchange: the :class:`~dtrain.exchange.Exchange` strategy that sums the model deltas over
            workers (``learner.exchange`` in the config); None: fp32 :class:`~dtrain.exchange.AllReduce`.
            Its per-rank state (error-feedback residuals) is in :meth:`local_state_dict`.
        local_learning_rate: ``"full"`` (the default): a local step's learning rate is the
            optimizer's own; ``"share"`` (CNTK's, the default of ``block_momentum_distributed_learner``):
            the optimizer's times ``local_samples / global_samples`` (``checks.LOCAL_LEARNING_RATES``;
            ``docs/semantics.md#block-momentum``).

    Raises:
        ValueError: a value is out of range or of the wrong kind (a flag that is not a bool), or
            ``block_size // N`` is 0 (sync period too small).
        TypeError: the optimizer is not a ``torch.optim.Optimizer``, or ``exchange`` is not an
            ``Exchange``.
    """

    kind = "block_momentum"

    def __init__(self, optimizer: torch.optim.Optimizer, comm, block_size: int | str = AUTO,
                 block_momentum_as_time_constant: float | None = None, use_nesterov_momentum: bool = True,
                 reset_sgd_momentum_after_aggregation: bool = True, block_learning_rate: float = 1.0,
                 distributed_after: int | str = AUTO, exchange: Exchange | None = None,
                 local_learning_rate: str = "full"):
        super().__init__(optimizer, comm, distributed_after)
        if exchange is None:
            exchange = AllReduce()
        if not isinstance(exchange, Exchange):
            raise TypeError(f"exchange must be a dtrain.exchange.Exchange strategy (e.g. dtrain.exchange.Quantized), "
                            f"got {type(exchange).__name__}")
        self.exchange = exchange
        self.exchange.bind(self.comm)  # before any restore: a strategy's state loads onto its communicator
        self.block_size_is_auto = block_size == AUTO
        checks.positive_number("block_momentum_as_time_constant", block_momentum_as_time_constant, allow_none=True,
                               allow_zero=True, unit="samples")  # null: CNTK's default; 0: block momentum 0
        checks.positive_number("block_learning_rate", block_learning_rate)
        checks.boolean("use_nesterov_momentum", use_nesterov_momentum)
        checks.boolean("reset_sgd_momentum_after_aggregation", reset_sgd_momentum_after_aggregation)

        # -- hyper-parameters
        self._time_constant_setting = block_momentum_as_time_constant
        self.block_size = self.sync_period = 0
        self.time_constant = 0.0
        if not self.block_size_is_auto:
            self._set_block_size(checks.sample_count("block_size", block_size))
        self.use_nesterov_momentum = use_nesterov_momentum
        self.reset_sgd_momentum_after_aggregation = reset_sgd_momentum_after_aggregation
        self.block_learning_rate = float(block_learning_rate)
        self.local_learning_rate = checks.choice("local_learning_rate", local_learning_rate,
                                                 checks.LOCAL_LEARNING_RATES)

        # -- state (saved in checkpoints)
        self.local_samples_in_block = 0     # n_loc: this worker's samples since the last sync (CNTK's; recorded)
        self.global_samples_in_block = 0    # all workers' samples since the last sync
        self.largest_share_in_block = 0     # the most-loaded worker's samples since the last sync
        self.syncs = 0                      # block syncs done so far
        self.prev_parameters: torch.Tensor | None = None     # W_prev, flat: the model of the last sync
        self.smoothed_gradient: torch.Tensor | None = None   # sg, flat

        # -- working memory, set by prepare()
        self._model: torch.nn.Module | None = None
        self._float_buffers: list[torch.Tensor] = []
        self._other_buffers: list[torch.Tensor] = []
        self._num_parameter_elements = 0
        self._scratch: torch.Tensor | None = None  # [W or d_i | floating-point buffers]
        self._met = True  # the last step ended with the ranks meeting (see is_sync_point)
        # -- statistics of the last sync (the session reads them)
        self.exchange_seconds_last_step = 0.0  # seconds in the last step's exchange (0.0: no sync in that step)
        self._bytes_sent_last_sync = 0
        self._full_precision_bytes_last_sync = 0

    def _set_block_size(self, block_size: int) -> None:
        """Sets the block size, the per-worker sync period and (unless given) the time constant."""
        num_workers = self.comm.size
        if block_size // num_workers < 1:
            raise ValueError(f"block_size={block_size}: expected at least {num_workers} samples for {num_workers} "
                             f"workers: the per-worker sync period block_size // N is 0 (CNTK: 'Sync period is "
                             f"too small')")
        self.block_size = block_size
        self.sync_period = block_size // num_workers  # per-worker samples between syncs (CNTK)
        self.time_constant = (float(self._time_constant_setting) if self._time_constant_setting is not None
                              else default_time_constant(block_size, num_workers))

    # -- the loop -------------------------------------------------------------------------------
    def plan(self, facts: RunFacts) -> None:
        """Derives ``block_size="auto"`` (:func:`auto_block_size`); warns (rank 0, one line) when a
        block size given explicitly breaks CNTK's bound :func:`largest_block_size`. Then plans the
        exchange, whose steps are the syncs (e.g. PowerSGD's start counts syncs)."""
        super().plan(facts)
        if self.block_size_is_auto:
            self._set_block_size(auto_block_size(facts, self.comm.size))
        else:
            self._check_block_size_bound(facts)
        self.exchange.plan(facts, steps=self.expected_syncs(facts), step_name="sync")

    def expected_syncs(self, facts: RunFacts) -> int | None:
        """The syncs a run of ``facts`` makes after the warm start (None when its length is unknown):
        a sync every ``ceil(sync_period / ceil(B / N))`` global minibatches of ``B``, and one at the end."""
        if not facts.max_samples or not facts.minibatch_size or not self.block_size:
            return None
        minibatches = math.ceil(max(facts.max_samples - self.distributed_after, 0) / facts.minibatch_size)
        per_sync = math.ceil(self.sync_period / math.ceil(facts.minibatch_size / self.comm.size))
        return math.ceil(minibatches / per_sync)

    def _check_block_size_bound(self, facts: RunFacts) -> None:
        """Warns (rank 0, one line) when an explicit block size breaks CNTK's bound on it."""
        num_workers = self.comm.size
        if facts.samples_per_sweep is None or num_workers == 1 or not self.comm.is_main:
            return
        needed = self.time_constant * num_workers
        if facts.samples_per_sweep < needed:
            bound = largest_block_size(facts.samples_per_sweep, num_workers)
            warnings.warn(
                f"learner.block_size={self.block_size:,} is too large for {facts.samples_per_sweep:,} unique samples "
                f"and {num_workers} workers: block momentum needs samples per sweep >= time constant x workers "
                f"({needed:,.0f}), i.e. a block of at most about {bound:,.0f} samples; expect lower accuracy, or "
                f"use learner.block_size=auto", RuntimeWarning, stacklevel=3)

    def auto_distributed_after(self, facts: RunFacts) -> int:
        """``distributed_after="auto"``: :func:`~dtrain.learners.base.auto_warm_start` (0 with one
        worker): local SGD from a warmed-up model (post-local SGD) generalises as well as
        synchronous SGD, started from scratch it measurably does not (``docs/semantics.md#warm-start``)."""
        return auto_warm_start(facts) if self.comm.size > 1 else 0

    def describe(self) -> str:
        """Block size, each worker's sync period and the block momentum at the nominal period."""
        self._require_block_size()
        momentum = momentum_from_time_constant(self.time_constant / self.comm.size, self.sync_period)
        auto = " (auto: CNTK's bound samples/sweep >= time constant x workers)" if self.block_size_is_auto else ""
        return (f"{super().describe()}: block of {self.block_size:,} samples{auto} = {self.sync_period:,} per worker between "
                f"syncs, time constant {self.time_constant:,.0f} samples, block momentum {momentum:.4f}, "
                f"block lr {self.block_learning_rate:g}, Nesterov {'on' if self.use_nesterov_momentum else 'off'}, "
                f"{self._describe_local_steps()}, exchange {self.exchange.describe()}")

    def _describe_local_steps(self) -> str:
        if self.local_learning_rate == "share":
            return "local steps at lr x the worker's share of the minibatch (CNTK's per-sample rate)"
        return "local steps at the full lr"

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

    def progress_note(self) -> str:
        """Bytes this rank sent in the last sync, and with a compressing strategy the saving
        against a float32 all-reduce; empty before the first sync."""
        if not self._bytes_sent_last_sync:
            return ""
        note = f"{self.exchange.name}: {self._bytes_sent_last_sync / 1e3:,.0f} kB sent/sync"
        if self._bytes_sent_last_sync < self._full_precision_bytes_last_sync:
            note += f" ({self.compression_ratio:.1f}x less than 32-bit)"
        return note

    def prepare(self, model: torch.nn.Module) -> None:
        """Broadcasts rank 0's parameters and buffers, then takes them as ``W_prev`` (``sg`` = 0).

        After ``load_state_dict`` the restored ``W_prev`` and ``sg`` are kept instead.

        Raises:
            ValueError: the optimizer has no parameters, or they are not all on one device.
        """
        self._require_block_size()
        parameters = self.parameters
        if not parameters:
            raise ValueError("the optimizer has no parameters; build it from model.parameters()")
        devices = {p.device for p in parameters}
        if len(devices) > 1:
            raise ValueError(f"block momentum keeps one flat copy of the model, but its parameters are on "
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
            _broadcast(list(parameters) + buffers, self.comm)
        restored_prev, restored_sg = self.prev_parameters, self.smoothed_gradient
        self.prev_parameters = self._flat_parameters().clone()
        self.smoothed_gradient = torch.zeros_like(self.prev_parameters)
        if restored_prev is not None:
            self.prev_parameters.copy_(restored_prev)
            self.smoothed_gradient.copy_(restored_sg)

    def apply_update(self) -> None:
        """The local optimizer step, then the block logic (a sync when the block is complete).

        Raises:
            RuntimeError: ``prepare(model)`` was not called first (``training_session`` calls it).
        """
        if self._scratch is None:
            raise RuntimeError("call learner.prepare(model) before training; training_session does it for you")
        blocks_started = self._blocks_started()  # decided before this minibatch was read
        self._met = False
        self.exchange_seconds_last_step = 0.0
        if self.local_samples > 0:
            self._local_step()
        if blocks_started:
            self.local_samples_in_block += self.local_samples
            self.global_samples_in_block += self.global_samples
            self.largest_share_in_block += -(-self.global_samples // self.comm.size)
            if self.largest_share_in_block >= self.sync_period:
                self._sync()
                self._met = True
        elif self._blocks_started(after=self.global_samples):  # step() counts this minibatch when we return
            self._start_blocks()
            self._met = True
        else:  # warm start: no collective at all; a meeting point every block_size samples
            self._met = (self.samples_seen + self.global_samples) // self.block_size != self.samples_seen // self.block_size

    def _local_step(self) -> None:
        """The wrapped optimizer's step on this worker's gradient; with ``local_learning_rate="share"``
        each parameter group's lr is ``lr * local_samples / global_samples`` for this step (1 during the
        warm start, where every worker reads the whole minibatch)."""
        share = self.local_samples / self.global_samples
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

    def is_sync_point(self) -> bool:
        """Whether the step just made ended a block (a sync, or the broadcast that starts blocks),
        or, during the warm start, crossed a multiple of ``block_size`` samples.

        Between these points block momentum makes no collective, so the session agrees on
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
        if self._blocks_started():
            if self.global_samples_in_block > 0:
                self._sync()  # float buffers are averaged inside it
            if self.comm.size > 1 and self._other_buffers:
                _broadcast(self._other_buffers, self.comm)
        elif self.comm.size > 1:
            _broadcast(self.parameters + self._float_buffers + self._other_buffers, self.comm)

    # -- the block update -----------------------------------------------------------------------
    def _blocks_started(self, after: int = 0) -> bool:
        """Whether blocks have started once ``after`` more samples are counted in ``samples_seen``."""
        # not is_distributed(): one worker runs blocks too (CNTK resets momentum at its syncs)
        return self.samples_seen + after >= self.distributed_after

    def _sync(self) -> None:
        """The block sync (``docs/semantics.md#block-momentum``, steps 1-4), on every rank at once:
        ``d_i``, their sum ``D`` through the exchange, then :meth:`_outer_update` from ``D``."""
        scratch, parameter_count = self._scratch, self._num_parameter_elements
        model_delta = scratch[:parameter_count]
        self._flat_parameters(out=model_delta)  # W_i for now
        if self._sync_keeps_model():
            # sg = D = W_prev - W and W <- W_prev - sg = W: the model stays as it is
            torch.sub(self.prev_parameters, model_delta, out=self.smoothed_gradient)
            self.prev_parameters.copy_(model_delta)
        else:
            torch.sub(self.prev_parameters, model_delta, out=model_delta)  # d_i = W_prev - W_i
            if self.comm.size > 1:
                self._exchange_model_delta()  # D = sum_i d_i; float buffers averaged
            self._outer_update(model_delta)
            _unpack(self.prev_parameters, self.parameters)  # W_prev <- W on every worker
        self.local_samples_in_block = self.global_samples_in_block = self.largest_share_in_block = 0
        self.syncs += 1
        if self.reset_sgd_momentum_after_aggregation:
            self._reset_local_momentum()

    def _block_momentum(self) -> float:
        """``bm = exp(-n / (TC / N))`` with ``n`` the workers' mean local samples since the last sync."""
        num_workers = self.comm.size
        return momentum_from_time_constant(self.time_constant / num_workers, self.global_samples_in_block / num_workers)

    def _sync_keeps_model(self) -> bool:
        """Whether the update would give back the workers' model: one worker, ``bm`` = 0 and block
        learning rate 1 (then it is skipped, which also spares its rounding)."""
        return self.comm.size == 1 and self._block_momentum() == 0.0 and self.block_learning_rate == 1.0

    def _outer_update(self, total_delta: torch.Tensor) -> None:
        """BMUF's filter (steps 2-3): ``sg <- bm sg + (1 - bm) blr D``; ``W = W_prev - sg`` (- ``bm sg``
        with Nesterov), written into ``prev_parameters``. ``total_delta`` is ``D`` (may be overwritten)."""
        block_momentum = self._block_momentum()
        self.smoothed_gradient.mul_(block_momentum).add_(
            total_delta, alpha=(1.0 - block_momentum) * self.block_learning_rate)
        self.prev_parameters.sub_(self.smoothed_gradient)  # W = W_prev - sg
        if self.use_nesterov_momentum:
            self.prev_parameters.sub_(self.smoothed_gradient, alpha=block_momentum)  # W -= bm * sg

    def _exchange_model_delta(self) -> None:
        """Sums the deltas ``d_i`` (the first part of the scratch buffer) over workers through the
        exchange strategy and averages the floating-point buffers exactly; records the bytes sent
        and the seconds taken (``exchange_seconds_last_step``)."""
        started = time.perf_counter()
        num_workers, scratch = self.comm.size, self._scratch
        parameter_count = self._num_parameter_elements
        buffers = scratch[parameter_count:]
        _pack(self._float_buffers, buffers)
        self.exchange.begin_step()
        extra_bytes = 0
        if self.exchange.lossless:
            # the buffers ride along: one all-reduce per sync, as before strategies existed
            self.exchange.allreduce_("model", scratch, [torch.Size([parameter_count]), torch.Size([buffers.numel()])])
        else:
            # a lossy strategy compresses only the parameter deltas; BatchNorm statistics stay exact
            self.exchange.allreduce_("model", scratch[:parameter_count], [p.shape for p in self.parameters])
            if buffers.numel():
                self.comm.allreduce(buffers, op="sum")
                extra_bytes = full_precision_allreduce_bytes(buffers.numel(), num_workers) * buffers.element_size() // 4
        _unpack(buffers.div_(num_workers), self._float_buffers)
        self._bytes_sent_last_sync = self.exchange.bytes_sent_last_step + extra_bytes
        self._full_precision_bytes_last_sync = self.exchange.full_precision_bytes_last_step + extra_bytes
        self.exchange_seconds_last_step = time.perf_counter() - started

    def _start_blocks(self) -> None:
        """End of the warm start: every worker continues from rank 0's model, which becomes W_prev."""
        if self.comm.size > 1:
            _broadcast(self.parameters + self._float_buffers + self._other_buffers, self.comm)
        self._flat_parameters(out=self.prev_parameters)
        self.local_samples_in_block = self.global_samples_in_block = self.largest_share_in_block = 0

    def _reset_local_momentum(self) -> None:
        """Zeroes the optimizer's first-moment buffers in place (CNTK's ResetSmoothedGradients)."""
        for state in self.optimizer.state.values():
            for key in MOMENTUM_STATE_KEYS:
                buffer = state.get(key)
                if isinstance(buffer, torch.Tensor):
                    buffer.zero_()

    def _flat_parameters(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """The parameters as one flat tensor (into ``out`` when given, casting to its dtype)."""
        if out is None:
            out = torch.empty(self._num_parameter_elements, dtype=self._scratch.dtype, device=self._scratch.device)
        _pack(self.parameters, out)
        return out

    # -- checkpoints ----------------------------------------------------------------------------
    def checkpoint_identity(self) -> dict[str, Any]:
        """The kind, and the exchange strategy when it is not the default fp32 all-reduce: a
        checkpoint's residuals restore only into the same strategy and settings."""
        identity = super().checkpoint_identity()
        if not isinstance(self.exchange, AllReduce):
            identity["exchange"] = self.exchange.identity()
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
        """Base state plus ``W_prev``, ``sg`` and the block counters (tensors and ints only).

        The session calls ``synchronize()`` first, so the counters are 0 and ``W_prev`` is the
        model in the same checkpoint; ``sg`` is what carries the block momentum across a resume.
        """
        state = super().state_dict()
        state["block"] = {
            "prev_parameters": _cpu_copy(self.prev_parameters),
            "smoothed_gradient": _cpu_copy(self.smoothed_gradient),
            "local_samples_in_block": self.local_samples_in_block,
            "global_samples_in_block": self.global_samples_in_block,
            "largest_share_in_block": self.largest_share_in_block,
            "syncs": self.syncs,
        }
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores what ``state_dict`` returned (applied to the model's device by ``prepare``).

        Raises:
            ValueError: the checkpoint was written by another learner, or its block state does not
                fit this model's parameters.
        """
        block = state.get("block") if state.get("kind") == self.kind else None
        expected = sum(p.numel() for p in self.parameters)
        for key in ("prev_parameters", "smoothed_gradient"):  # before the optimizer's less clear complaint
            tensor = None if block is None else block[key]
            if tensor is not None and tensor.numel() != expected:
                raise ValueError(f"checkpoint block state {key!r} has {tensor.numel()} values but the model has "
                                 f"{expected} parameters; restore into the model the checkpoint was made with")
        super().load_state_dict(state)  # refuses another learner's checkpoint
        block = state["block"]
        self.local_samples_in_block = int(block["local_samples_in_block"])
        self.global_samples_in_block = int(block["global_samples_in_block"])
        self.largest_share_in_block = int(block["largest_share_in_block"])
        self.syncs = int(block["syncs"])
        if block["prev_parameters"] is None:
            return
        if self._scratch is None:  # prepare() will move them to the model's device
            self.prev_parameters = block["prev_parameters"].clone()
            self.smoothed_gradient = block["smoothed_gradient"].clone()
        else:
            self.prev_parameters.copy_(block["prev_parameters"])
            self.smoothed_gradient.copy_(block["smoothed_gradient"])


def block_momentum_distributed_learner(optimizer: torch.optim.Optimizer, comm, block_size: int | str = AUTO,
                                       block_momentum_as_time_constant: float | None = None,
                                       use_nesterov_momentum: bool | None = None,
                                       reset_sgd_momentum_after_aggregation: bool = True,
                                       block_learning_rate: float = 1.0, distributed_after: int | str = AUTO,
                                       exchange: Exchange | None = None, local_learning_rate: str = "share",
                                       **aliases: Any) -> BlockMomentumLearner:
    """CNTK's ``block_momentum_distributed_learner``: wraps ``optimizer`` in a ``BlockMomentumLearner``.

    Arguments as in ``BlockMomentumLearner`` (``block_size`` and ``distributed_after`` in global
    samples; ``exchange`` the instantiated strategy that sums the model deltas, None: fp32), but
    CNTK's local steps by default (``local_learning_rate="share"``: a worker's step takes its share
    of the global minibatch's learning rate), so a CNTK configuration gives CNTK's update once its
    per-sample learning rate is converted (``lr`` = CNTK's per-sample lr x the global minibatch;
    ``docs/semantics.md#block-momentum``): e.g. ``block_momentum_as_time_constant=0``,
    ``block_size`` one global minibatch and ``block_learning_rate=1`` make data-parallel SGD.
    ``use_nesterov_momentum`` defaults to True (None = not given); CNTK's misspelling
    ``use_nestrov_momentum`` is accepted in its place.

    Raises:
        ValueError: as ``BlockMomentumLearner``, or both spellings of the Nesterov flag are given
            with different values.
        TypeError: an unknown keyword argument.
    """
    unknown = sorted(set(aliases) - {_NESTEROV_ALIAS})
    if unknown:
        raise TypeError(f"block_momentum_distributed_learner() got unexpected keyword argument(s) {unknown}")
    if _NESTEROV_ALIAS in aliases:
        alias_value = aliases[_NESTEROV_ALIAS]
        if use_nesterov_momentum is not None and use_nesterov_momentum != alias_value:
            raise ValueError(f"use_nesterov_momentum={use_nesterov_momentum!r} and its CNTK spelling "
                             f"{_NESTEROV_ALIAS}={alias_value!r} disagree; give only one of them")
        use_nesterov_momentum = alias_value
    return BlockMomentumLearner(
        optimizer, comm, block_size=block_size, block_momentum_as_time_constant=block_momentum_as_time_constant,
        use_nesterov_momentum=True if use_nesterov_momentum is None else use_nesterov_momentum,
        reset_sgd_momentum_after_aggregation=reset_sgd_momentum_after_aggregation,
        block_learning_rate=block_learning_rate, distributed_after=distributed_after, exchange=exchange,
        local_learning_rate=local_learning_rate,
    )


# -- helpers ---------------------------------------------------------------------------------------
def _cpu_copy(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return None if tensor is None else tensor.detach().cpu().clone()


def _pack(tensors: Sequence[torch.Tensor], flat: torch.Tensor) -> None:
    """Copies ``tensors`` one after another into the 1-D ``flat`` (casting to its dtype)."""
    offset = 0
    with torch.no_grad():
        for tensor in tensors:
            count = tensor.numel()
            flat[offset:offset + count].copy_(tensor.reshape(-1))
            offset += count


def _unpack(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copies consecutive slices of the 1-D ``flat`` back into ``tensors`` (casting to theirs)."""
    offset = 0
    with torch.no_grad():
        for tensor in tensors:
            count = tensor.numel()
            tensor.copy_(flat[offset:offset + count].view_as(tensor))
            offset += count


def _broadcast(tensors: Sequence[torch.Tensor], comm) -> None:
    """Overwrites ``tensors`` with rank 0's values: one broadcast per dtype, not one per tensor."""
    coalesced(tensors, math.inf, lambda flat: comm.broadcast(flat, root=0))


__all__ = ["MOMENTUM_STATE_KEYS", "BlockMomentumLearner", "auto_block_size", "block_momentum_distributed_learner",
           "default_time_constant", "largest_block_size"]
