"""Local SGD (model averaging): local steps, and every block the workers' models are averaged.

Each worker trains its own copy with the wrapped optimizer; every ``block_size`` global samples
the model becomes the mean of the workers' models, ``W = W_prev - D / N`` with ``D = sum_i
(W_prev - W_i)`` summed by any exchange strategy (exactly ``mean_i W_i`` with the float32
all-reduce). Lin et al. 2020 ("Don't Use Large Mini-Batches, Use Local SGD", arXiv 1808.07217)
call it local SGD, post-local SGD with a warm start (``distributed_after``); it is BMUF with
block momentum 0 and block learning rate 1 (``docs/semantics.md#local-sgd``).
"""
from __future__ import annotations

import torch

from dtrain.exchange import Exchange
from dtrain.learners.base import AUTO
from dtrain.learners.block import BlockLearner
from dtrain.learners.outer import OuterOptimizerFactory


class LocalSGDLearner(BlockLearner):
    """Model averaging every block (``learner=local_sgd``); the inner optimizer's state stays local.

    Args:
        optimizer: the torch optimizer each worker steps on its local gradient.
        comm: the job's communicator (None: a size-1 ``LocalCommunicator``).
        block_size: global samples per block (at least N), or ``"auto"`` (:func:`~dtrain.learners.block.auto_block_size`).
        distributed_after: global samples of local-only training before the first block, or ``"auto"``.
        exchange: the strategy that sums the model deltas (None: float32 all-reduce).
        outer_comm: the communicator of the averaging (None: ``comm``).
        outer_optimizer: an outer step in place of the average (a factory of ``[W_prev]``, e.g.
            ``functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)``; in a config,
            ``learner/outer_optimizer=NAME``): the average is torch's SGD at lr 1 on ``D / N``.
        overlap: each block's exchange runs while the next block trains (:mod:`dtrain.learners.overlap`).

    Raises:
        ValueError: a value out of range, or ``block_size // N`` is 0.
        TypeError: the optimizer is not a ``torch.optim.Optimizer``, or ``exchange`` not an ``Exchange``.
    """

    kind = "local_sgd"

    def __init__(self, optimizer: torch.optim.Optimizer, comm=None, block_size: int | str = AUTO,
                 distributed_after: int | str = AUTO, exchange: Exchange | None = None, outer_comm=None,
                 outer_optimizer: OuterOptimizerFactory | None = None, overlap: bool = False):
        super().__init__(optimizer, comm, block_size=block_size, distributed_after=distributed_after,
                         exchange=exchange, outer_comm=outer_comm, outer_optimizer=outer_optimizer, overlap=overlap)

    def describe_block(self) -> str:
        """What a sync does."""
        return super().describe_block() or "models averaged at each sync"


__all__ = ["LocalSGDLearner"]
