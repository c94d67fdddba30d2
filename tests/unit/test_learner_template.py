"""The learner template: ``Learner.step`` is final and always advances the sample clock.

A learner written against the public bases implements only its update; training still stops at
``max_samples`` (a learner that had to advance ``samples_seen`` itself and forgot trained 3,198
minibatches for ``max_samples=64``), and a subclass that overrides ``step`` is refused.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from dtrain import MinibatchSource, training_session
from dtrain.comm.local import LocalCommunicator
from dtrain.data import ArrayDeserializer
from dtrain.learners import Learner, LocalLearner, ReplicatedLearner

from tests.helpers.thread_world import FakeWorld


def make_data(num_samples: int = 200) -> ArrayDeserializer:
    generator = np.random.default_rng(0)
    features = generator.normal(size=(num_samples, 6)).astype(np.float32)
    labels = (features[:, 0] > 0).astype(np.int64)
    return ArrayDeserializer(features, labels, num_classes=2)


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 2))


def train(model: nn.Module, learner: Learner, max_samples: int, run_dir: Path) -> None:
    training_session(model, nn.functional.cross_entropy, learner, MinibatchSource(make_data(), randomize=False),
                     16, max_samples=max_samples, run_dir=run_dir, tensorboard=False).train()


class CountingLearner(Learner):
    """Written against the base: implements only the update, never touches samples_seen."""

    def __init__(self, optimizer, comm=None):
        super().__init__(optimizer, comm)
        self.updates = 0

    def apply_update(self) -> None:
        self.updates += 1
        self.optimizer.step()


class AveragingLearner(ReplicatedLearner):
    """Written against the public replicated base: implements only the distributed update."""

    kind = "averaging"

    def __init__(self, optimizer, comm):
        super().__init__(optimizer, comm)
        self.distributed_updates = 0

    def distributed_update(self) -> None:
        self.distributed_updates += 1
        for parameter in self.parameters:
            self.comm.allreduce(parameter.grad, op="mean")
        self.optimizer.step()


def test_a_learner_implementing_only_the_update_trains_to_max_samples_and_stops(tmp_path):
    model = make_model()
    learner = CountingLearner(torch.optim.SGD(model.parameters(), lr=0.1))
    train(model, learner, 64, tmp_path)
    assert learner.samples_seen == 64
    assert learner.updates == 4  # 64 samples in minibatches of 16, not thousands


def test_a_replicated_learner_implementing_only_distributed_update_stops_with_one_model(tmp_path):
    def work(comm):
        model = make_model()
        learner = AveragingLearner(torch.optim.SGD(model.parameters(), lr=0.1), comm)
        training_session(model, nn.functional.cross_entropy, learner, MinibatchSource(make_data(), randomize=False),
                         16, max_samples=64, run_dir=tmp_path / str(comm.rank), tensorboard=False).train()
        return learner.samples_seen, learner.distributed_updates, [p.detach().clone() for p in model.parameters()]

    (seen0, updates0, params0), (seen1, updates1, params1) = FakeWorld(2).run(work)
    assert (seen0, updates0) == (seen1, updates1) == (64, 4)
    assert all(torch.equal(a, b) for a, b in zip(params0, params1))


def test_a_subclass_overriding_step_is_refused_when_defined():
    with pytest.raises(TypeError, match=r"overrides Learner.step\(\), which is final.*implement apply_update\(\)"):
        class ForgetfulLearner(ReplicatedLearner):  # noqa: F841 - the definition itself must fail
            def step(self) -> None:
                self.optimizer.step()


def test_the_base_learner_is_abstract_and_names_what_to_implement():
    model = make_model()
    with pytest.raises(TypeError, match="apply_update"):
        Learner(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(TypeError, match="distributed_update"):
        ReplicatedLearner(torch.optim.SGD(model.parameters(), lr=0.1))


def test_only_the_local_learner_refuses_several_processes():
    model = make_model()

    class TwoRanks(LocalCommunicator):
        size = 2

    with pytest.raises(ValueError, match="the local learner trains one process but this job has 2"):
        LocalLearner(torch.optim.SGD(model.parameters(), lr=0.1), TwoRanks()).prepare(model)
    CountingLearner(torch.optim.SGD(model.parameters(), lr=0.1), TwoRanks()).prepare(model)  # the base refuses nothing


def test_a_learner_without_a_kind_is_named_by_its_class():
    assert CountingLearner.kind == "CountingLearner"
    assert AveragingLearner.kind == "averaging"
    assert LocalLearner.kind == "local"
