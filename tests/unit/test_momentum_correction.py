"""The block learners' momentum correction: the outer state follows the inner learning-rate schedule.

With ``momentum_correction`` (on in ``learner=block_momentum`` and ``learner=diloco``), each sync
first multiplies the outer state (BMUF's ``sg``, DiLoCo's velocity ``v``) by the ratio of this
block's inner learning rate (the mean over its local steps) to the last block's
(``docs/semantics.md#momentum-correction``). The tests compare a learner with the correction against
one without it whose outer state the test scales by hand between the two syncs: the same operation
on the same values, so the models must agree bit for bit.
"""
from __future__ import annotations

import copy
import io
import math

import pytest
import torch
from torch import nn

from tests.helpers.bmuf_reference import flat, train_learner_shares
from tests.helpers.thread_world import FakeWorld

from dtrain.comm.local import LocalCommunicator
from dtrain.learners import BlockMomentumLearner, DiLoCoLearner, block_momentum_distributed_learner

generator = torch.Generator().manual_seed(11)
FEATURES = torch.randn(512, 3, generator=generator, dtype=torch.float64)
TARGETS = torch.randn(512, 2, generator=generator, dtype=torch.float64)
BLOCK, MINIBATCH = 16, 8  # two global minibatches per block
#: per global minibatch: a block at 0.02, a block that drops mid-way, two blocks at 0.005
SCHEDULE = [0.02, 0.02, 0.02, 0.005, 0.005, 0.005, 0.005, 0.005]
BLOCK_MEANS = [0.02, (0.02 + 0.005) / 2, 0.005, 0.005]


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 2)).double()


def local_loss(model: nn.Module, start: int, stop: int) -> torch.Tensor:
    return nn.functional.mse_loss(model(FEATURES[start:stop]), TARGETS[start:stop])


LEARNERS = {
    # BMUF at 2 workers with its defaults (block momentum 0.5, Nesterov), AdamW local steps
    "block_momentum": (BlockMomentumLearner, dict()),
    # BMUF with DiLoCo's momentum 0.9, no Nesterov (where the correction matters most)
    "block_momentum_0.9": (BlockMomentumLearner, dict(block_momentum_as_time_constant=-BLOCK / math.log(0.9),
                                                      use_nesterov_momentum=False,
                                                      reset_sgd_momentum_after_aggregation=False)),
    "diloco": (DiLoCoLearner, dict()),
}


def run(name: str, schedule: list[float], correction: bool, scale_by_hand: bool = False) -> list[torch.Tensor]:
    """Two threaded workers train ``schedule`` (one lr per global minibatch); returns each rank's
    final model. ``scale_by_hand``: after every sync, multiply the outer state by the next block's
    mean lr over this block's (what the correction does at the start of the next sync)."""
    learner_class, options = LEARNERS[name]
    models = [make_model() for _ in range(2)]

    def worker(comm):
        model = models[comm.rank]
        optimizer = torch.optim.AdamW(model.parameters(), lr=schedule[0], weight_decay=0.01)
        learner = learner_class(optimizer, comm, block_size=BLOCK, distributed_after=0,
                                momentum_correction=correction, **options)
        learner.prepare(model)
        position = 0

        def after_sync():
            block = learner.syncs
            if scale_by_hand and block < len(BLOCK_MEANS):
                learner.smoothed_gradient.mul_(BLOCK_MEANS[block] / BLOCK_MEANS[block - 1])

        for lr in schedule:
            for group in optimizer.param_groups:
                group["lr"] = lr
            position = train_learner_shares(learner, model, local_loss, [MINIBATCH], on_sync=after_sync,
                                            position=position)
        assert learner.syncs == len(schedule) * MINIBATCH // BLOCK
        return flat(model.parameters())

    return FakeWorld(2).run(worker)


@pytest.mark.parametrize("name", sorted(LEARNERS))
def test_a_constant_learning_rate_leaves_the_update_unchanged(name):
    """A factor of exactly 1: the same model, bit for bit, with the correction on or off."""
    constant = [0.02] * len(SCHEDULE)
    with_correction, without = run(name, constant, True), run(name, constant, False)
    assert all(torch.equal(a, b) for a, b in zip(with_correction, without))


