"""Block momentum (BMUF) against a separate, direct implementation of CNTK's formulas.

N workers are simulated in one process: each runs in its own thread with its own model copy,
optimizer and learner, and a ``FakeComm`` whose all-reduce sums over the threads. The
reference (``simulate``) applies ``docs/semantics.md#block-momentum`` parameter by parameter with plain tensors.
"""
from __future__ import annotations

import io

import pytest
import torch
from torch import nn

from dtrain.comm.local import LocalCommunicator
from dtrain.data.partition import partition_slice
from dtrain.learners import BlockMomentumLearner, block_momentum_distributed_learner, data_parallel_distributed_learner
from dtrain.learners.block_momentum import default_time_constant
from dtrain.schedules import momentum_from_time_constant
from dtrain.learners.outer import saved_first_moment

from tests.helpers.bmuf_reference import flat, simulate_bmuf, train_learner_shares
from tests.helpers.thread_world import FakeComm, FakeWorld

TOLERANCE = 1e-6
NUM_SAMPLES = 256
generator = torch.Generator().manual_seed(7)
FEATURES = torch.randn(NUM_SAMPLES, 3, generator=generator, dtype=torch.float64)
TARGETS = torch.randn(NUM_SAMPLES, 2, generator=generator, dtype=torch.float64)


def make_model(batch_norm: bool = False) -> nn.Module:
    torch.manual_seed(0)
    layers = [nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)]
    if batch_norm:
        layers.insert(1, nn.BatchNorm1d(4))
    return nn.Sequential(*layers).double()


def sgd(parameters):
    return torch.optim.SGD(parameters, lr=0.1, momentum=0.9)


def local_loss(model: nn.Module, start: int, stop: int) -> torch.Tensor:
    return nn.functional.mse_loss(model(FEATURES[start:stop]), TARGETS[start:stop])


# -- N simulated workers, one thread each ---------------------------------------------------------
def run_workers(size: int, global_sizes: list[int], options: dict, batch_norm: bool = False, before_sync=None):
    """Trains ``size`` threaded workers with the learner; returns per rank (snapshots, final, learner, comm, model)."""
    models = [make_model(batch_norm) for _ in range(size)]  # here: the global RNG is not thread-safe

    def worker(comm: FakeComm):
        model = models[comm.rank]
        learner = BlockMomentumLearner(sgd(model.parameters()), comm, **options)
        learner.prepare(model)
        snapshots = []
        train_learner_shares(learner, model, local_loss, global_sizes,
                             on_sync=lambda: snapshots.append(flat(model.parameters())))
        if before_sync is not None:
            before_sync(comm.rank, model)
        learner.synchronize()
        return snapshots, flat(model.parameters()), learner, comm, model

    return FakeWorld(size).run(worker)


# -- the reference (tests/_bmuf_reference.py) on this file's model, optimizer and data -------------
def simulate(size: int, global_sizes: list[int], **options):
    """Direct BMUF: returns (parameters after each sync, final parameters) of the common model."""
    models = [make_model() for _ in range(size)]
    return simulate_bmuf(models, [sgd(model.parameters()) for model in models], local_loss, global_sizes, **options)


def test_the_run_total_of_bytes_sent_counts_every_sync_including_the_final_one():
    for _, _, learner, _, _ in run_workers(2, [8] * 12, dict(block_size=24)):
        assert learner.syncs == 4 and learner.bytes_sent_last_step > 0
        assert learner.bytes_sent_total == 4 * learner.bytes_sent_last_step  # the same float32 sum at every sync


CASES = {
    # name: (workers, global minibatch sizes, learner options, expected syncs incl. the final one)
    "defaults": (2, [8] * 12, dict(block_size=24), 4),
    "one_worker": (1, [8] * 6, dict(block_size=16), 3),
    "no_nesterov": (2, [8] * 12, dict(block_size=24, use_nesterov_momentum=False), 4),
    "no_momentum_reset": (2, [8] * 12, dict(block_size=24, reset_sgd_momentum_after_aggregation=False), 4),
    "time_constant_and_block_lr": (3, [9] * 10, dict(block_size=27, block_momentum_as_time_constant=40.0,
                                                   block_learning_rate=0.7), 4),
    # shares 3 and 4: rank 1 reaches the period 12 after 3 minibatches (21 global samples < 24)
    "uneven_shares": (2, [7] * 10, dict(block_size=24), 4),
    "warm_start": (2, [8] * 12, dict(block_size=24, distributed_after=16), 4),
    # CNTK's local steps (the factory's default): lr x the worker's share, uneven shares included
    "share_of_the_lr": (3, [10] * 10, dict(block_size=30, local_learning_rate="share", distributed_after=20), 3),
}


