"""Learners that work out of the box: defaults derived from the run, BMUF that talks once a block,
and a collapsed classifier that ends the run with one line instead of a normal-looking result."""
from __future__ import annotations

import io
import itertools
import math
import warnings
from dataclasses import replace

import numpy as np
import pytest
import torch
from torch import nn

from dtrain import CheckpointConfig, MinibatchSource, TestConfig, training_session
from dtrain.data import ArrayDeserializer
from dtrain.exchange import Quantized
from dtrain.learners import BlockMomentumLearner, DataParallelLearner, LocalLearner
from dtrain.learners.base import RunFacts, auto_warm_start
from dtrain.learners.block_momentum import (BLOCK_MOMENTUM_MIN_SYNCS, auto_block_size, default_time_constant,
                                            largest_block_size)
from dtrain.learners.data_parallel import data_parallel_distributed_learner
from dtrain.session.session import TrainingCollapsed

from tests.helpers.thread_world import FakeComm, FakeWorld
from tests.helpers.toy_data import four_class_data

DIGITS = RunFacts(samples_per_sweep=1500, max_samples=30000, minibatch_size=32)
CIFAR10 = RunFacts(samples_per_sweep=50000, max_samples=8_000_000, minibatch_size=64)


class _Comm:
    """A stand-in communicator of ``size`` ranks for learners that are only planned, never stepped."""

    device = torch.device("cpu")

    def __init__(self, size: int, rank: int = 0):
        self.size, self.rank = size, rank

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def sgd() -> torch.optim.Optimizer:
    return torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1, momentum=0.9)


# -- derived defaults ------------------------------------------------------------------------------
def test_auto_warm_start_is_a_quarter_of_the_run_capped_at_five_sweeps_in_whole_minibatches():
    assert auto_warm_start(DIGITS) == 7520            # 7,500 rounded up to 235 minibatches of 32
    assert auto_warm_start(CIFAR10) == 250_048        # 5 sweeps of 50,000, not 2,000,000
    assert auto_warm_start(RunFacts(samples_per_sweep=1000, max_samples=None, minibatch_size=10)) == 1000
    assert auto_warm_start(RunFacts()) == 0


def test_quantized_and_block_momentum_plan_their_warm_start_data_parallel_needs_none():
    quantized = data_parallel_distributed_learner(sgd(), _Comm(2), num_quantization_bits=1)
    assert quantized.exchange.num_bits == 1 and quantized.distributed_after == 0
    quantized.plan(DIGITS)
    assert quantized.distributed_after == 7520
    assert "warm start of 7,520 samples (auto) with float32 all-reduce, then gradients exchanged by 1-bit" \
        in quantized.describe(), quantized.describe()
    full = data_parallel_distributed_learner(sgd(), _Comm(2))
    full.plan(DIGITS)
    assert full.distributed_after == 0
    explicit = DataParallelLearner(sgd(), _Comm(2), distributed_after=64, exchange=Quantized(1))
    explicit.plan(DIGITS)
    assert explicit.distributed_after == 64  # a value the user gave is kept
    alone = DataParallelLearner(sgd(), _Comm(1), exchange=Quantized(1))
    alone.plan(DIGITS)
    assert alone.distributed_after == 0  # one process: nothing to warm up for


def test_block_size_bound_is_cntks_samples_per_sweep_over_time_constant_times_workers():
    for workers in (2, 4, 8):
        bound = largest_block_size(1500, workers)
        # at the bound, time constant x workers equals the unique samples exactly
        assert default_time_constant(bound, workers) * workers == pytest.approx(1500)
    assert largest_block_size(1500, 2) == pytest.approx(519.86, abs=0.01)   # the "about 520"
    assert largest_block_size(50000, 4) < 4096 < largest_block_size(50000, 2)  # 4,096 just over it at 4 workers
    assert math.isinf(largest_block_size(1500, 1))


