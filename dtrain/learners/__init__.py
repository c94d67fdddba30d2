"""Learners: wrap a torch optimizer and decide how updates are made across workers.

:class:`Learner` is the interface the training loop talks to (its ``step`` is final: it applies
the subclass's update and advances the sample clock); :class:`LocalLearner` is ``learner=local``;
:class:`ReplicatedLearner` is the base to subclass for a distributed learner of your own (see
``docs/writing-a-learner.md``).
"""
from dtrain.learners.base import Learner, LocalLearner
from dtrain.learners.block_momentum import BlockMomentumLearner, block_momentum_distributed_learner
from dtrain.learners.diloco import DiLoCoLearner
from dtrain.learners.data_parallel import DataParallelLearner, data_parallel_distributed_learner
from dtrain.learners.quantized import QuantizedDataParallelLearner
from dtrain.learners.replicated import ReplicatedLearner

__all__ = [
    "BlockMomentumLearner", "DataParallelLearner", "DiLoCoLearner", "Learner", "LocalLearner", "QuantizedDataParallelLearner",
    "ReplicatedLearner", "block_momentum_distributed_learner", "data_parallel_distributed_learner",
]