@pytest.mark.parametrize("case", list(CASES))
def test_threaded_workers_match_the_direct_formulas(case):
    size, global_sizes, options, expected_syncs = CASES[case]
    results = run_workers(size, global_sizes, options)
    reference_snapshots, reference_final = simulate(size, global_sizes, **options)
    assert len(reference_snapshots) == expected_syncs
    common = None
    for rank, (snapshots, final, learner, comm, _) in enumerate(results):
        if learner.syncs > len(snapshots):  # synchronize() at the end made the last sync
            snapshots = snapshots + [final]
        assert learner.syncs == len(snapshots) == expected_syncs, (rank, learner.syncs, len(snapshots))
        # one flat all-reduce per sync, not one per parameter (none at all for one worker)
        assert comm.allreduce_calls == (expected_syncs if size > 1 else 0)
        for index, (got, want) in enumerate(zip(snapshots, reference_snapshots)):
            assert torch.allclose(got, want, atol=TOLERANCE, rtol=0), (rank, index, (got - want).abs().max())
        assert torch.allclose(final, reference_final, atol=TOLERANCE, rtol=0)
        assert torch.equal(learner.prev_parameters, final)
        common = common or snapshots
        assert all(torch.equal(mine, rank0) for mine, rank0 in zip(snapshots, common))  # one model on all ranks


def test_default_time_constant_gives_block_momentum_one_minus_one_over_n():
    for workers in (2, 4, 8):
        time_constant = default_time_constant(4096, workers)
        nominal = 4096 // workers
        assert momentum_from_time_constant(time_constant / workers, nominal) == pytest.approx(1 - 1 / workers)
    assert default_time_constant(4096, 1) == 0.0
    learner = BlockMomentumLearner(sgd(make_model().parameters()), None, block_size=100)
    assert learner.time_constant == 0.0 and learner.sync_period == 100


def train_alone(learner_or_optimizer, model, steps: int, global_size: int = 8, offset: int = 0) -> list:
    """One process: returns the flat parameters after each step (learner or bare optimizer)."""
    trajectory = []
    for step in range(steps):
        start = offset + step * global_size
        if isinstance(learner_or_optimizer, BlockMomentumLearner):
            learner_or_optimizer.begin_minibatch(global_size, global_size)
        else:
            learner_or_optimizer.zero_grad()
        local_loss(model, start, start + global_size).backward()
        learner_or_optimizer.step()
        trajectory.append(flat(model.parameters()))
    return trajectory


def test_single_worker_syncs_leave_the_model_unchanged():
    plain_model = make_model()
    plain = train_alone(sgd(plain_model.parameters()), plain_model, 10)
    model = make_model()
    learner = BlockMomentumLearner(sgd(model.parameters()), LocalCommunicator(), block_size=16,
                                   reset_sgd_momentum_after_aggregation=False)
    learner.prepare(model)
    blocked = train_alone(learner, model, 10)
    assert learner.syncs == 5
    assert all(torch.equal(a, b) for a, b in zip(plain, blocked))  # bit for bit
    assert torch.equal(learner.prev_parameters, blocked[-1])


@pytest.mark.parametrize("reset", [True, False])
def test_sgd_momentum_is_zeroed_at_each_sync_only_when_asked(reset):
    model = make_model()
    optimizer = sgd(model.parameters())
    learner = BlockMomentumLearner(optimizer, None, block_size=16, reset_sgd_momentum_after_aggregation=reset)
    learner.prepare(model)
    train_alone(learner, model, 2)  # 16 samples: one sync after the second step
    assert learner.syncs == 1
    buffers = [optimizer.state[p]["momentum_buffer"] for p in model.parameters()]
    assert all(bool((b == 0).all()) == reset for b in buffers)


def test_adam_first_moment_is_zeroed_and_second_moment_kept():
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    learner = BlockMomentumLearner(optimizer, None, block_size=16)
    learner.prepare(model)
    train_alone(learner, model, 2)
    for parameter in model.parameters():
        state = optimizer.state[parameter]
        assert (state["exp_avg"] == 0).all()
        assert (state["exp_avg_sq"] > 0).any()