@pytest.mark.parametrize("facts, workers, expected", [
    (DIGITS, 4, 96), (CIFAR10, 4, 3584), (CIFAR10, 2, 17280),
    (RunFacts(samples_per_sweep=100, max_samples=1000, minibatch_size=64), 8, 64),  # at least one minibatch
])
def test_auto_block_size_is_whole_minibatches_within_the_bound(facts, workers, expected):
    learner = BlockMomentumLearner(sgd(), _Comm(workers))
    learner.plan(facts)
    assert auto_block_size(facts, workers, learner.distributed_after) == expected
    assert (learner.block_size, learner.sync_period) == (expected, expected // workers)
    assert f"block of {expected:,} samples (auto: CNTK's bound" in learner.describe()


def test_one_worker_keeps_a_whole_sweep_as_its_block_whatever_the_run_length():
    """One process: block momentum's syncs keep the model and only zero the optimizer's momentum, so the
    50-sync rule would only reset it every few minibatches (digits, 6,000 samples: 89.90% against 98.32%)."""
    short = replace(DIGITS, max_samples=6000)
    assert auto_block_size(short, 1) == 1472 == auto_block_size(replace(short, max_samples=None), 1)
    learner = BlockMomentumLearner(sgd(), _Comm(1))
    learner.plan(short)
    assert learner.block_size == 1472
    assert auto_block_size(short, 2) < auto_block_size(replace(short, max_samples=None), 2)  # 2 workers: 50 syncs


#: the character language model's facts (characters): 1.06 M per sweep, 5.12 M in the run
LANGUAGE_MODEL = RunFacts(samples_per_sweep=1_064_064, max_samples=5_120_000, minibatch_size=2048)


@pytest.mark.parametrize("facts, workers, cntk_bound, expected", [
    (DIGITS, 2, 512, 448),                 # (30,000 - 7,520) / 50 = 449.6: 14 minibatches of 32
    (LANGUAGE_MODEL, 2, 368_640, 75_776),  # (5,120,000 - 1,280,000) / 50 = 76,800: 37 minibatches of 2,048
])
def test_auto_block_size_makes_at_least_50_syncs_after_the_warm_start(facts, workers, cntk_bound, expected):
    assert BLOCK_MOMENTUM_MIN_SYNCS == 50
    assert auto_block_size(replace(facts, max_samples=None), workers) == cntk_bound  # CNTK's bound alone
    learner = BlockMomentumLearner(sgd(), _Comm(workers))
    learner.plan(facts)
    assert learner.block_size == expected == auto_block_size(facts, workers, learner.distributed_after)
    assert learner.expected_syncs(facts) - 1 >= BLOCK_MOMENTUM_MIN_SYNCS  # besides the sync at the end
    # the largest such block: one minibatch more would make fewer than 50
    assert (facts.max_samples - learner.distributed_after) / (expected + facts.minibatch_size) < BLOCK_MOMENTUM_MIN_SYNCS
    assert f"block of {expected:,} samples (auto: 50 syncs after the warm start, within CNTK's bound" \
        in learner.describe(), learner.describe()


def test_an_explicit_block_size_over_the_bound_warns_once_in_one_line():
    learner = BlockMomentumLearner(sgd(), _Comm(2), block_size=4096)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        learner.plan(DIGITS)
        BlockMomentumLearner(sgd(), _Comm(2), block_size=512).plan(DIGITS)      # within the bound: quiet
        BlockMomentumLearner(sgd(), _Comm(2, rank=1), block_size=4096).plan(DIGITS)  # rank 1: quiet
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "learner.block_size=4,096" in message and "about 520 samples" in message and "\n" not in message
    assert learner.block_size == 4096  # warned, not changed


def test_auto_block_size_without_a_plan_is_refused_with_a_clear_message():
    learner = BlockMomentumLearner(sgd(), _Comm(1))
    with pytest.raises(ValueError, match="block_size='auto' is derived from the run's facts"):
        learner.prepare(nn.Linear(2, 2))


# -- BMUF talks once a block -----------------------------------------------------------------------
class CountingComm(FakeComm):
    """FakeComm with what the session needs too (max, gather_object, barrier); counts every collective."""

    def __init__(self, world, rank):
        super().__init__(world, rank)
        self.collectives = 0

    def allreduce(self, tensor, op="sum"):
        self.collectives += 1
        if op == "max":
            tensor.copy_(torch.stack(self.allgather(tensor)).max(0).values)
            return tensor
        if op == "min":
            tensor.copy_(torch.stack(self.allgather(tensor)).min(0).values)
            return tensor
        return super().allreduce(tensor, op)

    def broadcast(self, tensor, root=0):
        self.collectives += 1
        return super().broadcast(tensor, root)

    def broadcast_object(self, obj, root=0):
        self.collectives += 1
        return super().broadcast_object(obj, root)

    def allgather_object(self, obj):
        self.collectives += 1
        return super().allgather_object(obj)

    def gather_object(self, obj, root=0):
        self.collectives += 1
        items = self.world.gather(self.rank, obj)
        return items if self.rank == root else None

    def barrier(self):
        self.collectives += 1
        self.world.gather(self.rank, None)


def test_block_momentum_session_makes_no_collective_between_syncs(tmp_path):
    """With preemption armed, the session used to all-reduce its flag every minibatch; now the
    ranks meet only at syncs: exactly 2 collectives a block (the sync, the flag), none between."""
    minibatch, block = 16, 64

    def worker(comm: CountingComm):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 4))
        learner = BlockMomentumLearner(torch.optim.SGD(model.parameters(), lr=0.1), comm, block_size=block,
                                       distributed_after=0)
        per_step = []

        class Counted(type(learner)):
            pass

        original_begin = learner.begin_minibatch

        def begin(local, global_):
            per_step.append(comm.collectives)
            original_begin(local, global_)

        learner.begin_minibatch = begin
        session = training_session(
            model=model, loss=nn.functional.cross_entropy, learner=learner,
            minibatch_source=MinibatchSource(four_class_data(640), randomize=True, randomization_seed=1),
            minibatch_size=minibatch, max_samples=640, progress_frequency=0,
            checkpoint_config=CheckpointConfig(tmp_path / f"rank{comm.rank}" / "ckpt.pt", frequency=0,
                                               preemption_signal="SIGTERM"),
            run_dir=tmp_path / f"rank{comm.rank}", tensorboard=False, stream=open("/dev/null", "w"))
        session.train()
        per_step.append(comm.collectives)
        return [after - before for before, after in zip(per_step, per_step[1:])], learner.syncs

    world = FakeWorld(2)
    world_comms = []

    def run(comm):
        counting = CountingComm(world, comm.rank)
        world_comms.append(counting)
        return worker(counting)

    results = world.run(run)
    steps_per_block = block // minibatch
    for per_step_collectives, syncs in results:
        assert syncs == 640 // block
        # the last step's count also holds the end of training (final synchronize, none left to sync)
        for index, count in enumerate(per_step_collectives[:-1]):
            expected = 2 if (index + 1) % steps_per_block == 0 else 0
            assert count == expected, (index, per_step_collectives)


def test_during_the_warm_start_block_momentum_meets_once_a_block_of_samples():
    learner = BlockMomentumLearner(sgd(), _Comm(1), block_size=64, distributed_after=1000)
    learner.prepare(nn.Linear(2, 2))
    meetings = []
    for _ in range(16):
        learner.begin_minibatch(16, 16)
        learner.step()
        meetings.append(learner.is_sync_point())
    assert meetings == [False, False, False, True] * 4


# -- a collapsed run says so -----------------------------------------------------------------------
class CollapsingLearner(LocalLearner):
    """Trains normally, then zeroes the model at ``collapse_at`` samples: the output becomes
    uniform and the loss returns to ln C (what a 1-bit collapse looks like, made certain)."""

    kind = "collapsing"

    def __init__(self, optimizer, collapse_at: int | None):
        super().__init__(optimizer)
        self.collapse_at = collapse_at

    def apply_update(self) -> None:
        super().apply_update()
        if self.collapse_at is not None and self.samples_seen >= self.collapse_at:
            with torch.no_grad():
                for parameter in self.parameters:
                    parameter.zero_()


