"""Learners: wrap a torch optimizer and decide how updates are made across workers."""
from dtrain.learners.base import Learner
from dtrain.learners.block_momentum import BlockMomentumLearner, block_momentum_distributed_learner
from dtrain.learners.data_parallel import DataParallelLearner, data_parallel_distributed_learner
from dtrain.learners.quantized import QuantizedDataParallelLearner

__all__ = [
    "BlockMomentumLearner", "DataParallelLearner", "Learner", "block_momentum_distributed_learner",
    "data_parallel_distributed_learner", "QuantizedDataParallelLearner",
]
