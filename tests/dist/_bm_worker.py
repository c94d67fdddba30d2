"""Worker run by tests/dist/test_block_momentum.py under mpiexec: ``python _bm_worker.py``.

Every rank trains a toy model with ``BlockMomentumLearner`` on its share of each global
minibatch (the session's partitioning) for two configurations. After every sync the ranks
all-gather their parameters and record the largest difference, which must be exactly 0. Then
each rank replays the same training as a single-process simulation of CNTK's formulas (N model
copies, ``docs/semantics.md#block-momentum`` written out per parameter) and checks the real result
against it to 1e-5. Each configuration is one named check (``tests.helpers.checks``) whose result
is the list of differences after each sync. A last check, ``cntk_data_parallel_sgd``, trains with
CNTK's settings for data-parallel SGD (block momentum 0, a block of one global minibatch, block
learning rate 1) through the CNTK factory and compares with ``data_parallel_distributed_learner``.
``powersgd_defaults_by_hand`` drives a block learner with PowerSGD by hand (never planned, as a user of the
Python API without ``training_session`` does) and checks that it trains the model the session's plan and
the documented defaults for syncs (error feedback off) give.
"""
from __future__ import annotations

import io
import sys
from functools import partial

import torch
from torch import nn

from dtrain.comm import create_communicator, install_fail_fast
from dtrain.data.partition import partition_slice
from dtrain.exchange import PowerSGD
from dtrain.exchange.powersgd import DEFAULT_START_SYNCS
from dtrain.learners.base import RunFacts
from dtrain.learners import BlockMomentumLearner, block_momentum_distributed_learner, data_parallel_distributed_learner

from tests.helpers.bmuf_reference import flat, simulate_bmuf, train_learner_shares
from tests.helpers.checks import run_checks
from tests.helpers.compare import assert_syncs_match

TOLERANCE = 1e-5

CASES = {
    # name: (global minibatch sizes, learner options); 16 splits evenly over 2 and 4 ranks, 7 does not
    "defaults": ([16] * 12, dict(block_size=48)),
    "variants": ([7] * 14, dict(block_size=24, block_momentum_as_time_constant=100.0, block_learning_rate=0.8,
                                use_nesterov_momentum=False, reset_sgd_momentum_after_aggregation=False,
                                distributed_after=14)),
}
generator = torch.Generator().manual_seed(11)
FEATURES = torch.randn(256, 5, generator=generator)
TARGETS = torch.randn(256, 3, generator=generator)


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def local_loss(model: nn.Module, start: int, stop: int) -> torch.Tensor:
    return nn.functional.mse_loss(model(FEATURES[start:stop]), TARGETS[start:stop])


def train(comm, case: str) -> tuple[list[torch.Tensor], torch.Tensor, list[float]]:
    """Real multi-process training; returns the parameters after each sync and at the end, and the
    largest difference between ranks after each sync."""
    global_sizes, options = CASES[case]
    model = make_model(seed=comm.rank)  # different on every rank: prepare() must broadcast rank 0's
    learner = BlockMomentumLearner(make_optimizer(model), comm, **options)
    learner.prepare(model)
    snapshots, differences = [], []

    def check_one_model() -> None:
        mine = flat(model.parameters())
        difference = max(float((theirs - mine).abs().max()) for theirs in comm.allgather(mine))
        differences.append(difference)
        assert difference == 0.0, f"ranks hold different models after sync {learner.syncs}: {difference}"
        snapshots.append(mine)

    train_learner_shares(learner, model, local_loss, global_sizes, on_sync=check_one_model)
    syncs = learner.syncs
    learner.synchronize()
    if learner.syncs != syncs:
        check_one_model()
    assert learner.syncs >= 3, learner.syncs

    # the checkpoint state loads without pickled code and restores W_prev and sg
    buffer = io.BytesIO()
    torch.save(learner.state_dict(), buffer)
    buffer.seek(0)
    restored = BlockMomentumLearner(make_optimizer(model), comm, **options)
    restored.load_state_dict(torch.load(buffer, weights_only=True))
    assert torch.equal(restored.prev_parameters, learner.prev_parameters)
    assert torch.equal(restored.smoothed_gradient, learner.smoothed_gradient)
    return snapshots, flat(model.parameters()), differences


def simulate(size: int, case: str) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The same training in one process: ``size`` model copies and the ``docs/semantics.md#block-momentum`` update per parameter."""
    global_sizes, options = CASES[case]
    models = [make_model(seed=0) for _ in range(size)]
    return simulate_bmuf(models, [make_optimizer(model) for model in models], local_loss, global_sizes, **options)


def check_case(comm, case: str) -> dict:
    """Train ``case`` on every rank and compare each sync with the simulation; returns the differences between ranks."""
    snapshots, final, differences = train(comm, case)
    expected_snapshots, expected_final = simulate(comm.size, case)
    assert_syncs_match(f"{case}: sync", snapshots + [final], expected_snapshots + [expected_final], TOLERANCE)
    comm.barrier()
    return {"differences_between_ranks": differences}


def train_steps(comm, build, global_size: int, steps: int) -> torch.Tensor:
    """``steps`` global minibatches on this rank's share with the learner ``build(model)`` makes; the final model."""
    model = make_model(seed=comm.rank)
    learner = build(model)
    learner.prepare(model)
    for step in range(steps):
        start, stop = partition_slice(step * global_size, global_size, *learner.data_partition())
        learner.begin_minibatch(stop - start, global_size)
        if stop > start:
            local_loss(model, start, stop).backward()
        learner.step()
    learner.synchronize()
    return flat(model.parameters())