def _session(tmp_path, collapse_at, labels_as_float=False, progress_frequency=400, test=False, learnable=True,
             stream=None):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 4))
    data = four_class_data(400)
    if not learnable:  # labels unrelated to the features: the loss never falls below chance
        data = ArrayDeserializer(data.features if hasattr(data, "features") else np.random.default_rng(1).normal(
            size=(400, 6)).astype(np.float32), np.random.default_rng(2).integers(0, 4, 400), num_classes=4)
    loss = nn.functional.cross_entropy
    if labels_as_float:  # regression on the label value: never judged
        def loss(output, labels):
            return nn.functional.mse_loss(output[:, 0], labels.float())
    learner = CollapsingLearner(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), collapse_at)
    test_config = TestConfig(MinibatchSource(four_class_data(200, seed=5), randomize=False, max_sweeps=1), 50) \
        if test else None
    return training_session(model=model, loss=loss, learner=learner,
                            minibatch_source=MinibatchSource(data, randomize=True, randomization_seed=1), minibatch_size=16,
                            max_samples=4000, progress_frequency=progress_frequency, test_config=test_config,
                            run_dir=tmp_path, tensorboard=False, stream=stream or open("/dev/null", "w"))


def test_a_loss_back_at_chance_after_falling_stops_training_with_one_line(tmp_path):
    with pytest.raises(TrainingCollapsed) as caught:
        _session(tmp_path, collapse_at=2000).train()
    message = str(caught.value)
    assert message.startswith("training collapsed: the mean loss 1.3")  # ln 4 = 1.386 once the model is zeroed
    assert "at 2400 samples" in message  # the first progress point after the collapse at 2,000
    assert "ln 4 = 1.3863" in message and "optimizer.lr" in message
    assert "learner.distributed_after" not in message  # one process: no warm start to advise (test_training_advice.py)
    assert "\n" not in message


def test_test_accuracy_at_chance_after_learning_is_not_reported_as_a_normal_end(tmp_path):
    with pytest.raises(TrainingCollapsed, match=r"training collapsed: test accuracy \d+\.\d\d% is chance for 4 classes"):
        _session(tmp_path, collapse_at=3600, progress_frequency=0, test=True).train()


@pytest.mark.parametrize("case", ["healthy", "regression", "never_learned"])
def test_no_false_alarm(tmp_path, case):
    if case == "healthy":
        result = _session(tmp_path, collapse_at=None, test=True).train()
        assert result.test.accuracy > 0.5
    elif case == "regression":
        _session(tmp_path, collapse_at=None, labels_as_float=True, progress_frequency=0).train()  # it learns
    else:
        _session(tmp_path, collapse_at=None, learnable=False).train()  # at chance all along: nothing fell, no alarm


@pytest.mark.parametrize("progress_frequency", [0, 100_000])  # no progress points; one, the whole run's mean
def test_a_collapse_without_a_test_pass_ends_the_run_whatever_the_progress_points(tmp_path, progress_frequency):
    """The running training loss back at ln C at the end, after it had fallen, is a collapse with no test pass
    to show it and no progress point at chance (it was only a warning: "14.6 times its lowest", exit 0)."""
    with pytest.raises(TrainingCollapsed) as caught:
        _session(tmp_path, collapse_at=3000, progress_frequency=progress_frequency).train()
    message = str(caught.value)
    assert message.startswith("training collapsed: the training loss ends at 1.3"), message
    assert "(running average), back at chance for 4 classes (ln 4 = 1.3863), after it had fallen to 0." in message
    assert message.endswith("; the likely cause is a learning rate too high for this learner; lower optimizer.lr")
    assert "\n" not in message


def test_a_regression_loss_back_at_its_start_is_a_collapse(tmp_path):
    """No ln C for a regression: chance is where its loss started (the zeroed model predicts 0, as at the start)."""
    with pytest.raises(TrainingCollapsed) as caught:
        _session(tmp_path, collapse_at=2000, labels_as_float=True, progress_frequency=0).train()
    message = str(caught.value)
    assert message.startswith("training collapsed: the training loss ends at "), message
    assert "back at chance for this loss: where it started (" in message and "after it had fallen to 0." in message


def test_a_training_loss_at_chance_that_never_left_it_is_told_without_a_test_pass(tmp_path):
    output = io.StringIO()
    _session(tmp_path, collapse_at=None, learnable=False, stream=output).train()  # no test pass: nothing said before
    [line] = [line for line in output.getvalue().splitlines() if line.startswith("warning:")]
    assert line.startswith("warning: the training loss ends at 1.3"), line
    assert "(running average), at chance for 4 classes (ln 4 = 1.3863); it never left chance (" in line, line


def test_a_nan_loss_that_no_progress_point_saw_ends_the_run_as_diverged(tmp_path):
    from dtrain.session import TrainingDiverged

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 4))
    session = training_session(model, nn.functional.cross_entropy, LocalLearner(torch.optim.SGD(model.parameters(), lr=1e6)),
                               MinibatchSource(four_class_data(400)), 16, max_samples=800, progress_frequency=0,
                               run_dir=tmp_path, tensorboard=False, stream=io.StringIO())
    with pytest.raises(TrainingDiverged, match=r"^training diverged: the training loss ends at nan \(running average\) "
                                               r"at 800 samples; .*lower optimizer.lr"):
        session.train()


def test_a_test_pass_at_chance_after_a_loss_that_never_left_it_is_told_in_the_summary(tmp_path):
    output = io.StringIO()
    result = _session(tmp_path, collapse_at=None, learnable=False, test=True, stream=output).train()
    assert result.test.accuracy <= 0.5
    [line] = [line for line in output.getvalue().splitlines() if line.startswith("warning:")]
    assert line.startswith(f"warning: test accuracy {100 * result.test.accuracy:.2f}% is chance for 4 classes "
                           "(ln 4 = 1.3863): the training loss never left chance")
    assert output.getvalue().index("test: accuracy") < output.getvalue().index(line)  # after the line it is about