def test_batchnorm_buffers_are_averaged_by_synchronize():
    before: dict[int, list[torch.Tensor]] = {}

    def record(rank, model):
        before[rank] = [b.clone() for b in model.buffers() if b.is_floating_point()]

    results = run_workers(2, [8, 8], dict(block_size=64), batch_norm=True, before_sync=record)
    assert not torch.equal(before[0][0], before[1][0])  # different shares, different statistics
    for rank in range(2):
        model = results[rank][4]
        assert results[rank][2].syncs == 1
        floating = [b for b in model.buffers() if b.is_floating_point()]
        for got, mine, theirs in zip(floating, before[0], before[1]):
            assert torch.allclose(got, (mine + theirs) / 2, atol=1e-12)
    assert torch.equal(results[0][1], results[1][1])


def test_checkpoint_round_trip_resumes_bit_for_bit():
    """A restored learner (weights_only load) continues exactly like one that never stopped."""
    options = dict(block_size=16, block_momentum_as_time_constant=30.0)  # bm > 0: sg carries state
    model = make_model()
    learner = BlockMomentumLearner(sgd(model.parameters()), None, **options)
    learner.prepare(model)
    train_alone(learner, model, 5)
    learner.synchronize()  # as the session does before a checkpoint
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "learner": learner.state_dict()}, buffer)
    uninterrupted = train_alone(learner, model, 5, offset=40)

    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    assert saved["learner"]["block"]["global_samples_in_block"] == 0
    assert saved_first_moment(saved["learner"]["block"]["outer_optimizer"]).abs().sum() > 0
    resumed_model = make_model()
    resumed = BlockMomentumLearner(sgd(resumed_model.parameters()), None, **options)
    resumed_model.load_state_dict(saved["model"])
    resumed.load_state_dict(saved["learner"])
    resumed.prepare(resumed_model)
    assert resumed.syncs == 3 and resumed.samples_seen == 40
    continued = train_alone(resumed, resumed_model, 5, offset=40)
    assert all(torch.equal(a, b) for a, b in zip(uninterrupted, continued))


def test_checkpoint_of_another_model_is_refused():
    model = make_model()
    learner = BlockMomentumLearner(sgd(model.parameters()), None, block_size=16)
    learner.prepare(model)
    state = learner.state_dict()
    other = nn.Linear(3, 1).double()
    with pytest.raises(ValueError, match="restore into the model"):
        BlockMomentumLearner(sgd(other.parameters()), None, block_size=16).load_state_dict(state)
    local_state = {"kind": "local", "optimizer": {}, "samples_seen": 0}
    with pytest.raises(ValueError, match="written by the 'local' learner"):
        learner.load_state_dict(local_state)


def test_step_before_prepare_is_refused():
    learner = BlockMomentumLearner(sgd(make_model().parameters()), None, block_size=16)
    with pytest.raises(RuntimeError, match="prepare"):
        learner.step()


# -- CNTK's property: block momentum 0, a block of one minibatch, block lr 1 is data-parallel SGD ---
def train_shares(size: int, build, global_size: int, steps: int) -> torch.Tensor:
    """Trains ``size`` threaded workers with ``build(optimizer_parameters, comm)`` on their shares of
    ``steps`` global minibatches; returns rank 0's final parameters (after ``synchronize``)."""
    models = [make_model() for _ in range(size)]

    def worker(comm: FakeComm):
        model = models[comm.rank]
        learner = build(model.parameters(), comm)
        learner.prepare(model)
        for step in range(steps):
            start, stop = partition_slice(step * global_size, global_size, *learner.data_partition())
            learner.begin_minibatch(stop - start, global_size)
            if stop > start:
                local_loss(model, start, stop).backward()
            learner.step()
        learner.synchronize()
        return flat(model.parameters())

    return FakeWorld(size).run(worker)[0]


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("global_size, optimizer, reset", [
    (7, dict(lr=0.1, weight_decay=0.01), True),   # uneven shares; weight decay steps as the data-parallel one
    (16, dict(lr=0.1, momentum=0.9), False),      # momentum kept across syncs: the summed buffers are the global one
])
def test_block_momentum_zero_with_a_block_of_one_minibatch_is_data_parallel_sgd(size, global_size, optimizer, reset):
    """docs/semantics.md#block-momentum: through the CNTK factory with CNTK's settings (time constant 0, a
    block of one global minibatch, block learning rate 1), each sync applies the sum of the workers' steps
    at their share of the minibatch's learning rate: the data-parallel step."""
    def cntk_block_momentum(**options):
        return lambda parameters, comm: block_momentum_distributed_learner(
            torch.optim.SGD(parameters, **optimizer), comm, block_size=global_size, block_momentum_as_time_constant=0,
            block_learning_rate=1.0, reset_sgd_momentum_after_aggregation=reset, distributed_after=0, **options)

    data_parallel = train_shares(size, lambda parameters, comm: data_parallel_distributed_learner(
        torch.optim.SGD(parameters, **optimizer), comm), global_size, steps=8)
    block_momentum = train_shares(size, cntk_block_momentum(), global_size, steps=8)
    assert torch.allclose(block_momentum, data_parallel, atol=1e-12, rtol=0), \
        (block_momentum - data_parallel).abs().max()
    # at the full lr (learner=block_momentum's default) every worker's step is a whole one: N times as far
    full = train_shares(size, cntk_block_momentum(local_learning_rate="full"), global_size, steps=8)
    assert (full - data_parallel).abs().max() > 1e-2


