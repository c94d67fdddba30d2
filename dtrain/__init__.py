"""dtrain: declarative, distributed data-parallel training for PyTorch.

The public API, usable without Hydra::

    from dtrain import MinibatchSource, training_session, CheckpointConfig, TestConfig

``load_checkpoint(path)`` reads a dtrain checkpoint file (verified, no code executed); its
``"model"`` entry is the model's ``state_dict``.
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
from dtrain.session.checkpoint import CheckpointError
from dtrain.session.checkpoint import load as load_checkpoint
from dtrain.session import (
    CheckpointConfig,
    CrossValidationConfig,
    TestConfig,
    TrainingSession,
    training_session,
)

__all__ = [
    "CheckpointConfig", "CheckpointError", "CrossValidationConfig", "Learner", "LocalLearner", "MinibatchSource",
    "ReplicatedLearner", "Schedule", "TestConfig",
    "TrainingSession", "block_momentum_distributed_learner", "create_communicator",
    "data_parallel_distributed_learner", "load_checkpoint", "training_session",
]