@pytest.mark.parametrize("fold_every", [1, 7, 64])
def test_the_running_loss_folded_in_blocks_is_the_step_by_step_average(fold_every):
    """The watch keeps each minibatch's loss and folds a block at a time in one matrix product: the lowest
    and highest running average are the ones ``a <- (1 - w) a + w x`` gives minibatch by minibatch (to float64
    rounding), with ``w`` 0.05 for a small minibatch and ``1 - exp(-n / 640)`` for n samples beyond."""
    from dtrain.comm import LocalCommunicator
    from dtrain.session.collapse import CollapseWatch

    generator = torch.Generator().manual_seed(0)
    losses = torch.rand(300, generator=generator) * 3
    sizes = [4] * 150 + [int(n) for n in torch.randint(1, 2048, (150,), generator=generator)]  # a size schedule
    watch = CollapseWatch(torch.device("cpu"), fold_every=fold_every)
    average, lowest, highest = None, math.inf, -math.inf
    fixed = list(itertools.accumulate((float(x) for x in losses), lambda a, x: 0.95 * a + 0.05 * x))
    for index, (loss, size) in enumerate(zip(losses, sizes)):
        # a loss of shape [1] now and then (folded with the scalars); the size given, or read from the labels
        kept = loss.reshape(1) if index % 3 == 0 else loss
        watch.observe(torch.zeros(size, 10), torch.zeros(size, dtype=torch.int64), kept, nn.functional.cross_entropy,
                      size if index % 2 else None)
        weight = 0.05 if size <= 32 else 1 - math.exp(-size / 640)
        average = float(loss) if average is None else (1 - weight) * average + weight * float(loss)
        lowest, highest = min(lowest, average), max(highest, average)
    record = watch.record(LocalCommunicator())
    assert tuple(record[:4]) == pytest.approx((lowest, highest, float(losses[0]), average), rel=1e-12)
    assert record.minibatches == 300
    assert watch.lowest_average(LocalCommunicator()) == pytest.approx(lowest, rel=1e-12)
    assert highest > max(fixed) + 0.5  # the large minibatches weigh more than a fixed 0.05 would give them
    assert lowest > float(losses.min()) + 0.01  # still an average, above the smallest single loss


def test_a_resumed_run_keeps_the_warm_start_it_was_planned_with():
    first = DataParallelLearner(sgd(), _Comm(2), exchange=Quantized(1))
    first.plan(DIGITS)
    resumed = DataParallelLearner(sgd(), _Comm(2), exchange=Quantized(1))
    resumed.load_state_dict(first.state_dict())
    resumed.plan(RunFacts(samples_per_sweep=1500, max_samples=60000, minibatch_size=32))  # a longer run now
    assert resumed.distributed_after == first.distributed_after == 7520


#: the recipes' run facts and their automatic warm starts (docs/sequence-recipes.md's table)
RECIPE_RUNS = {
    "digits": (DIGITS, 7520),
    "shakespeare_char": (RunFacts(samples_per_sweep=1064064, max_samples=5120000, minibatch_size=2048), 1280000),
    "cmudict_g2p": (RunFacts(samples_per_sweep=896755, max_samples=21522120, minibatch_size=512), 4484096),
}


@pytest.mark.parametrize("recipe, inner_steps", [
    ("digits", {1: 35, 2: 35, 3: 23, 4: 17, 8: 8}),
    ("shakespeare_char", {1: 93, 2: 93, 3: 62, 4: 46, 8: 23}),
    ("cmudict_g2p", {1: 500, 2: 500, 3: 333, 4: 250, 8: 125}),  # the paper's 500 is the cap at 2 workers
])
def test_diloco_automatic_block_shrinks_as_two_over_n_beyond_two_workers(recipe, inner_steps):
    """``block_size: auto`` = ``min(500, S / 20)`` inner steps at 1 and 2 workers, times 2/N beyond: the global
    minibatch is fixed, so N workers' inner steps each see 1/N of it; at 4 ranks on the language model 93
    inner steps ended 0.094 nats behind data_parallel, 46 within 0.03 (docs/semantics.md#diloco)."""
    from dtrain.learners import DiLoCoLearner
    from dtrain.learners.diloco import auto_diloco_block_size

    facts, warm_start = RECIPE_RUNS[recipe]
    for workers, steps in inner_steps.items():
        assert auto_diloco_block_size(facts, warm_start, workers) == steps * facts.minibatch_size, workers
        if workers == 1:
            continue  # one worker needs no warm start (distributed_after 0), so its steps differ
        learner = DiLoCoLearner(torch.optim.AdamW(nn.Linear(4, 3).parameters()), _Comm(workers))
        learner.plan(facts)
        assert learner.distributed_after == warm_start
        assert learner.block_size == steps * facts.minibatch_size
        said = learner.describe()
        assert f"block of {learner.block_size:,} samples" in said, said
        assert (f"times 2/{workers} for {workers} workers" in said) == (workers > 2), said


