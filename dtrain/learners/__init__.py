"""Learners: wrap a torch optimizer and decide how updates are made across workers.

:class:`Learner` is the interface the training loop talks to (its ``step`` is final: it applies
the subclass's update and advances the sample clock); :class:`LocalLearner` is ``learner=local``;
:class:`ReplicatedLearner` (every rank applies the same update each step) and :class:`BlockLearner`
(local steps, a sync of the model deltas every block through any exchange strategy) are the bases
to subclass for a distributed learner of your own (see ``docs/writing-a-learner.md``).
"""
from dtrain.advice import Advice
from dtrain.learners.base import Learner, LocalLearner
from dtrain.learners.block import BlockLearner
from dtrain.learners.block_momentum import BlockMomentumLearner, block_momentum_distributed_learner
from dtrain.learners.diloco import DiLoCoLearner
from dtrain.learners.data_parallel import DataParallelLearner, data_parallel_distributed_learner
from dtrain.learners.fsdp import FSDPLearner, fsdp_learner
from dtrain.learners.local_sgd import LocalSGDLearner
from dtrain.learners.replicated import ReplicatedLearner
from dtrain.learners.two_level import (
    TwoLevelBlockMomentumLearner,
    TwoLevelDataParallelLearner,
    TwoLevelDiLoCoLearner,
    TwoLevelLocalSGDLearner,
)

__all__ = [
    "Advice", "BlockLearner", "BlockMomentumLearner", "DataParallelLearner", "DiLoCoLearner", "FSDPLearner", "Learner",
    "LocalLearner", "LocalSGDLearner", "ReplicatedLearner", "TwoLevelBlockMomentumLearner",
    "TwoLevelDataParallelLearner", "TwoLevelDiLoCoLearner", "TwoLevelLocalSGDLearner",
    "block_momentum_distributed_learner", "data_parallel_distributed_learner", "fsdp_learner",
]
