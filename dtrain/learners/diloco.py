"""DiLoCo: local steps with an inner optimizer, and every block an outer Nesterov SGD step.

DiLoCo (Douillard et al. 2023, "DiLoCo: Distributed Low-Communication Training of Language
Models", arXiv 2311.08105; open implementation: PrimeIntellect-ai/OpenDiLoCo) is block momentum's
family: each worker takes ``H`` steps of its inner optimizer (AdamW in the paper) on its own model
copy, then the workers' model changes are averaged into an outer gradient, and an outer optimizer
(SGD with Nesterov momentum 0.9, learning rate 0.7) applies it to the model of the last sync.
:class:`DiLoCoLearner` is a :class:`~dtrain.learners.block.BlockLearner` (block counting, warm
start, sync points, exchange strategies, checkpoints) whose outer update is DiLoCo's outer step,
exactly as ``torch.optim.SGD(nesterov=True)`` computes it (with the velocity rescaled when the inner
learning rate changes: the momentum correction). ``docs/semantics.md#diloco`` gives the mapping
to BMUF's ``block_learning_rate`` and ``block_momentum`` and where the two updates differ.
"""
from __future__ import annotations

from functools import partial

import torch

from dtrain.exchange import Exchange
from dtrain.learners.base import AUTO, RunFacts
from dtrain.learners.block import BlockLearner
from dtrain.learners.outer import OuterOptimizerFactory, refuse_replaced_settings
from dtrain.learners.settings import DILOCO
from dtrain.rules import check_settings


#: ``block_size="auto"``: DiLoCo's H, inner steps between syncs (the paper's 500) ...
DILOCO_INNER_STEPS = 500
#: ... but few enough that a run makes this many syncs after its warm start: the outer Nesterov
#: momentum (0.9) averages over about 10 of them, and blocks of a few inner steps make its steps
#: several times too long (a 1-D convolutional task at 4 ranks and 2 inner steps collapsed to chance)
DILOCO_MIN_SYNCS = 20
#: ... at up to this many workers; beyond it ``H`` shrinks as ``DILOCO_REFERENCE_WORKERS / N``. The
#: global minibatch stays the same at any world size, so each worker's inner step sees ``B / N``
#: samples, and the workers' models drift apart in proportion to ``H`` times their steps' variance,
#: which grows with ``N``: a constant ``H·N`` keeps the drift of 2 workers (the language model at 4
#: ranks: 93 inner steps +0.094 nats to data_parallel, 46 inner steps +0.024; docs/semantics.md#diloco)
DILOCO_REFERENCE_WORKERS = 2


