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
import warnings
from dataclasses import replace
from functools import partial
from typing import Any

import torch

from dtrain.exchange import Exchange
from dtrain.learners.base import AUTO, RunFacts
from dtrain.learners.block import MOMENTUM_STATE_KEYS, BlockLearner  # noqa: F401  (MOMENTUM_STATE_KEYS: exported)
from dtrain.learners.block_size import BLOCK_MOMENTUM_MIN_SYNCS, auto_block_size, largest_block_size
from dtrain.learners.cntk_keywords import wrapped_optimizer
from dtrain.learners.outer import BlockMomentumFilter, OuterOptimizerFactory, refuse_replaced_settings
from dtrain.learners.settings import BLOCK_MOMENTUM
from dtrain.rules import check_settings
from dtrain.schedules import momentum_from_time_constant

#: the one misspelt keyword CNTK's Python API has, accepted for ported scripts
_NESTEROV_ALIAS = "use_nestrov_momentum"
#: CNTK's name for the local learner (dtrain's optimizer) the factory wraps
_LEARNER_ALIAS = "learner"


def default_time_constant(block_size: int, num_workers: int) -> float:
    """CNTK's default block momentum time constant ``-block_size / ln(1 - 1/N)``, in samples.

    It makes the block momentum ``1 - 1/N`` at a sync of nominal size. One worker gives 0
    (block momentum 0: a sync leaves the model unchanged).
    """
    if num_workers == 1:
        return 0.0
    return -block_size / math.log(1.0 - 1.0 / num_workers)


class BlockMomentumLearner(BlockLearner):
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
        outer_comm: the communicator of the delta exchange (None: ``comm``).
        momentum_correction: before step 2, ``sg <- sg * lr_block / lr_previous_block`` (the inner learning
            rate averaged over each block's local steps; :meth:`~dtrain.learners.block.BlockLearner.correct_outer_momentum`):
            dtrain's default, not CNTK's; with a constant learning rate it changes nothing.
        outer_optimizer: another outer optimizer in place of BMUF's filter (a factory of ``[W_prev]``); the
            block momentum settings then stay at their defaults.
        overlap: each block's exchange runs while the next block trains (:mod:`dtrain.learners.overlap`).

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
                 local_learning_rate: str = "full", outer_comm=None, momentum_correction: bool = True,
                 outer_optimizer: OuterOptimizerFactory | None = None, overlap: bool = False):
        check_settings(BLOCK_MOMENTUM, block_momentum_as_time_constant=block_momentum_as_time_constant,
                       block_learning_rate=block_learning_rate, use_nesterov_momentum=use_nesterov_momentum)
        refuse_replaced_settings(outer_optimizer, {
            "block_momentum_as_time_constant": (block_momentum_as_time_constant, None),
            "block_learning_rate": (block_learning_rate, 1.0), "use_nesterov_momentum": (use_nesterov_momentum, True)})
        # block_momentum_as_time_constant null: CNTK's default; 0: block momentum 0
        self._time_constant_setting = block_momentum_as_time_constant  # read by set_block_size
        self._block_set_by_syncs = False  # whether block_size="auto" came from the 50 syncs (start-up line)
        self.time_constant = 0.0
        super().__init__(optimizer, comm, block_size=block_size, distributed_after=distributed_after,
                         exchange=exchange, local_learning_rate=local_learning_rate,
                         reset_sgd_momentum_after_aggregation=reset_sgd_momentum_after_aggregation,
                         outer_comm=outer_comm, momentum_correction=momentum_correction,
                         outer_optimizer=outer_optimizer, overlap=overlap)
        self.use_nesterov_momentum = use_nesterov_momentum
        self.block_learning_rate = float(block_learning_rate)

    def set_block_size(self, block_size: int) -> None:
        """The base's, then the time constant (unless given): CNTK's :func:`default_time_constant`."""
        super().set_block_size(block_size)
        self.time_constant = (float(self._time_constant_setting) if self._time_constant_setting is not None
                              else default_time_constant(block_size, self.model_replicas()))

    # -- the loop -------------------------------------------------------------------------------
    def plan(self, facts: RunFacts) -> None:
        """The base's plan (``block_size="auto"``, the exchange); warns (rank 0, one line) when a block
        size given explicitly breaks CNTK's bound :func:`largest_block_size`."""
        super().plan(facts)
        if not self.block_size_is_auto:
            self._check_block_size_bound(facts)

    def _check_block_size_bound(self, facts: RunFacts) -> None:
        """Warns (rank 0, one line) when an explicit block size breaks CNTK's bound on it."""
        num_workers = self.model_replicas()
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

    def auto_block_size(self, facts: RunFacts) -> int:
        """The base's rule (:func:`auto_block_size`); notes whether the 50 syncs or CNTK's bound set it."""
        block = super().auto_block_size(facts)
        self._block_set_by_syncs = block < auto_block_size(replace(facts, max_samples=None), self.model_replicas())
        return block

    def describe_auto_block_size(self) -> str:
        """How the automatic block size was derived."""
        if self._block_set_by_syncs:
            return (f" (auto: {BLOCK_MOMENTUM_MIN_SYNCS} syncs after the warm start, within CNTK's bound "
                    f"samples/sweep >= time constant x workers)")
        return " (auto: CNTK's bound samples/sweep >= time constant x workers)"

    def describe_block(self) -> str:
        """Time constant, block momentum at the nominal period, block lr, Nesterov and the local steps (the outer
        optimizer in their place when one was given)."""
        if self.outer_optimizer_factory is not None:
            return f"{super().describe_block()}, {self.describe_momentum_correction()}, {self.describe_local_steps()}"
        momentum = momentum_from_time_constant(self.time_constant / self.comm.size, self.sync_period)
        return (f"time constant {self.time_constant:,.0f} samples, block momentum {momentum:.4f}, "
                f"block lr {self.block_learning_rate:g}, Nesterov {'on' if self.use_nesterov_momentum else 'off'}, "
                f"{self.describe_momentum_correction()}, {self.describe_local_steps()}")

    def describe_local_steps(self) -> str:
        """The local steps' learning rate, in words: the rule in effect and the other one, since CNTK's factory
        ``block_momentum_distributed_learner`` defaults to ``share`` and ``learner=block_momentum`` and
        ``BlockMomentumLearner`` to ``full`` (``docs/semantics.md#block-momentum``)."""
        replicas = self.model_replicas()
        if self.local_learning_rate == "share":
            here = f", lr/{replicas} at even shares" if replicas > 1 else ""
            return (f"local steps at lr x the worker's share of the minibatch{here} (local_learning_rate=share, "
                    f"CNTK's per-sample rate: block_momentum_distributed_learner's default; learner=block_momentum "
                    f"and BlockMomentumLearner default to full)")
        return ("local steps at the full lr (local_learning_rate=full: the default of learner=block_momentum and "
                "BlockMomentumLearner; CNTK's block_momentum_distributed_learner defaults to share, lr x the "
                "worker's share of the minibatch)")

    # -- the block update (the base does the rest) -----------------------------------------------
    def default_outer_optimizer(self) -> OuterOptimizerFactory:
        """BMUF's filter (steps 2-3) as the outer optimizer: :class:`~dtrain.learners.outer.BlockMomentumFilter`
        over ``D`` with this learner's time constant, block learning rate and Nesterov flag. With one worker,
        ``bm`` = 0 and block learning rate 1 a sync gives back the model: the step is skipped, sparing its rounding."""
        return partial(BlockMomentumFilter, lr=self.block_learning_rate, time_constant=self.time_constant,
                       nesterov=self.use_nesterov_momentum)