def test_diloco_automatic_block_without_a_run_length_is_the_papers_500_steps_scaled():
    from dtrain.learners.diloco import auto_diloco_block_size

    unknown = RunFacts(minibatch_size=32)
    assert [auto_diloco_block_size(unknown, 0, n) // 32 for n in (1, 2, 4, 5)] == [500, 500, 250, 200]


@pytest.mark.parametrize("replicas", [2, 4])
def test_a_resumed_diloco_run_keeps_its_automatic_block_at_the_same_world_size(replicas):
    """DiLoCo's automatic block is a twentieth of the steps after the warm start: a run resumed with a
    larger max_samples (kept warm start) would otherwise sync on another schedule than the one it began."""
    from dtrain.learners import DiLoCoLearner

    def learner(size: int) -> DiLoCoLearner:
        return DiLoCoLearner(torch.optim.AdamW(nn.Linear(4, 3).parameters()), _Comm(size))

    first = learner(2)
    first.plan(RunFacts(samples_per_sweep=1500, max_samples=15000, minibatch_size=32))
    resumed = learner(replicas)
    resumed.load_state_dict(first.state_dict())
    longer = RunFacts(samples_per_sweep=1500, max_samples=30000, minibatch_size=32)
    resumed.plan(longer)
    fresh = learner(replicas)
    fresh.distributed_after = first.distributed_after
    fresh_block = fresh.auto_block_size(longer)
    assert fresh_block != first.block_size  # the longer run alone would derive another block
    if replicas == 2:
        assert resumed.block_size == first.block_size == 544
        assert "as planned when the run began" in resumed.describe()
        assert "derived again" not in resumed.describe()
    else:  # another world size re-derives the block, as a fresh plan would, and says so
        assert resumed.block_size == fresh_block
        assert (f"derived again for {replicas} model replicas: the checkpoint's run had 544 at 2"
                in resumed.describe()), resumed.describe()


def _evaluation_passes(collapse, tested=None):
    """The session's evaluation passes around ``collapse`` for a classifier (its metric: classification errors),
    whose test pass returns ``tested`` without reading any data."""
    from types import SimpleNamespace

    from dtrain.comm import LocalCommunicator
    from dtrain.session.evaluate import classification_errors
    from dtrain.session.evaluations import BatchNormStatistics, EvaluationPasses
    from dtrain.session.measures import Measures

    comm = LocalCommunicator()
    passes = EvaluationPasses(
        model=None, loss=None, measures=Measures(classification_errors, None, comm), learner=SimpleNamespace(comm=comm),
        device=torch.device("cpu"), binding=None, cv_config=None, test_config=None, ema=None, collapse=collapse,
        batchnorm=BatchNormStatistics(), source=None, minibatch_size=None, advice=lambda: "lower optimizer.lr",
        start_outputs=lambda metrics: None)
    passes._test_pass = lambda *args, **kwargs: tested
    return passes


def _watch_after(losses, size=4, classes=10):
    """A collapse watch that saw ``losses``, one minibatch of ``size`` samples each, of a ``classes``-way task."""
    from dtrain.session.collapse import CollapseWatch

    watch = CollapseWatch(torch.device("cpu"), fold_every=16)
    for loss in losses:
        watch.observe(torch.zeros(size, classes), torch.zeros(size, dtype=torch.int64), torch.tensor(float(loss)),
                      nn.functional.cross_entropy)
    return watch


@pytest.mark.parametrize("losses, size, verdict", [
    ([2.3] * 50 + [1.9] * 40 + [2.3] * 100, 4, "fallen"),        # learned a little (0.83 ln 10), then back at chance
    ([2.3] * 50 + [4.0] * 60 + [2.3] * 100, 4, "diverged"),      # 1.7 ln 10, then chance
    ([2.3] * 5 + [1.9, 6.3] + [2.3] * 50, 512, "diverged"),     # a spike of two large minibatches is not smoothed away
    ([2.3] * 5 + [1.85, 1.8] + [2.3] * 50, 512, "fallen"),
    ([2.3] * 5 + [1.85, 1.8] + [2.3] * 50, 4, "never_learned"),  # two small minibatches are noise
    ([2.3] * 50 + [1.9] * 140, 4, "only_training"),             # learned a little and stays there: no collapse
    ([2.3] * 200, 4, "never_learned"),
    ([4.0] * 30 + [2.3] * 100, 4, "never_learned"),            # started high (a ResNet's initialisation) and fell
    ([2.3, 4.0, 4.0, 1.8], 1024, "never_learned"),                # a smoke run of 4 minibatches: too few to judge ...
    ([2.3, 1.0, 1.0, 1.0], 1024, "fallen"),                      # ... but for a fall to half of ln C
])
def test_a_final_test_pass_at_chance_is_judged_by_where_the_training_loss_had_been(losses, size, verdict):
    from dtrain.comm import LocalCommunicator

    watch = _watch_after(losses, size)
    assert watch.judge_evaluation(2.30, 0.10, LocalCommunicator()) == verdict
    assert watch.evaluation_collapsed(2.30, 0.10, LocalCommunicator()) == (verdict in ("fallen", "diverged"))
    assert watch.judge_evaluation(2.30, 0.25, LocalCommunicator()) is None  # above 2 / C: not chance
    assert watch.judge_evaluation(2.00, 0.10, LocalCommunicator()) is None  # loss below 90% of ln C


@pytest.mark.parametrize("losses, size, verdict", [
    ([2.3] * 20 + [0.2] * 200 + [2.3] * 100, 4, "fallen"),      # learned, then back at ln 10 for good
    ([2.3] * 20 + [0.2] * 200 + [5.0] * 100, 4, "fallen"),      # learned, then far above chance: worse
    ([2.3] * 50 + [4.0] * 60 + [2.3] * 100, 4, "diverged"),
    ([2.3] * 200, 4, "never_learned"),
    ([2.3] * 20 + [0.2] * 200 + [1.9] * 100, 4, None),         # rose, but not to chance (a warning, elsewhere)
    ([2.3] * 20 + [0.2] * 200 + [2.3] * 10, 4, None),          # the last 10 minibatches: the average lags behind
    ([2.3, 1.0, 1.0, 2.3], 1024, None),                         # a smoke run of 4 minibatches: the last is not enough
    ([2.3] * 5, 4, None),                                        # ... and no warning for too few to judge
    ([2.3] * 20 + [0.2, 0.2, 0.2, 1.5] * 100, 4, None),         # noisy: a spike in every fourth minibatch, learning
    ([2.3] * 20 + [0.2] * 200 + [math.nan], 4, "not_finite"),
])
def test_the_training_loss_alone_is_judged_at_the_end(losses, size, verdict):
    from dtrain.comm import LocalCommunicator

    judged = _watch_after(losses, size).judge_training(LocalCommunicator())
    assert (judged[0] if judged is not None else None) == verdict


@pytest.mark.parametrize("losses, verdict", [
    ([1.0] * 20 + [0.1] * 200 + [1.0] * 100, "back_at_start"),
    ([1.0] * 20 + [0.1] * 200 + [40.0] * 100, "back_at_start"),  # far above its start
    ([1.0] * 20 + [0.1] * 200 + [0.5] * 100, None),             # worse than its best, still half its start
    ([1.0] * 20 + [0.6] * 200 + [1.0] * 100, None),             # never fell to half of its start
    ([1.0] * 20 + [0.1] * 200, None),
    ([-1.0] * 20 + [-5.0] * 200 + [-1.0] * 100, None),          # a loss below 0 (a log-likelihood) has no such level
    ([1.0] * 20 + [0.1] * 200 + [math.inf], "not_finite"),
])
def test_any_other_loss_is_judged_against_its_start(losses, verdict):
    from dtrain.comm import LocalCommunicator
    from dtrain.session.collapse import CollapseWatch

    watch = CollapseWatch(torch.device("cpu"), fold_every=16)
    for loss in losses:
        watch.observe(torch.zeros(4, 1), torch.zeros(4), torch.tensor(loss), nn.functional.mse_loss)
    assert watch.chance_loss is None and watch.judge_evaluation(2.3, None, LocalCommunicator()) is None
    judged = watch.judge_training(LocalCommunicator())
    assert (judged[0] if judged is not None else None) == verdict


def test_a_classifier_with_a_loss_of_its_own_is_judged_against_its_start():
    """The watch knows ln C only for torch's cross-entropy: a loss of your own over the same logits (the number of
    classes unknown to it) falls back on its start, ln C here."""
    from dtrain.comm import LocalCommunicator
    from dtrain.session.collapse import CollapseWatch

    watch = CollapseWatch(torch.device("cpu"), fold_every=16)
    for loss in [2.3] * 20 + [0.2] * 200 + [2.3] * 100:
        watch.observe(torch.zeros(4, 10), torch.zeros(4, dtype=torch.int64), torch.tensor(loss),
                      lambda output, labels: nn.functional.cross_entropy(output, labels))
    assert watch.chance_loss is None
    assert watch.judge_training(LocalCommunicator())[0] == "back_at_start"


def test_the_chance_warning_says_never_left_chance_only_when_the_loss_stayed_there():
    """2 classes: a lowest of 0.6076 is 88% of ln 2, below what counts as chance (90%): the loss left chance,
    if not far enough to have learned (85%); the warning says how far it fell instead of "never left"."""
    from dtrain.session.evaluate import Evaluation

    def warning(training_losses):
        passes = _evaluation_passes(_watch_after(training_losses, classes=2),
                                    Evaluation(loss=0.69, error=0.5, num_samples=200, num_minibatches=4))
        passes.test(None, None, 4000)
        [line] = passes.warnings
        return line

    fell = warning([0.6931] * 20 + [0.6076] * 300 + [0.6931] * 5)
    assert "never left chance" not in fell
    assert ("is chance for 2 classes (ln 2 = 0.6931): the training loss fell only to 0.6076 at its lowest (88% of "
            "ln 2), so the model learned almost nothing;") in fell, fell
    stayed = warning([0.6931] * 20 + [0.64] * 300 + [0.6931] * 5)
    assert "the training loss never left chance (0.6400 at its lowest, 92% of ln 2), so the model learned nothing" \
        in stayed, stayed


def test_a_progress_period_mean_counts_as_where_the_loss_had_been():
    from dtrain.comm import LocalCommunicator

    watch = _watch_after([2.3] * 100)
    watch.loss_collapsed(5.0, LocalCommunicator())  # a period whose mean diverged (between two folds' worth)
    assert watch.judge_evaluation(2.30, 0.10, LocalCommunicator()) == "diverged"


@pytest.mark.parametrize("tail, rose", [([1.2] * 100, True), ([0.25] * 100, False), ([0.3] * 3, False),
                                        ([0.7] * 100, False)])  # 3.5 times, but only 0.22 ln 10 higher
def test_a_training_loss_that_ends_far_above_its_best_is_noticed(tail, rose):
    from dtrain.comm import LocalCommunicator

    rise = _watch_after([2.3] * 20 + [0.2] * 200 + tail).rise_at_the_end(LocalCommunicator())
    if rose:
        final, lowest = rise
        assert final == pytest.approx(1.2, abs=0.01) and lowest == pytest.approx(0.2, abs=1e-3)
    else:
        assert rise is None


@pytest.mark.parametrize("tail, test_loss, accuracy, verdict", [
    ([1.2] * 100, 4.95, 0.202, "unstable"),     # rose at the end, then a test loss above ln 10 at 20.2%: refused
    ([1.2] * 100, 2.08, 0.55, "unstable"),      # at 90% of ln 10 and at any accuracy
    ([1.2] * 100, 4.95, None, "fallen"),        # a sequence model (the loss alone): at chance already
    ([1.2] * 100, 2.05, 0.30, None),            # rose, but the test loss is below 90% of ln 10: a warning
    ([0.25] * 100, 4.95, 0.70, None),           # no rise: an overconfident model that overfits is not refused
    ([2.3] * 100, 2.31, 0.10, "fallen"),        # back at chance: the collapse verdict comes first
])
def test_a_test_loss_at_chance_after_the_training_loss_rose_at_the_end_is_refused_at_any_accuracy(
        tail, test_loss, accuracy, verdict):
    from dtrain.comm import LocalCommunicator

    watch = _watch_after([2.3] * 20 + [0.2] * 200 + tail)
    assert watch.judge_evaluation(test_loss, accuracy, LocalCommunicator()) == verdict
    assert watch.evaluation_collapsed(test_loss, accuracy, LocalCommunicator()) == (verdict is not None)


def test_the_unstable_verdict_stops_the_run_with_one_line_naming_the_figures():
    from dtrain.session import TrainingCollapsed
    from dtrain.session.evaluate import Evaluation

    passes = _evaluation_passes(_watch_after([2.3] * 20 + [0.2] * 200 + [1.2] * 100),
                                Evaluation(loss=4.95, error=0.798, num_samples=297, num_minibatches=3))
    with pytest.raises(TrainingCollapsed) as raised:
        passes.test(None, None, 12000)
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith(
        "training became unstable: test loss 4.9500 (accuracy 20.20%) is as high as chance's for 10 classes (90% of "
        "ln 10 = 2.3026 or more) after the training loss had fallen to 0.2001 and then risen to 1.1941 (running "
        "average) by the end"), message
    assert message.endswith("; lower optimizer.lr"), message


def test_ranks_that_observed_different_numbers_of_minibatches_judge_alike_without_hanging():
    """A rank without samples in some minibatches observes fewer losses; the end-of-run judgements are still
    one collective on every rank, with the fewest minibatches any rank saw (a rank that declined early on
    its own count left the others waiting in the collective: a hang under mpiexec)."""
    from tests.helpers.thread_world import FakeWorld

    def work(comm):
        watch = _watch_after([2.3] * 20 + [0.2] * 200 + [1.2] * (100 if comm.rank == 0 else 1))
        return watch.rise_at_the_end(comm), watch.record(comm).minibatches, watch.judge_evaluation(2.3, 0.1, comm)

    first, second = FakeWorld(2).run(work)
    assert first == second  # the same verdicts on both ranks
    assert first[1] == 221  # the fewest minibatches of any rank


@pytest.mark.parametrize("lowest, said", [(0.25, "6.0 times its lowest (0.2500)"), (0.0, "above its lowest (0.0000)")])
def test_the_rise_warning_reads_well_even_after_a_loss_of_exactly_zero(lowest, said):
    """A training loss can underflow to 0: the warning then says "above", where a ratio would divide by zero."""
    from types import SimpleNamespace

    passes = _evaluation_passes(SimpleNamespace(rise_at_the_end=lambda comm: (1.5, lowest)))
    passes.note_a_rise_at_the_end()
    assert passes.warnings == [f"warning: the training loss ended at 1.5000 (running average), {said}: training "
                                     "became unstable and the final model is worse than it was; lower optimizer.lr"]


def test_a_block_that_ends_inside_a_minibatch_is_described_as_the_syncs_the_run_makes(tmp_path):
    """block_size=100 at 2 workers and a global minibatch of 32: a block is complete at the first
    minibatch end past 50 per worker, so a sync every 4 minibatches (128 samples); the line says so."""
    def worker(comm):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 4))
        learner = BlockMomentumLearner(torch.optim.SGD(model.parameters(), lr=0.1), comm, block_size=100,
                                       distributed_after=0)
        training_session(
            model=model, loss=nn.functional.cross_entropy, learner=learner,
            minibatch_source=MinibatchSource(four_class_data(640), randomize=True, randomization_seed=1),
            minibatch_size=32, max_samples=640, progress_frequency=0,
            checkpoint_config=CheckpointConfig(tmp_path / f"rank{comm.rank}" / "ckpt.pt", frequency=0),
            run_dir=tmp_path / f"rank{comm.rank}", tensorboard=False, stream=open("/dev/null", "w")).train()
        return learner.syncs, learner.describe()

    for syncs, line in FakeWorld(2).run(worker):
        assert syncs == 640 // 128
        assert "block of 100 samples = 50 per worker between syncs (blocks end at a minibatch's end: a sync " \
               "every 4 minibatches of 32, 128 samples)" in line, line
    on_the_boundary = BlockMomentumLearner(sgd(), _Comm(2), block_size=128)
    on_the_boundary.plan(DIGITS)
    assert "= 64 per worker between syncs, " in on_the_boundary.describe()  # nothing to add


