"""learner=local_sgd: model averaging every block, against an independent reference.

Workers run as threads (``FakeWorld``). The reference trains N model copies in one process and,
whenever the most-loaded worker has trained ``block_size // N`` samples, replaces every copy by
``torch.stack(models).mean(0)``: the definition of local SGD, not the learner's code.
"""
from __future__ import annotations

import copy
import math

import pytest
import torch
from hydra.utils import instantiate
from torch import nn

from tests.helpers.bmuf_reference import flat, train_learner_shares
from tests.helpers.config import compose_config
from tests.helpers.thread_world import FakeWorld

from dtrain.comm.local import LocalCommunicator
from dtrain.config import validate
from dtrain.data.partition import partition_slice
from dtrain.exchange import AllReduce, Quantized
from dtrain.learners import LocalSGDLearner

TOLERANCE = 1e-12  # float64: only the order of the sums differs from the reference
generator = torch.Generator().manual_seed(7)
FEATURES = torch.randn(512, 3, generator=generator, dtype=torch.float64)
TARGETS = torch.randn(512, 2, generator=generator, dtype=torch.float64)


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 2)).double()


def sgd(parameters):
    return torch.optim.SGD(parameters, lr=0.1, momentum=0.9)


def local_loss(model: nn.Module, start: int, stop: int) -> torch.Tensor:
    return nn.functional.mse_loss(model(FEATURES[start:stop]), TARGETS[start:stop])


def reference(size: int, global_sizes: list[int], block_size: int) -> list[torch.Tensor]:
    """The averaged model after every sync (and a last one for a partial block)."""
    models = [make_model() for _ in range(size)]
    optimizers = [sgd(model.parameters()) for model in models]
    position = largest = 0
    averages = []

    def average():
        mean = torch.stack([flat(model.parameters()) for model in models]).mean(0)
        for model in models:
            torch.nn.utils.vector_to_parameters(mean.clone(), model.parameters())
        averages.append(mean)

    for global_size in global_sizes:
        for rank, (model, optimizer) in enumerate(zip(models, optimizers)):
            start, stop = partition_slice(position, global_size, size, rank)
            optimizer.zero_grad()
            if stop > start:
                local_loss(model, start, stop).backward()
                optimizer.step()
        position += global_size
        largest += math.ceil(global_size / size)
        if largest >= block_size // size:
            average()
            largest = 0
    if largest:
        average()
    return averages


def run_workers(size: int, global_sizes: list[int], make_exchange=lambda: None, **options):
    """Per rank: the model after every sync, and the learner."""
    models = [make_model() for _ in range(size)]

    def worker(comm):
        model = models[comm.rank]
        learner = LocalSGDLearner(sgd(model.parameters()), comm, exchange=make_exchange(), **options)
        learner.prepare(model)
        snapshots = []
        train_learner_shares(learner, model, local_loss, global_sizes,
                             on_sync=lambda: snapshots.append(flat(model.parameters())))
        if learner.global_samples_in_block:
            learner.synchronize()
            snapshots.append(flat(model.parameters()))
        learner.finalize()
        return snapshots, learner

    return FakeWorld(size).run(worker)


@pytest.mark.parametrize("size,global_sizes,block_size", [(2, [8] * 12, 24), (3, [7] * 11, 21)])
def test_every_sync_makes_every_rank_the_mean_of_the_workers_models(size, global_sizes, block_size):
    results = run_workers(size, global_sizes, block_size=block_size, distributed_after=0)
    expected = reference(size, global_sizes, block_size)
    for snapshots, learner in results:
        assert learner.syncs == len(expected) and len(snapshots) == len(expected)
        for got, want in zip(snapshots, expected):
            assert (got - want).abs().max() <= TOLERANCE
    for per_rank in zip(*(snapshots for snapshots, _ in results)):
        assert all(torch.equal(per_rank[0], other) for other in per_rank[1:])  # identical on every rank


def test_a_lossy_exchange_averages_approximately_and_keeps_the_ranks_identical():
    results = run_workers(2, [8] * 12, lambda: Quantized(num_bits=8), block_size=24, distributed_after=0)
    expected = reference(2, [8] * 12, 24)
    (first, learner), (second, _) = results
    assert learner.syncs == len(expected) and learner.bytes_sent_last_step > 0 and learner.compression_ratio > 1
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    assert 0 < (first[0] - expected[0]).abs().max() < 1e-2  # 8-bit deltas: close to the mean, not exactly it


def test_resume_with_a_quantized_exchange_is_bit_identical():
    """state_dict (W_prev, counters) and each rank's local state (momentum, residuals) carry a run on
    from a checkpoint taken mid-block, as the session takes it (after ``synchronize``)."""
    steps = [8] * 12
    models = [make_model() for _ in range(2)]

    def worker(comm):
        model = models[comm.rank]
        learner = LocalSGDLearner(sgd(model.parameters()), comm, block_size=24, distributed_after=0,
                                  exchange=Quantized(num_bits=2))
        learner.prepare(model)
        position = train_learner_shares(learner, model, local_loss, steps[:5])
        learner.synchronize()  # mid-block: the session synchronizes before every checkpoint
        # a deep copy, as a checkpoint file is: optimizer.state_dict() holds the live momentum buffers
        saved = copy.deepcopy((learner.state_dict(), learner.local_state_dict(), model.state_dict()))
        train_learner_shares(learner, model, local_loss, steps[5:], position=position)
        learner.finalize()

        again = make_model()
        again.load_state_dict(saved[2])
        resumed = LocalSGDLearner(sgd(again.parameters()), comm, block_size=24, distributed_after=0,
                                  exchange=Quantized(num_bits=2))
        resumed.load_state_dict(saved[0])
        resumed.load_local_state_dict(saved[1])
        resumed.prepare(again)
        train_learner_shares(resumed, again, local_loss, steps[5:], position=position)
        resumed.finalize()
        return flat(model.parameters()), flat(again.parameters()), saved[1]["exchange"]

    for uninterrupted, resumed, exchange_state in FakeWorld(2).run(worker):
        assert exchange_state["per_key"], "no residuals were saved: the test would not exercise them"
        assert torch.equal(uninterrupted, resumed)


def test_one_worker_keeps_its_model_and_the_preset_builds_the_learner():
    model = make_model()
    learner = LocalSGDLearner(sgd(model.parameters()), LocalCommunicator(), block_size=8, distributed_after=0)
    learner.prepare(model)
    position = train_learner_shares(learner, model, local_loss, [8] * 3)
    assert learner.syncs == 3 and position == 24 and learner.smoothed_gradient is None
    cfg = compose_config("+recipe=digits", "learner=local_sgd", "learner/exchange=quantized",
                         "learner.exchange.num_bits=4", "learner.block_size=640")
    assert not validate(cfg)
    built = instantiate(cfg.learner, optimizer=sgd(make_model().parameters()), comm=LocalCommunicator())
    assert type(built) is LocalSGDLearner and built.exchange.num_bits == 4 and built.block_size == 640
    assert isinstance(LocalSGDLearner(sgd(make_model().parameters()), block_size=8).exchange, AllReduce)
    problems = validate(compose_config("+recipe=digits", "learner=local_sgd", "learner.block_size=-1"))
    assert any(problem.startswith("learner.block_size=-1") for problem in problems), problems