def test_block_momentum_time_constant_0_is_block_momentum_0():
    learner = BlockMomentumLearner(sgd(make_model().parameters()), FakeComm(FakeWorld(2), 0), block_size=32,
                                   block_momentum_as_time_constant=0)
    assert learner.time_constant == 0.0 and "block momentum 0.0000" in learner.describe()


# -- the factory and its checks ---------------------------------------------------------------------
def test_cntk_misspelt_nesterov_keyword_is_accepted():
    parameters = list(make_model().parameters())
    misspelt = block_momentum_distributed_learner(sgd(parameters), None, 16, use_nestrov_momentum=False)
    assert not misspelt.use_nesterov_momentum
    assert block_momentum_distributed_learner(sgd(parameters), None, 16).use_nesterov_momentum
    same = block_momentum_distributed_learner(sgd(parameters), None, 16, use_nesterov_momentum=False,
                                              use_nestrov_momentum=False)
    assert not same.use_nesterov_momentum and same.kind == "block_momentum"
    with pytest.raises(ValueError, match="disagree"):
        block_momentum_distributed_learner(sgd(parameters), None, 16, use_nesterov_momentum=True,
                                           use_nestrov_momentum=False)
    with pytest.raises(TypeError, match="block_sise"):
        block_momentum_distributed_learner(sgd(parameters), None, 16, block_sise=3)


def test_the_start_up_line_names_the_local_learning_rate_rule_in_effect_and_the_other_entry_points():
    """CNTK's factory steps at lr/N by default, BlockMomentumLearner and learner=block_momentum at lr: one name,
    two rules, so the line says which one this learner follows."""
    def line(build, **options) -> str:
        return build(sgd(make_model().parameters()), FakeComm(FakeWorld(2), 0), block_size=32, **options).describe()

    cntk = line(block_momentum_distributed_learner)
    assert ("local steps at lr x the worker's share of the minibatch, lr/2 at even shares (local_learning_rate=share, "
            "CNTK's per-sample rate: block_momentum_distributed_learner's default; learner=block_momentum and "
            "BlockMomentumLearner default to full)") in cntk
    assert "momentum correction off" in cntk
    full = ("local steps at the full lr (local_learning_rate=full: the default of learner=block_momentum and "
            "BlockMomentumLearner; CNTK's block_momentum_distributed_learner defaults to share")
    assert full in line(BlockMomentumLearner) and "momentum correction on" in line(BlockMomentumLearner)
    assert full in line(block_momentum_distributed_learner, local_learning_rate="full")
    assert "lr/2" in line(BlockMomentumLearner, local_learning_rate="share")


@pytest.mark.parametrize("options, message", [
    (dict(block_size=0), "block_size=0: expected a positive"),
    (dict(block_size=-8), "block_size=-8"),
    (dict(block_size=8.5), "block_size=8.5"),
    (dict(block_size=True), "block_size=True"),
    (dict(block_size=3), "Sync period is too small"),  # 4 workers
    (dict(block_size=64, block_momentum_as_time_constant=-5.0), "block_momentum_as_time_constant=-5.0"),
    (dict(block_size=64, local_learning_rate="per_sample"), "local_learning_rate='per_sample': expected one of share"),
    (dict(block_size=64, block_momentum_as_time_constant=float("nan")), "block_momentum_as_time_constant=nan"),
    (dict(block_size=64, block_learning_rate=0.0), "block_learning_rate=0.0"),
    (dict(block_size=64, distributed_after=-1), "distributed_after"),
])
def test_bad_values_are_refused_with_one_line(options, message):
    comm = FakeComm(FakeWorld(4), 0)
    with pytest.raises(ValueError, match=message) as error:
        block_momentum_distributed_learner(sgd(make_model().parameters()), comm, **options)
    assert "\n" not in str(error.value)


def test_a_non_bool_flag_is_refused():
    with pytest.raises(ValueError, match="use_nesterov_momentum='yes': expected true or false"):
        BlockMomentumLearner(sgd(make_model().parameters()), None, 16, use_nesterov_momentum="yes")