def test_an_auto_block_at_3_workers_gets_no_rounding_note():
    """Shares of 11, 11, 10 at 3 workers: the auto block (whole minibatches) is what the run syncs on."""
    learner = BlockMomentumLearner(sgd(), _Comm(3))
    learner.plan(DIGITS)
    assert learner.block_size % 32 == 0 and "blocks end at a minibatch's end" not in learner.describe()


# -- a learner driven by hand, without plan() -------------------------------------------------------------------
def hand_driven_warnings(build, size: int = 2, plan: RunFacts | None = None) -> list[str]:
    """The warnings of two minibatches on ``size`` thread ranks with the learner ``build(optimizer, comm)`` makes,
    driven by hand: prepare(), begin_minibatch(), backward, step(); planned first only when ``plan`` is given."""
    def work(comm):
        model = nn.Linear(2, 2)
        learner = build(torch.optim.SGD(model.parameters(), lr=0.1), comm)
        if plan is not None:
            learner.plan(plan)
        learner.prepare(model)
        for _ in range(2):
            learner.begin_minibatch(4, 4 * size)
            model(torch.ones(4, 2)).square().mean().backward()
            learner.step()
        learner.finalize()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        FakeWorld(size).run(work)
    return [str(warning.message) for warning in caught if "distributed_after" in str(warning.message)]


