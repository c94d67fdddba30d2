"""The ``fault_tolerance`` section's refusals: one line each, naming the setting and why."""
from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from dtrain.learners.elastic import elastic_problems
from dtrain.learners.data_parallel import DataParallelLearner
from dtrain.learners.elastic_settings import fault_tolerance_problems
from dtrain.learners.local_sgd import LocalSGDLearner


def config(**learner):
    return OmegaConf.create({
        "fault_tolerance": {"enabled": True, "lighthouse": "http://localhost:29510", "replica_id": "a",
                            "min_groups": 1, "timeout_s": 60.0, "quorum_timeout_s": 900.0},
        "learner": {"_target_": "dtrain.learners.DiLoCoLearner", "block_size": 640, "distributed_after": 0,
                    "overlap": False, "exchange": {"_target_": "dtrain.exchange.AllReduce"}, **learner},
        "session": {"max_samples": 6400}})


def test_a_sound_elastic_config_has_no_problem(monkeypatch):
    pytest.importorskip("torchft")
    assert fault_tolerance_problems(config()) == []


@pytest.mark.parametrize("change, expected", [
    ({"_target_": "dtrain.learners.data_parallel_distributed_learner"}, "is not elastic yet"),
    ({"_target_": "dtrain.learners.block_momentum_distributed_learner"}, "block momentum 1 - 1/N), which changes"),
    ({"block_size": "auto"}, "learner.block_size=auto"),
    ({"distributed_after": "auto"}, "learner.distributed_after=auto"),
    ({"overlap": True}, "learner.overlap=true"),
    ({"exchange": {"_target_": "dtrain.exchange.Quantized"}}, "residuals do not heal"),
])
def test_what_cannot_be_elastic_is_refused_in_one_line(change, expected):
    problems = fault_tolerance_problems(config(**change))
    assert any(expected in problem and "\n" not in problem for problem in problems), problems


def test_the_section_off_is_never_checked():
    cfg = config(_target_="dtrain.learners.data_parallel_distributed_learner")
    cfg.fault_tolerance.enabled = False
    assert fault_tolerance_problems(cfg) == []


def test_a_learner_built_by_hand_is_refused_the_same_way():
    model = torch.nn.Linear(2, 2)
    learner = LocalSGDLearner(torch.optim.SGD(model.parameters(), lr=0.1), block_size=32, distributed_after=0,
                              overlap=True)
    assert any("learner.overlap=true" in problem for problem in elastic_problems(learner))
    assert elastic_problems(LocalSGDLearner(torch.optim.SGD(model.parameters(), lr=0.1), block_size=32,
                                            distributed_after=0)) == []
    assert not hasattr(DataParallelLearner, "make_elastic")


@pytest.mark.parametrize("value", [1, "yes", "true"])
def test_the_switch_is_true_or_false(value):
    cfg = config()
    cfg.fault_tolerance.enabled = value
    assert fault_tolerance_problems(cfg) == [f"fault_tolerance.enabled={value!r}: expected true or false"]
