"""A component's value rules are stated once: its constructor refuses a bad value with the very line that
``validate``'s registered rule gives for the config key (there prefixed with the node's name)."""
from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

import dtrain.config  # noqa: F401  (registers every shipped component's rule)
from dtrain.exchange import CompressedAllReduce, PowerSGD, Quantized
from dtrain.learners import (DiLoCoLearner, LocalSGDLearner, block_momentum_distributed_learner,
                             data_parallel_distributed_learner)
from dtrain.optim import LAMB, LARS
from dtrain.optimizers import Adam
from dtrain.rules import RULES
from dtrain.session import SequenceCrossEntropy, TopKError


def _optimizer() -> torch.optim.Optimizer:
    return torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)


def _parameters():
    return torch.nn.Linear(2, 2).parameters()


CASES = [
    ("dtrain.exchange.PowerSGD", PowerSGD, "matrix_approximation_rank", 0),
    ("dtrain.exchange.PowerSGD", PowerSGD, "start_powersgd_iter", -1),
    ("dtrain.exchange.Quantized", Quantized, "num_bits", 33),
    ("dtrain.exchange.Quantized", Quantized, "error_feedback", "yes"),
    ("dtrain.exchange.CompressedAllReduce", CompressedAllReduce, "dtype", "int8"),
    ("dtrain.learners.data_parallel_distributed_learner",
     lambda **kw: data_parallel_distributed_learner(_optimizer(), **kw), "bucket_size_mb", 0),
    ("dtrain.learners.data_parallel_distributed_learner",
     lambda **kw: data_parallel_distributed_learner(_optimizer(), **kw), "distributed_after", "soon"),
    ("dtrain.learners.block_momentum_distributed_learner",
     lambda **kw: block_momentum_distributed_learner(_optimizer(), None, **kw), "block_size", "abc"),
    ("dtrain.learners.block_momentum_distributed_learner",
     lambda **kw: block_momentum_distributed_learner(_optimizer(), None, **kw), "local_learning_rate", "half"),
    ("dtrain.learners.DiLoCoLearner", lambda **kw: DiLoCoLearner(_optimizer(), **kw), "outer_momentum", 1.0),
    ("dtrain.learners.LocalSGDLearner", lambda **kw: LocalSGDLearner(_optimizer(), **kw), "block_size", 0),
    ("dtrain.session.SequenceCrossEntropy", SequenceCrossEntropy, "label_smoothing", 1.0),
    ("dtrain.session.TopKError", TopKError, "k", 0),
    ("dtrain.optim.LARS", lambda **kw: LARS(_parameters(), **kw), "eta", 0.0),
    ("dtrain.optim.LAMB", lambda **kw: LAMB(_parameters(), **kw), "variance_momentum", 1.0),
    ("dtrain.optimizers.Adam", lambda **kw: Adam(_parameters(), **kw), "momentum", -0.5),
]


@pytest.mark.parametrize("target, build, key, value", CASES, ids=[f"{case[0]}.{case[2]}" for case in CASES])
def test_the_constructor_and_validate_refuse_with_one_line(target, build, key, value):
    with pytest.raises(ValueError) as refused:
        build(**{key: value})
    node = OmegaConf.create({"_target_": target, key: value})
    assert RULES[target](node, "node") == [f"node.{refused.value}"]