@pytest.mark.parametrize("name", sorted(LEARNERS))
def test_the_outer_state_is_scaled_by_the_ratio_of_block_learning_rates(name):
    """A drop mid-block counts as the block's mean lr; the result is the uncorrected learner's with
    its outer state scaled by hand, and differs from the uncorrected one."""
    corrected = run(name, SCHEDULE, True)
    by_hand = run(name, SCHEDULE, False, scale_by_hand=True)
    uncorrected = run(name, SCHEDULE, False)
    assert torch.equal(corrected[0], corrected[1])  # one model on every rank
    assert all(torch.equal(a, b) for a, b in zip(corrected, by_hand))
    assert (corrected[0] - uncorrected[0]).abs().max() > 1e-6


def train_one_worker(learner, model, lrs, start_step=0):
    for step, lr in enumerate(lrs, start=start_step):
        for group in learner.optimizer.param_groups:
            group["lr"] = lr
        learner.begin_minibatch(MINIBATCH, MINIBATCH)
        local_loss(model, MINIBATCH * step, MINIBATCH * (step + 1)).backward()
        learner.step()


def one_worker_diloco(saved: dict | None = None, **options):
    """A one-worker DiLoCo learner (its outer step moves the model even alone) and its model, prepared;
    from ``saved`` (``{"learner": ..., "model": ...}``) when given."""
    model = make_model()
    if saved is not None:
        saved = copy.deepcopy(saved)  # the optimizer keeps the loaded tensors: each learner its own
        model.load_state_dict(saved["model"])
    learner = DiLoCoLearner(torch.optim.AdamW(model.parameters(), lr=0.02), LocalCommunicator(), block_size=BLOCK,
                            distributed_after=0, **options)
    if saved is not None:
        learner.load_state_dict(saved["learner"])
    learner.prepare(model)
    return learner, model


def saved_state(learner, model) -> dict:
    buffer = io.BytesIO()
    torch.save({"learner": learner.state_dict(), "model": model.state_dict()}, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def test_a_resume_keeps_the_last_block_learning_rate():
    """The last block's lr is in the checkpoint: a run resumed just before the schedule's drop
    corrects at its next sync as the uninterrupted run does, bit for bit."""
    learner, model = one_worker_diloco()
    train_one_worker(learner, model, SCHEDULE[:4])
    saved = saved_state(learner, model)
    train_one_worker(learner, model, SCHEDULE[4:], start_step=4)

    assert saved["learner"]["block"]["previous_block_lr"] == BLOCK_MEANS[1]
    resumed, model2 = one_worker_diloco(saved)
    train_one_worker(resumed, model2, SCHEDULE[4:], start_step=4)
    assert torch.equal(flat(model2.parameters()), flat(model.parameters()))


def test_a_checkpoint_from_before_the_correction_starts_uncorrected():
    """A checkpoint written before the correction has no recorded lr: its first sync after the resume
    is the uncorrected one (the lr drops in that block), the later ones are corrected."""
    learner, model = one_worker_diloco()
    train_one_worker(learner, model, SCHEDULE[:2])
    saved = saved_state(learner, model)
    del saved["learner"]["block"]["block_lr"], saved["learner"]["block"]["previous_block_lr"]

    resumed, model_resumed = one_worker_diloco(saved)
    assert resumed.previous_block_lr is None and resumed.block_lr.mean() is None
    uncorrected, model_uncorrected = one_worker_diloco(saved, momentum_correction=False)
    train_one_worker(resumed, model_resumed, SCHEDULE[2:4], start_step=2)
    train_one_worker(uncorrected, model_uncorrected, SCHEDULE[2:4], start_step=2)
    assert torch.equal(flat(model_resumed.parameters()), flat(model_uncorrected.parameters()))
    assert resumed.previous_block_lr == BLOCK_MEANS[1]  # recorded from here on


def test_defaults_and_bad_values():
    """On in the learners (and their configs), off in CNTK's factory (CNTK's update literally); a
    value that is not a bool is refused naming the setting."""
    model = make_model()
    assert BlockMomentumLearner(torch.optim.SGD(model.parameters(), lr=0.1), None, block_size=8).momentum_correction
    assert DiLoCoLearner(torch.optim.SGD(model.parameters(), lr=0.1), None, block_size=8).momentum_correction
    cntk = block_momentum_distributed_learner(torch.optim.SGD(model.parameters(), lr=0.1), None, block_size=8)
    assert not cntk.momentum_correction
    assert "momentum correction on" in DiLoCoLearner(torch.optim.SGD(model.parameters(), lr=0.1), None,
                                                     block_size=8).describe_block()
    for learner_class in (BlockMomentumLearner, DiLoCoLearner):
        with pytest.raises(ValueError, match="momentum_correction"):
            learner_class(torch.optim.SGD(model.parameters(), lr=0.1), None, block_size=8, momentum_correction="yes")