def block_momentum_distributed_learner(optimizer: torch.optim.Optimizer | None = None, comm=None,
                                       block_size: int | str = AUTO,
                                       block_momentum_as_time_constant: float | None = None,
                                       use_nesterov_momentum: bool | None = None,
                                       reset_sgd_momentum_after_aggregation: bool = True,
                                       block_learning_rate: float = 1.0, distributed_after: int | str = AUTO,
                                       exchange: Exchange | None = None, local_learning_rate: str = "share",
                                       momentum_correction: bool = False,
                                       outer_optimizer: OuterOptimizerFactory | None = None, overlap: bool = False,
                                       **aliases: Any) -> BlockMomentumLearner:
    """CNTK's ``block_momentum_distributed_learner``: wraps ``optimizer`` in a ``BlockMomentumLearner``.

    Arguments as in ``BlockMomentumLearner`` (``block_size`` and ``distributed_after`` in global
    samples; ``exchange`` the instantiated strategy that sums the model deltas, None: fp32), but
    CNTK's local steps by default (``local_learning_rate="share"``: a worker's step takes its share
    of the global minibatch's learning rate), so a CNTK configuration gives CNTK's update once its
    per-sample learning rate is converted (``lr`` = CNTK's per-sample lr x the global minibatch;
    ``docs/semantics.md#block-momentum``), and no momentum correction (``learner=block_momentum``
    turns it on): e.g. ``block_momentum_as_time_constant=0``,
    ``block_size`` one global minibatch and ``block_learning_rate=1`` make data-parallel SGD.
    ``use_nesterov_momentum`` defaults to True (None = not given); CNTK's misspelling
    ``use_nestrov_momentum`` is accepted in its place, and CNTK's ``learner=`` in place of ``optimizer``
    (as CNTK's own tests call it). ``comm`` None is a one-process communicator (a session launched on
    several processes refuses it). ``outer_optimizer`` (not CNTK's) replaces the block momentum filter; ``overlap``
    (not CNTK's) runs each block's exchange while the next block trains.

    Raises:
        ValueError: as ``BlockMomentumLearner``, or both spellings of the Nesterov flag are given
            with different values.
        TypeError: an unknown keyword argument, or no optimizer (or two: ``optimizer`` and ``learner``).
    """
    unknown = sorted(set(aliases) - {_NESTEROV_ALIAS, _LEARNER_ALIAS})
    if unknown:
        raise TypeError(f"block_momentum_distributed_learner() got unexpected keyword argument(s) {unknown}")
    optimizer = wrapped_optimizer("block_momentum_distributed_learner", optimizer, aliases.get(_LEARNER_ALIAS))
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
        local_learning_rate=local_learning_rate, momentum_correction=momentum_correction,
        outer_optimizer=outer_optimizer, overlap=overlap,
    )


__all__ = ["MOMENTUM_STATE_KEYS", "BlockMomentumLearner", "auto_block_size", "block_momentum_distributed_learner",
           "default_time_constant", "largest_block_size"]
