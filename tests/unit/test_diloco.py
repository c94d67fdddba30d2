"""DiLoCo's outer step against an independent reference: torch's own SGD with Nesterov momentum.

N workers run as threads (``FakeWorld``), each with its own model copy, AdamW inner optimizer
and ``DiLoCoLearner``. The reference (``tests/helpers/diloco_reference.py``) trains N model copies in one
process and makes every outer step with ``torch.optim.SGD(lr, momentum, nesterov=True)`` on
``p.grad = W_prev - mean_i W_i``, parameter by parameter: DiLoCo's definition
(arXiv 2311.08105, Algorithm 1), not the learner's code.
"""
from __future__ import annotations

import io

import pytest
import torch
from torch import nn

from tests.helpers.bmuf_reference import flat, simulate_bmuf, train_learner_shares
from tests.helpers.diloco_reference import simulate_diloco
from tests.helpers.thread_world import FakeWorld

from dtrain.comm.local import LocalCommunicator
from dtrain.learners import BlockMomentumLearner, DiLoCoLearner
from dtrain.learners.outer import saved_first_moment

TOLERANCE = 1e-12  # float64 models: only the order of the sums differs from the reference
generator = torch.Generator().manual_seed(5)
FEATURES = torch.randn(512, 3, generator=generator, dtype=torch.float64)
TARGETS = torch.randn(512, 2, generator=generator, dtype=torch.float64)


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 2)).double()


def adamw(parameters):
    return torch.optim.AdamW(parameters, lr=0.02, weight_decay=0.01)


def local_loss(model: nn.Module, start: int, stop: int) -> torch.Tensor:
    return nn.functional.mse_loss(model(FEATURES[start:stop]), TARGETS[start:stop])


def simulate(size: int, global_sizes: list[int], **options):
    """The reference (tests/helpers/diloco_reference.py) on this file's model, optimizer and data."""
    models = [make_model() for _ in range(size)]
    return simulate_diloco(models, [adamw(model.parameters()) for model in models], local_loss, global_sizes,
                           **options)


def run_workers(size: int, global_sizes: list[int], options: dict, learner_class=DiLoCoLearner, optimizer=adamw):
    """Trains ``size`` threaded workers; returns per rank (snapshots, final, learner, model)."""
    models = [make_model() for _ in range(size)]

    def worker(comm):
        model = models[comm.rank]
        learner = learner_class(optimizer(model.parameters()), comm, **options)
        learner.prepare(model)
        snapshots = []
        train_learner_shares(learner, model, local_loss, global_sizes,
                             on_sync=lambda: snapshots.append(flat(model.parameters())))
        if learner.global_samples_in_block:
            learner.synchronize()
            snapshots.append(flat(model.parameters()))
        return snapshots, flat(model.parameters()), learner, model

    if size == 1:
        return [worker(LocalCommunicator())]
    return FakeWorld(size).run(worker)