def test_a_learner_whose_auto_warm_start_needs_the_runs_facts_says_so_when_stepped_without_a_plan():
    """training_session plans every run; a hand-driven k-bit or block learner would otherwise train without the
    warm start the session gives it, silently. Rank 0 says it, once."""
    def one_bit(optimizer, comm):
        return DataParallelLearner(optimizer, comm, exchange=Quantized(1))

    (quantized,) = hand_driven_warnings(one_bit)
    assert quantized.startswith("DataParallelLearner: distributed_after='auto' is derived from the run's "
                                "facts, but learner.plan(RunFacts(...)) was not called") and "\n" not in quantized
    assert len(hand_driven_warnings(lambda optimizer, comm: BlockMomentumLearner(optimizer, comm, block_size=8))) == 1
    quiet = [lambda optimizer, comm: BlockMomentumLearner(optimizer, comm, block_size=8, distributed_after=0),
             DataParallelLearner]  # given, or float32: no warm start whatever the run
    for build in quiet:
        assert hand_driven_warnings(build) == []
    assert hand_driven_warnings(lambda optimizer, comm: BlockMomentumLearner(optimizer, comm, block_size=8),
                                size=1) == []  # one worker: no warm start whatever the run
    assert hand_driven_warnings(one_bit, plan=DIGITS) == []  # planned: the session's way