def auto_diloco_inner_steps(steps: int | None, num_workers: int) -> int:
    """DiLoCo's automatic ``H`` for a run of ``steps`` global minibatches after the warm start (None:
    unknown): ``min(500, steps / 20)`` at 1 or 2 workers, times ``2 / N`` beyond, at least 1."""
    scale = max(num_workers, DILOCO_REFERENCE_WORKERS)
    cap = DILOCO_INNER_STEPS * DILOCO_REFERENCE_WORKERS // scale
    if steps is None:
        return max(1, cap)
    return max(1, min(cap, steps * DILOCO_REFERENCE_WORKERS // (DILOCO_MIN_SYNCS * scale)))


def auto_diloco_block_size(facts: RunFacts, distributed_after: int, num_workers: int) -> int:
    """``block_size="auto"`` for DiLoCo, in global samples: ``H`` global minibatches (:func:`auto_diloco_inner_steps`:
    ``H = min(500, S / 20)`` for the run's ``S`` minibatches after the warm start, so a short run still makes
    20 syncs and a long one syncs every 500 inner steps as the DiLoCo paper does, both times ``2 / N`` beyond 2
    workers; 500 minibatches when the run's length is unknown). Never below ``num_workers`` samples."""
    minibatch = facts.minibatch_size or num_workers
    steps = max(facts.max_samples - distributed_after, 0) // minibatch if facts.max_samples else None
    return max(auto_diloco_inner_steps(steps, num_workers) * minibatch, num_workers)


class DiLoCoLearner(BlockLearner):
    """DiLoCo's outer step on the base's blocks (``learner=diloco``).

    Every minibatch each worker steps its inner optimizer (the wrapped ``optimizer``; AdamW in
    the ``learner=diloco`` preset) on the gradient of its LOCAL mean loss. When a block of
    ``block_size`` global samples is complete, with ``W_prev`` the model of the last sync and
    ``W_i`` worker i's model, every worker computes the same outer step:

    1. outer gradient ``g = (1/N) sum_i (W_prev - W_i)`` (the strategy sums the deltas, then / N);
    2. ``v <- mu v + g`` (``v`` starts at 0, so the first ``v`` is ``g``, as torch's first step);
    3. ``W = W_prev - lr (g + mu v)`` with Nesterov, ``W = W_prev - lr v`` without;
    4. ``W_prev <- W`` on every worker. The inner optimizer's state (AdamW's moments) is kept
       across syncs, as in DiLoCo.

    These are ``torch.optim.SGD(lr=outer_learning_rate, momentum=outer_momentum,
    nesterov=outer_nesterov)`` stepping ``W_prev`` with ``W_prev.grad = g``, the outer optimizer itself (with
    ``momentum_correction``, ``v`` is first multiplied by the ratio of this block's inner learning
    rate to the last block's, when they differ). ``v`` is the outer optimizer's ``momentum_buffer``
    (replicated, in checkpoints); the exchange strategy's per-rank state is in :meth:`local_state_dict`.

    Args:
        optimizer: the inner optimizer, a ``torch.optim.Optimizer`` of the model's parameters.
        comm: the job's communicator (None: a size-1 ``LocalCommunicator``).
        block_size: global samples per block (``H`` inner steps = ``block_size`` / global minibatch);
            ``"auto"``: :func:`auto_diloco_block_size` of the run's facts (``H = min(500, steps / 20)``,
            times ``2 / N`` beyond 2 workers).
        outer_learning_rate: the outer SGD learning rate (> 0); DiLoCo's 0.7.
        outer_momentum: the outer SGD momentum ``mu`` in [0, 1); DiLoCo's 0.9.
        outer_nesterov: Nesterov momentum in the outer step (DiLoCo: on).
        distributed_after: global samples of local-only training on the full stream before the
            first block (>= 0); ``"auto"``: a warm start relative to the run, as block momentum's.
        exchange: the :class:`~dtrain.exchange.Exchange` strategy that sums the model deltas
            (None: fp32 all-reduce; e.g. ``Quantized(num_bits=4)`` for 4-bit outer gradients).
        outer_comm: the communicator of the delta exchange (None: ``comm``).
        momentum_correction: before step 2, ``v <- v * lr_block / lr_previous_block`` (the inner learning
            rate averaged over each block's local steps; :meth:`~dtrain.learners.block.BlockLearner.correct_outer_momentum`),
            so the velocity follows the inner schedule; with a constant learning rate it changes nothing.
        outer_optimizer: another outer optimizer in place of DiLoCo's SGD (a factory of ``[W_prev]``, e.g.
            ``functools.partial(torch.optim.Adam, lr=1e-3)``); the ``outer_*`` settings then stay at their defaults.
        overlap: each block's exchange runs while the next block trains (:mod:`dtrain.learners.overlap`).

    Raises:
        ValueError: a value is out of range or of the wrong kind, or ``block_size // N`` is 0.
        TypeError: the optimizer is not a ``torch.optim.Optimizer``, or ``exchange`` not an ``Exchange``.
    """

    kind = "diloco"

    def __init__(self, optimizer: torch.optim.Optimizer, comm=None, block_size: int | str = AUTO,
                 outer_learning_rate: float = 0.7, outer_momentum: float = 0.9, outer_nesterov: bool = True,
                 distributed_after: int | str = AUTO, exchange: Exchange | None = None, outer_comm=None,
                 momentum_correction: bool = True, outer_optimizer: OuterOptimizerFactory | None = None,
                 overlap: bool = False):
        check_settings(DILOCO, outer_learning_rate=outer_learning_rate, outer_momentum=outer_momentum,
                       outer_nesterov=outer_nesterov)
        refuse_replaced_settings(outer_optimizer, {"outer_learning_rate": (outer_learning_rate, 0.7),
                                                   "outer_momentum": (outer_momentum, 0.9),
                                                   "outer_nesterov": (outer_nesterov, True)})
        # the inner optimizer steps at its own lr on every worker (DiLoCo averages the deltas)
        super().__init__(optimizer, comm, block_size=block_size, distributed_after=distributed_after,
                         exchange=exchange, local_learning_rate="full", outer_comm=outer_comm,
                         momentum_correction=momentum_correction, outer_optimizer=outer_optimizer, overlap=overlap)
        self.outer_learning_rate = float(outer_learning_rate)
        self.outer_momentum = float(outer_momentum)
        self.outer_nesterov = outer_nesterov

    def auto_block_size(self, facts: RunFacts) -> int:
        """``block_size="auto"``: :func:`auto_diloco_block_size` (after the warm start is known)."""
        return auto_diloco_block_size(facts, self.distributed_after or 0, self.model_replicas())

    def describe_auto_block_size(self) -> str:
        """How the automatic block size was derived."""
        workers = self.model_replicas()
        scaled = (f", times {DILOCO_REFERENCE_WORKERS}/{workers} for {workers} workers"
                  if workers > DILOCO_REFERENCE_WORKERS else "")
        return (f" (auto: {DILOCO_MIN_SYNCS} syncs after the warm start, at most {DILOCO_INNER_STEPS} inner steps "
                f"each{scaled})")

    def describe_block(self) -> str:
        """The outer optimizer and the inner one."""
        if self.outer_optimizer_factory is not None:
            return (f"{super().describe_block()}, {self.describe_momentum_correction()}, inner optimizer "
                    f"{type(self.optimizer).__name__} (state kept across syncs)")
        return (f"outer SGD lr {self.outer_learning_rate:g} momentum {self.outer_momentum:g} Nesterov "
                f"{'on' if self.outer_nesterov else 'off'}, {self.describe_momentum_correction()}, inner optimizer "
                f"{type(self.optimizer).__name__} (state kept across syncs)")

    def default_outer_optimizer(self) -> OuterOptimizerFactory:
        """DiLoCo's outer step: ``torch.optim.SGD(lr=outer_learning_rate, momentum=outer_momentum,
        nesterov=outer_nesterov)`` on ``W_prev`` with gradient ``D / N`` (steps 1-3 above). It moves the model
        even with one worker (a look-ahead), so no sync is ever skipped."""
        return partial(torch.optim.SGD, lr=self.outer_learning_rate, momentum=self.outer_momentum,
                       nesterov=self.outer_nesterov and self.outer_momentum > 0)


__all__ = ["DILOCO_INNER_STEPS", "DILOCO_MIN_SYNCS", "DILOCO_REFERENCE_WORKERS", "DiLoCoLearner",
           "auto_diloco_block_size", "auto_diloco_inner_steps"]