CASES = {
    # name: (workers, global minibatch sizes, learner options)
    "two_workers": (2, [8] * 12, dict(block_size=24)),
    "three_workers_uneven": (3, [7] * 12, dict(block_size=21, outer_learning_rate=0.5, outer_momentum=0.8)),
    "one_worker": (1, [8] * 9, dict(block_size=16)),
    "no_nesterov": (2, [8] * 12, dict(block_size=24, outer_nesterov=False)),
    "warm_start": (2, [8] * 12, dict(block_size=16, distributed_after=24)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_outer_steps_equal_torch_sgd_nesterov_on_the_mean_delta(case):
    size, global_sizes, options = CASES[case]
    options = {"distributed_after": 0, **options}
    want_snapshots, want_final = simulate(size, global_sizes, **options)
    assert len(want_snapshots) >= 3
    results = run_workers(size, global_sizes, options)
    for rank, (snapshots, final, learner, _) in enumerate(results):
        assert learner.syncs == len(snapshots) == len(want_snapshots), (rank, learner.syncs, len(want_snapshots))
        for index, (got, want) in enumerate(zip(snapshots, want_snapshots)):
            assert torch.allclose(got, want, atol=TOLERANCE, rtol=0), (rank, index, (got - want).abs().max())
        assert torch.allclose(final, want_final, atol=TOLERANCE, rtol=0)
        assert all(torch.equal(mine, ours) for mine, ours in zip(snapshots, results[0][0]))  # one model everywhere


def test_one_outer_step_is_torch_sgd_to_the_last_bit():
    """A single worker (no exchange): the outer step is op for op torch's SGD on W_prev - W."""
    model = make_model()
    learner = DiLoCoLearner(adamw(model.parameters()), LocalCommunicator(), block_size=8, distributed_after=0)
    learner.prepare(model)
    for step in range(4):
        learner.begin_minibatch(8, 8)
        local_loss(model, 8 * step, 8 * step + 8).backward()
        learner.step()  # one block per minibatch: an outer step each time
    assert learner.syncs == 4
    # replay: the learner's W_prev sequence must satisfy torch SGD's recurrence exactly
    model2 = make_model()
    inner2 = adamw(model2.parameters())
    param = torch.cat([p.detach().reshape(-1) for p in model2.parameters()]).clone()
    outer2 = torch.optim.SGD([param], lr=0.7, momentum=0.9, nesterov=True)
    for step in range(4):
        inner2.zero_grad()
        local_loss(model2, 8 * step, 8 * step + 8).backward()
        inner2.step()
        with torch.no_grad():
            param.grad = param - torch.cat([p.reshape(-1) for p in model2.parameters()])
        outer2.step()
        with torch.no_grad():
            offset = 0
            for p in model2.parameters():
                p.copy_(param[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
    assert torch.equal(learner.prev_parameters, param)
    assert torch.equal(learner.smoothed_gradient, outer2.state[param]["momentum_buffer"])


def test_inner_optimizer_state_is_kept_across_syncs():
    """DiLoCo keeps AdamW's moments at a sync (block momentum's default zeroes exp_avg)."""
    results = run_workers(2, [8] * 6, dict(block_size=16, distributed_after=0))
    for _, _, learner, _ in results:
        assert learner.syncs == 3 and learner.reset_sgd_momentum_after_aggregation is False
        assert all(float(state["exp_avg"].abs().sum()) > 0 for state in learner.optimizer.state.values())


def test_without_nesterov_bmuf_with_the_mapped_settings_is_diloco():
    """docs/semantics.md#diloco: bm = mu, block_learning_rate = lr / ((1 - mu) N) (and TC = -B / ln mu),
    with BMUF's local steps at the inner optimizer's full lr, as DiLoCo's."""
    import math
    size, block, lr, mu = 2, 24, 0.7, 0.9
    diloco = run_workers(size, [8] * 12, dict(block_size=block, outer_nesterov=False, distributed_after=0))
    bmuf = run_workers(size, [8] * 12, dict(block_size=block, use_nesterov_momentum=False,
                                            reset_sgd_momentum_after_aggregation=False, local_learning_rate="full",
                                            block_momentum_as_time_constant=-block / math.log(mu),
                                            block_learning_rate=lr / ((1 - mu) * size), distributed_after=0),
                       learner_class=BlockMomentumLearner)
    for got, want in zip(bmuf[0][0], diloco[0][0]):
        assert torch.allclose(got, want, atol=1e-10, rtol=0), (got - want).abs().max()
    # with Nesterov the two differ (BMUF weighs the history by mu (1 + mu), torch by mu^2)
    diloco_nesterov = run_workers(size, [8] * 12, dict(block_size=block, distributed_after=0))
    bmuf_nesterov = run_workers(size, [8] * 12, dict(block_size=block, reset_sgd_momentum_after_aggregation=False,
                                                     local_learning_rate="full",
                                                     block_momentum_as_time_constant=-block / math.log(mu),
                                                     block_learning_rate=lr / ((1 - mu) * size), distributed_after=0),
                                learner_class=BlockMomentumLearner)
    assert torch.allclose(bmuf_nesterov[0][0][0], diloco_nesterov[0][0][0], atol=1e-10, rtol=0)  # first: same
    assert (bmuf_nesterov[0][0][-1] - diloco_nesterov[0][0][-1]).abs().max() > 1e-4


def test_bmuf_reference_is_not_diloco():
    """The reference above is not BMUF's update under another name."""
    models = [make_model() for _ in range(2)]
    bmuf, _ = simulate_bmuf(models, [adamw(model.parameters()) for model in models], local_loss, [8] * 12,
                            block_size=24, reset_sgd_momentum_after_aggregation=False, local_learning_rate="full")
    diloco, _ = simulate(2, [8] * 12, block_size=24)
    assert (bmuf[-1] - diloco[-1]).abs().max() > 1e-3


@pytest.mark.parametrize("written", ["now", "before_outer_optimizers"])
def test_checkpoint_restores_the_outer_momentum_bit_exactly(written):
    """state_dict carries v (and W_prev): a learner restored mid-run continues bit for bit, also from a checkpoint
    written before outer optimizers (v was the block state's one flat tensor, ``smoothed_gradient``)."""
    def train(learner, model, steps, start_step=0):
        for step in range(start_step, start_step + steps):
            learner.begin_minibatch(8, 8)
            local_loss(model, 8 * step, 8 * step + 8).backward()
            learner.step()

    model = make_model()
    learner = DiLoCoLearner(adamw(model.parameters()), LocalCommunicator(), block_size=16, distributed_after=0)
    learner.prepare(model)
    train(learner, model, 6)
    buffer = io.BytesIO()
    torch.save({"learner": learner.state_dict(), "model": model.state_dict()}, buffer)
    train(learner, model, 6, start_step=6)

    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    if written == "before_outer_optimizers":  # the block state as that code wrote it
        block = saved["learner"]["block"]
        block["smoothed_gradient"] = saved_first_moment(block.pop("outer_optimizer"))
        del block["outer_optimizer_type"]
    model2 = make_model()
    model2.load_state_dict(saved["model"])
    resumed = DiLoCoLearner(adamw(model2.parameters()), LocalCommunicator(), block_size=16, distributed_after=0)
    resumed.load_state_dict(saved["learner"])
    resumed.prepare(model2)
    assert float(resumed.smoothed_gradient.abs().sum()) > 0  # the outer momentum came back
    train(resumed, model2, 6, start_step=6)
    assert torch.equal(flat(model2.parameters()), flat(model.parameters()))
    assert torch.equal(resumed.smoothed_gradient, learner.smoothed_gradient)


def test_bad_outer_settings_are_refused():
    model = make_model()
    with pytest.raises(ValueError, match="outer_learning_rate"):
        DiLoCoLearner(adamw(model.parameters()), None, block_size=8, outer_learning_rate=0)
    with pytest.raises(ValueError, match="outer_momentum"):
        DiLoCoLearner(adamw(model.parameters()), None, block_size=8, outer_momentum=1.0)
    with pytest.raises(ValueError, match="outer_nesterov"):
        DiLoCoLearner(adamw(model.parameters()), None, block_size=8, outer_nesterov="yes")


def test_each_rank_restores_its_own_inner_optimizer_state_with_the_configured_settings():
    """Local steps make every rank's AdamW moments different: they are per-rank state (rank 0's
    alone in state_dict would give rank 1 the wrong moments on resume)."""
    results = run_workers(2, [8] * 5, dict(block_size=16, distributed_after=0))
    states = [learner.local_state_dict()["optimizer"]["state"] for _, _, learner, _ in results]
    assert not torch.equal(states[0][0]["exp_avg"], states[1][0]["exp_avg"])
    saved = results[1][2].local_state_dict()
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.005, weight_decay=0.01)  # a changed setting
    restored = DiLoCoLearner(optimizer, LocalCommunicator(), block_size=16)
    restored.load_local_state_dict(saved)
    assert torch.equal(optimizer.state_dict()["state"][0]["exp_avg"], states[1][0]["exp_avg"])
    assert optimizer.param_groups[0]["lr"] == 0.005  # the configured value, not the saved one
