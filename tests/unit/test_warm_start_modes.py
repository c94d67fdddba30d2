"""How a compressing exchange's warm start trains: float32 all-reduce (default) or CNTK's local steps."""
from __future__ import annotations

import pytest
import torch
from hydra.utils import instantiate

from dtrain.comm import LocalCommunicator
from dtrain.config import validate
from dtrain.exchange import Quantized
from dtrain.learners import DataParallelLearner, data_parallel_distributed_learner
from tests.helpers.thread_world import FakeWorld
from tests.helpers.config import compose_config


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.ReLU(), torch.nn.Linear(32, 3))


def train(comm, warm_start: str, steps: int = 5):
    """2-bit learner, warm start of 32 samples (3 steps of 13), on rank-specific data."""
    model = make_model(seed=comm.rank)
    learner = DataParallelLearner(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), comm,
                                  distributed_after=32, exchange=Quantized(2), warm_start_mode=warm_start)
    learner.prepare(model)
    generator, local_sizes, snapshots, partitions = torch.Generator().manual_seed(comm.rank), (8, 5), [], []
    for _ in range(steps):
        partitions.append(learner.data_partition())
        learner.begin_minibatch(local_sizes[comm.rank], sum(local_sizes))
        features = torch.randn(local_sizes[comm.rank], 20, generator=generator)
        labels = torch.randint(0, 3, (local_sizes[comm.rank],), generator=generator)
        torch.nn.functional.cross_entropy(model(features), labels).backward()
        learner.step()
        snapshots.append(torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()]))
    return snapshots, partitions, learner.describe()


def test_local_warm_start_trains_each_rank_on_the_full_stream_then_broadcasts_rank_zero():
    (first, partitions, line), (second, _, _) = FakeWorld(2).run(lambda comm: train(comm, "local"))
    assert partitions == [(1, 0)] * 3 + [(2, 0)] * 2  # the full stream while warm, then its share
    assert not torch.equal(first[2], second[2])  # local steps on different data drift apart
    assert torch.equal(first[3], second[3]) and torch.equal(first[4], second[4])  # one model again
    assert "local training on the full stream for the first 32 samples" in line, line


def test_allreduce_warm_start_reads_shares_and_keeps_one_model():
    (first, partitions, line), (second, _, _) = FakeWorld(2).run(lambda comm: train(comm, "allreduce"))
    assert partitions == [(2, 0)] * 5
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    assert "warm start of 32 samples with float32 all-reduce" in line, line


def test_a_warm_start_that_is_neither_is_refused_in_one_line():
    model = make_model(seed=0)
    with pytest.raises(ValueError, match=r"^warm_start_mode='cntk': expected one of allreduce, local$"):
        data_parallel_distributed_learner(torch.optim.SGD(model.parameters(), lr=0.1), num_quantization_bits=1,
                                          warm_start_mode="cntk")
    problems = validate(compose_config("+recipe=digits", "learner=quantized", "learner.warm_start_mode=cntk"))
    assert "learner.warm_start_mode='cntk': expected one of allreduce, local" in problems, problems


def test_the_config_reaches_the_learner(tmp_path):
    cfg = compose_config("+recipe=digits", "learner=quantized", "learner.warm_start_mode=local")
    assert validate(cfg) == []
    model = make_model(seed=0)
    learner = instantiate(cfg.learner, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                          comm=LocalCommunicator())
    assert type(learner) is DataParallelLearner and learner.warm_start_mode == "local"
    assert learner.warm_start_exchange is None and learner.exchange.num_bits == 1


def test_warm_start_mode_is_the_one_name_apart_from_powersgds_boolean():
    """One name per concept: the learner's ``warm_start_mode`` (allreduce|local); ``warm_start``, its
    old spelling, is refused naming it; PowerSGD's boolean ``learner.exchange.warm_start`` is another setting."""
    model = make_model(seed=0)
    old = compose_config("+recipe=digits", "learner=quantized", "+learner.warm_start=local")
    assert validate(old) == ["learner.warm_start=local: no longer a learner setting; write "
                             "learner.warm_start_mode=local"], validate(old)
    powersgd = compose_config("+recipe=digits", "learner=data_parallel", "learner/exchange=powersgd",
                              "learner.exchange.warm_start=false", "learner.warm_start_mode=local")
    assert validate(powersgd) == []
    learner = instantiate(powersgd.learner, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                          comm=LocalCommunicator())
    assert learner.warm_start_mode == "local" and learner.exchange.warm_start is False