def test_the_data_parallel_class_and_its_factory_share_the_automatic_warm_start():
    by_class = DataParallelLearner(sgd(), _Comm(2), exchange=Quantized(1))
    by_factory = data_parallel_distributed_learner(sgd(), _Comm(2), exchange=Quantized(1))
    for learner in (by_class, by_factory):
        learner.plan(DIGITS)
    assert by_class.distributed_after == by_factory.distributed_after > 0


# -- a run too short for the automatic settings ----------------------------------------------------
def _planned(learner, facts=DIGITS):
    learner.plan(facts)
    return learner


def test_the_settings_derived_from_the_run_are_those_left_auto_on_a_learner_that_communicates_less():
    from dtrain.learners import DiLoCoLearner

    adam = torch.optim.Adam(nn.Linear(2, 2).parameters())
    assert _planned(data_parallel_distributed_learner(adam, _Comm(2), num_quantization_bits=1)).automatic_settings() \
        == ["learner.distributed_after", "learner.freeze_variance"]
    assert _planned(BlockMomentumLearner(sgd(), _Comm(2))).automatic_settings() == \
        ["learner.distributed_after", "learner.block_size"]
    assert _planned(DiLoCoLearner(torch.optim.AdamW(nn.Linear(2, 2).parameters()), _Comm(4))).automatic_settings() \
        == ["learner.distributed_after", "learner.block_size"]
    # nothing derived: the exact all-reduce, every setting given, one worker
    assert _planned(data_parallel_distributed_learner(sgd(), _Comm(2))).automatic_settings() == []
    given = BlockMomentumLearner(sgd(), _Comm(2), block_size=512, distributed_after=0)
    assert _planned(given).automatic_settings() == []
    given = data_parallel_distributed_learner(adam, _Comm(2), num_quantization_bits=1, distributed_after=640,
                                              freeze_variance=False)
    assert _planned(given).automatic_settings() == []
    assert _planned(BlockMomentumLearner(sgd(), _Comm(1))).automatic_settings() == []


QUANTIZED_AUTO = ["learner.distributed_after", "learner.freeze_variance"]


def test_a_run_mostly_inside_the_lr_warm_up_is_told_it_is_too_short_for_the_defaults_and_what_to_set():
    from dtrain.session.short_run import short_run_note

    # issue 53's short language-model run: 512,000 samples, 80% of them warming up, the first drop never reached
    note = short_run_note("quantized", QUANTIZED_AUTO, 512_000, 409_600, 4_096_000)
    assert note == (
        "dtrain: note: this run is too short for learner quantized's automatic settings (learner.distributed_after, "
        "learner.freeze_variance): 80% of its 512,000 samples inside the learning-rate warm-up of 409,600 and "
        "session.lr_schedule's first change (at 4,096,000 samples) never reached, where they were "
        "measured with the warm-up ending early and the rate lowered before the end "
        "(docs/learners.md#defaults-that-work); shorten session.lr_schedule (warmup_samples, values) with "
        "session.max_samples, or set learner.distributed_after, learner.freeze_variance yourself, and compare with "
        "learner=data_parallel at this length")
    # the warm-up alone past the warm start's quarter of the run, the rate lowered later on
    assert "80% of its" in short_run_note("diloco", ["learner.block_size"], 100_000, 80_000, 90_000)
    assert "never reached" not in short_run_note("diloco", ["learner.block_size"], 100_000, 80_000, 90_000)
    # the rate never lowered alone (digits cut to 6,000: its drop at 22,500), with a short warm-up or none
    never = short_run_note("block_momentum", ["learner.block_size"], 6_000, 0, 22_500)
    assert "session.lr_schedule's first change (at 22,500 samples) never reached, where" in never
    assert "warm-up of" not in never


def test_a_run_that_meets_the_conditions_or_derives_nothing_from_its_length_gets_no_note():
    from dtrain.session.short_run import short_run_note

    # the recipe's own length: the warm-up over 8% of the run, the rate lowered before the end
    assert short_run_note("quantized", QUANTIZED_AUTO, 5_120_000, 409_600, 4_096_000) == ""
    assert short_run_note("quantized", QUANTIZED_AUTO, 1000, 250, 999) == ""  # the warm-up just within a quarter
    assert short_run_note("quantized", QUANTIZED_AUTO, 1000, 0, None) == ""  # a constant rate: nothing to reach
    assert short_run_note("quantized", QUANTIZED_AUTO, None, 409_600, 4_096_000) == ""  # no length: nothing derived
    assert short_run_note("quantized", [], 512_000, 409_600, 4_096_000) == ""  # every setting given


def test_the_session_gives_the_note_for_a_short_quantized_run(tmp_path):
    from dtrain.schedules import Schedule

    def lines(max_samples):
        torch.manual_seed(0)
        model = nn.Linear(6, 4)
        learner = data_parallel_distributed_learner(torch.optim.Adam(model.parameters()), _Comm(2),
                                                    num_quantization_bits=1)
        session = training_session(model, nn.functional.cross_entropy, learner, MinibatchSource(four_class_data(64, 0)),
                                   minibatch_size=16, max_samples=max_samples, run_dir=tmp_path / "run",
                                   lr_schedule=Schedule([[6, 1.0], [2, 0.1]], epoch_size=64, warmup_samples=160),
                                   progress_bar=False, tensorboard=False)
        learner.plan(RunFacts(samples_per_sweep=64, max_samples=max_samples, minibatch_size=16,
                              warmup_samples=session.schedules.warmup_samples()))
        return session.startup.short_run_note()  # one of the notes the start-up lines print

    assert lines(192).startswith("dtrain: note: this run is too short for learner data_parallel (1-bit exchange)'s "
                                 "automatic settings "
                           "(learner.distributed_after, learner.freeze_variance): 83% of its 192 samples inside")
    assert lines(1920) == ""
