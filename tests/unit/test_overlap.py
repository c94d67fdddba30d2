"""The overlapped outer step (``learner.overlap=true``, ``dtrain/learners/overlap.py``): each block's exchange runs
while the next block trains, and its outer step is taken one block late with every worker's progress moved onto it.
Checked step by step against the documented update computed here, on two threaded workers, with DiLoCo's outer
Nesterov SGD and with block momentum's filter; and the bad input."""
from __future__ import annotations

import pytest
import torch

from dtrain.learners import BlockMomentumLearner, DiLoCoLearner, TwoLevelDiLoCoLearner
from dtrain.learners.outer import BlockMomentumFilter

from tests.helpers.bmuf_reference import flat
from tests.helpers.thread_world import FakeWorld

START = torch.linspace(-1.0, 1.0, 8)
STEPS = 4


def _model(start: torch.Tensor) -> torch.nn.Linear:
    model = torch.nn.Linear(3, 2)
    torch.nn.utils.vector_to_parameters(start.clone(), model.parameters())
    return model


def _inner_step(model: torch.nn.Linear, rank: int, step: int) -> None:
    """One plain SGD step of a worker on its own data (4 samples: the block of 8 ends after every step)."""
    model.zero_grad()
    model(torch.full((4, 3), 0.1 * (rank + 1) * (step + 1))).square().sum().backward()
    torch.optim.SGD(model.parameters(), lr=0.05).step()


def _learner(kind: str, model, comm, **extra):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    if kind == "diloco":
        return DiLoCoLearner(optimizer, comm, block_size=8, distributed_after=0, overlap=True, **extra)
    return BlockMomentumLearner(optimizer, comm, block_size=8, distributed_after=0, overlap=True, **extra)


def _outer(kind: str, parameter: torch.Tensor):
    if kind == "diloco":
        return torch.optim.SGD([parameter], lr=0.7, momentum=0.9, nesterov=True), False
    time_constant = -8 / torch.log(torch.tensor(0.5)).item()  # CNTK's default for 2 workers
    outer = BlockMomentumFilter([parameter], lr=1.0, time_constant=time_constant, nesterov=True)
    outer.param_groups[0].update(workers=2, samples_in_block=8)
    return outer, True


def _reference(kind: str) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The module docstring's steps 1-4 for two workers, and the flush of ``synchronize()`` at the end."""
    previous = START.clone()
    outer, sums = _outer(kind, previous)
    workers = [START.clone(), START.clone()]
    bases = [START.clone(), START.clone()]
    pending = None
    history = []
    for step in range(STEPS):
        for rank in range(2):
            model = _model(workers[rank])
            _inner_step(model, rank, step)
            workers[rank] = flat(model.parameters())
        if pending is not None:  # 1. the last block's outer step
            previous.grad = pending if sums else pending / 2
            outer.step()
            previous.grad = None
        progress = [workers[rank] - bases[rank] for rank in range(2)]  # 2.
        workers = [previous + p for p in progress]  # 3.
        bases = [w.clone() for w in workers]
        pending = -(progress[0] + progress[1])  # 4.
        history.append(workers[0].clone())
    previous.grad = pending if sums else pending / 2  # synchronize(): the step in flight taken
    outer.step()
    return history, previous.detach().clone()


@pytest.mark.parametrize("kind", ["diloco", "block_momentum"])
def test_each_block_steps_with_the_last_blocks_sum_and_moves_each_workers_progress_onto_it(kind):
    def work(comm):
        model = _model(START)
        learner = _learner(kind, model, comm)
        if kind == "block_momentum":
            learner.reset_sgd_momentum_after_aggregation = False  # plain SGD inner steps: nothing to reset
        learner.prepare(model)
        history = []
        for step in range(STEPS):
            learner.begin_minibatch(4, 8)
            model(torch.full((4, 3), 0.1 * (comm.rank + 1) * (step + 1))).square().sum().backward()
            learner.step()
            history.append(flat(model.parameters()))
        assert learner.syncs == STEPS and learner._overlap.pending is not None  # the last block's sum in flight
        learner.synchronize()
        assert learner._overlap.pending is None
        state = learner.state_dict()  # nothing in flight: a checkpoint may be written
        learner.finalize()
        return history, flat(model.parameters()), state["block"]["prev_parameters"]

    expected_history, expected_final = _reference(kind)
    results = FakeWorld(2).run(work)
    for rank, (history, final, previous) in enumerate(results):
        if rank == 0:  # rank 1's intermediate models hold its own progress
            for step, (got, want) in enumerate(zip(history, expected_history)):
                assert torch.allclose(got, want, atol=1e-6), (kind, step, (got - want).abs().max())
        assert torch.allclose(final, expected_final, atol=1e-6), (kind, rank, (final - expected_final).abs().max())
        assert torch.equal(previous, final)
    assert torch.equal(results[0][1], results[1][1])  # one model after synchronize()
    assert not torch.allclose(results[0][0][1], results[1][0][1])  # the workers did train apart between syncs


def test_a_checkpoint_with_a_step_in_flight_is_refused_and_overlap_is_refused_where_it_cannot_run():
    def work(comm):
        model = _model(START)
        learner = _learner("diloco", model, comm)
        learner.prepare(model)
        learner.begin_minibatch(4, 8)
        model(torch.ones(4, 3)).sum().backward()
        learner.step()
        with pytest.raises(RuntimeError, match="in flight: call synchronize"):
            learner.state_dict()
        learner.synchronize()
        learner.finalize()
        return True

    assert FakeWorld(2).run(work) == [True, True]
    with pytest.raises(ValueError, match="overlap=1: expected true or false|overlap"):
        DiLoCoLearner(torch.optim.SGD(_model(START).parameters(), lr=0.1), None, block_size=8, overlap=1)

    def two_level(comm):
        with pytest.raises(ValueError, match="learner.overlap=true: the two-level learners do not overlap"):
            TwoLevelDiLoCoLearner(torch.optim.SGD(_model(START).parameters(), lr=0.1), comm, block_size=8,
                                  overlap=True, ranks_per_host=1)
        return True

    assert FakeWorld(2).run(two_level) == [True, True]