def check_cntk_data_parallel_sgd(comm) -> dict:
    """Block momentum 0 (time constant 0), a block of one global minibatch and block learning rate 1,
    through CNTK's factory, make the parameters of data-parallel SGD (``docs/semantics.md#block-momentum``)."""
    global_size, steps = 16, 8

    def sgd(model):
        return torch.optim.SGD(model.parameters(), lr=0.1, weight_decay=0.01)

    data_parallel = train_steps(comm, lambda model: data_parallel_distributed_learner(sgd(model), comm),
                                global_size, steps)
    block_momentum = train_steps(comm, lambda model: block_momentum_distributed_learner(
        sgd(model), comm, block_size=global_size, block_momentum_as_time_constant=0, block_learning_rate=1.0,
        distributed_after=0), global_size, steps)
    difference = float((block_momentum - data_parallel).abs().max())
    assert difference <= TOLERANCE, f"block momentum with CNTK's data-parallel settings is {difference} away"
    return {"max_difference": difference, "moved": float((data_parallel - flat(make_model(0).parameters())).abs().max())}


def check_powersgd_defaults_by_hand(comm) -> dict:
    """PowerSGD's defaults under a block learner hold whatever drives it: by hand (never planned) the syncs'
    error feedback is off and the start is 10 syncs, as the session plans a run of unknown length; with the
    start set, the model is the one the session's plan of a known run gives, bit for bit."""
    global_size, steps = 8, 32  # the 256 samples once; blocks of 16: a sync every 2 minibatches, 16 syncs

    def final_model(exchange: PowerSGD, facts: RunFacts | None = None) -> torch.Tensor:
        def build(model):
            learner = BlockMomentumLearner(make_optimizer(model), comm, block_size=16, distributed_after=0,
                                           exchange=exchange)
            if facts is not None:
                learner.plan(facts)  # what training_session does before prepare()
            return learner
        try:
            return train_steps(comm, build, global_size, steps)
        finally:
            exchange.close()

    by_hand = PowerSGD(start_powersgd_iter=2)
    hand_driven = final_model(by_hand)
    assert not by_hand.use_error_feedback and by_hand.step_name == "sync", by_hand.describe()
    planned = final_model(PowerSGD(start_powersgd_iter=2), RunFacts(max_samples=global_size * steps,
                                                                    minibatch_size=global_size))
    documented = final_model(PowerSGD(start_powersgd_iter=2, use_error_feedback=False))
    with_feedback = final_model(PowerSGD(start_powersgd_iter=2, use_error_feedback=True))
    assert torch.equal(hand_driven, planned), float((hand_driven - planned).abs().max())
    assert torch.equal(hand_driven, documented), float((hand_driven - documented).abs().max())
    feedback_difference = float((with_feedback - documented).abs().max())
    assert feedback_difference > 1e-3, feedback_difference  # the setting matters here: the check can tell

    default_start = PowerSGD()
    unknown_length = PowerSGD()
    assert torch.equal(final_model(default_start), final_model(unknown_length, RunFacts()))
    assert default_start.start_powersgd_iter == unknown_length.start_powersgd_iter == DEFAULT_START_SYNCS
    return {"error_feedback_difference": feedback_difference, "session_difference": session_difference(comm)}


def session_difference(comm) -> float:
    """The largest difference between a block learner with PowerSGD's defaults trained by ``training_session``
    and the same learner driven by hand through ``step()`` on the same minibatches (no plan() there); 0.0 expected:
    error feedback off for syncs, the start explicit (a hand-driven run's length is unknown)."""
    import tempfile
    from pathlib import Path

    from dtrain import MinibatchSource, training_session
    from tests.helpers.toy_data import four_class_data

    global_size, max_samples = 8, 128

    def classifier():
        torch.manual_seed(3)
        model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 4))
        learner = BlockMomentumLearner(torch.optim.SGD(model.parameters(), lr=0.1), comm, block_size=16,
                                       distributed_after=0, exchange=PowerSGD(start_powersgd_iter=2))
        return model, learner

    run_dir = comm.broadcast_object(tempfile.mkdtemp() if comm.rank == 0 else None)
    model, learner = classifier()
    training_session(model, nn.functional.cross_entropy, learner, MinibatchSource(four_class_data(64), randomize=False),
                     minibatch_size=global_size, max_samples=max_samples, progress_frequency=0,
                     run_dir=Path(run_dir) / "session", tensorboard=False, stream=io.StringIO()).train()
    assert not learner.exchange.use_error_feedback
    by_session = flat(model.parameters())

    model, learner = classifier()
    source = MinibatchSource(four_class_data(64), randomize=False)
    learner.prepare(model)
    while learner.samples_seen < max_samples:
        minibatch = source.next_minibatch(global_size, *learner.data_partition())
        learner.begin_minibatch(minibatch.num_samples, minibatch.global_num_samples)
        if minibatch.num_samples:
            nn.functional.cross_entropy(model(minibatch.features), minibatch.labels).backward()
        learner.step()
    learner.synchronize()
    learner.finalize()
    source.close()
    return float((flat(model.parameters()) - by_session).abs().max())


def main() -> None:
    comm = create_communicator(backend="gloo", timeout_s=60)
    install_fail_fast(comm)
    torch.set_num_threads(1)  # oversubscribed ranks on a small machine
    run_checks(comm, {**{case: partial(check_case, case=case) for case in CASES},
                      "cntk_data_parallel_sgd": check_cntk_data_parallel_sgd,
                      "powersgd_defaults_by_hand": check_powersgd_defaults_by_hand})
    comm.finalize()


if __name__ == "__main__":
    sys.exit(main())
