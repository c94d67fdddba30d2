"""dtrain: declarative, distributed data-parallel training for PyTorch.

The public API, usable without Hydra::

    from dtrain import MinibatchSource, training_session, CheckpointConfig, TestConfig

``load_checkpoint(path)`` reads a dtrain checkpoint file (verified, no code executed); its
``"model"`` entry is the model's ``state_dict``.

The names are imported on first use (PEP 562), so ``import dtrain`` itself, and ``python -m dtrain
--help`` or ``--version``, do not wait for torch.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

#: public name -> (module, attribute in it)
_EXPORTS = {
    "create_communicator": ("dtrain.comm", "create_communicator"),
    "MinibatchSource": ("dtrain.data", "MinibatchSource"),
    "UserMinibatchSource": ("dtrain.data", "UserMinibatchSource"),
    "Learner": ("dtrain.learners", "Learner"),
    "LocalLearner": ("dtrain.learners", "LocalLearner"),
    "ReplicatedLearner": ("dtrain.learners", "ReplicatedLearner"),
    "block_momentum_distributed_learner": ("dtrain.learners", "block_momentum_distributed_learner"),
    "data_parallel_distributed_learner": ("dtrain.learners", "data_parallel_distributed_learner"),
    "keep_freed_host_memory": ("dtrain.host_memory", "keep_freed_host_memory"),
    "Schedule": ("dtrain.schedules", "Schedule"),
    "CheckpointError": ("dtrain.session.checkpoint", "CheckpointError"),
    "load_checkpoint": ("dtrain.session.checkpoint", "load"),
    "CheckpointConfig": ("dtrain.session", "CheckpointConfig"),
    "CrossValidationConfig": ("dtrain.session", "CrossValidationConfig"),
    "TestConfig": ("dtrain.session", "TestConfig"),
    "ProfileConfig": ("dtrain.session.profiling", "ProfileConfig"),
    "TrainingSession": ("dtrain.session", "TrainingSession"),
    "Callback": ("dtrain.session.callbacks", "Callback"),
    "training_session": ("dtrain.session", "training_session"),
}

__all__ = sorted(_EXPORTS, key=str.lower)


def __getattr__(name: str):
    """Imports a public name's module on first use and caches the name in this module."""
    try:
        module, attribute = _EXPORTS[name]
    except KeyError:
        raise AttributeError(f"module 'dtrain' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module), attribute)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


if TYPE_CHECKING:  # what type checkers and IDEs see
    from dtrain.comm import create_communicator
    from dtrain.data import MinibatchSource, UserMinibatchSource
    from dtrain.learners import (Learner, LocalLearner, ReplicatedLearner, block_momentum_distributed_learner,
                                 data_parallel_distributed_learner)
    from dtrain.schedules import Schedule
    from dtrain.session import CheckpointConfig, CrossValidationConfig, TestConfig, TrainingSession, training_session
    from dtrain.session.callbacks import Callback
    from dtrain.session.checkpoint import CheckpointError
    from dtrain.session.checkpoint import load as load_checkpoint
    from dtrain.session.profiling import ProfileConfig
