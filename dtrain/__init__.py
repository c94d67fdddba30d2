"""dtrain: declarative, distributed data-parallel training for PyTorch.

The public API, usable without Hydra::

    from dtrain import MinibatchSource, training_session, CheckpointConfig, TestConfig
"""
from dtrain.comm import create_communicator
from dtrain.data import MinibatchSource
from dtrain.learners import (
    Learner,
    LocalLearner,
    ReplicatedLearner,
    block_momentum_distributed_learner,
    data_parallel_distributed_learner,
)
from dtrain.schedules import Schedule
from dtrain.session import (
    CheckpointConfig,
    CrossValidationConfig,
    TestConfig,
    TrainingSession,
    training_session,
)

__all__ = [
    "CheckpointConfig", "CrossValidationConfig", "Learner", "LocalLearner", "MinibatchSource", "ReplicatedLearner",
    "Schedule", "TestConfig",
    "TrainingSession", "block_momentum_distributed_learner", "create_communicator",
    "data_parallel_distributed_learner", "training_session",
]
