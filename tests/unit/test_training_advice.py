"""The advice that ends a diverged or collapsed run names only what the run uses: no 1-bit gradients or
warm start in a one-process run, fp16 only in fp16, bits only with a k-bit exchange on several ranks."""
from __future__ import annotations

import functools
import io
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from dtrain import LocalLearner, MinibatchSource, training_session
from dtrain.learners import (Advice, BlockMomentumLearner, DataParallelLearner, DiLoCoLearner, Learner,
                             LocalSGDLearner)
from dtrain.exchange import AllReduce, CompressedAllReduce, PowerSGD, Quantized
from dtrain.session import TrainingDiverged
from dtrain.session.collapse import training_advice

from tests.helpers.toy_data import four_class_data


class _Comm:
    """A stand-in communicator of ``size`` ranks for learners that are only built, never stepped."""

    device = torch.device("cpu")
    rank, is_main = 0, True

    def __init__(self, size: int):
        self.size = size


def learner(kind: str, size: int, exchange=None, freeze_variance: bool | str = "auto") -> Learner:
    """A learner of ``kind`` on ``size`` ranks (built only: the advice is what it declares); ``freeze_variance``
    true gives it Adam, whose variance it then holds under a lossy exchange."""
    model = nn.Linear(2, 2)
    optimizer = torch.optim.Adam(model.parameters()) if freeze_variance is True else \
        torch.optim.SGD(model.parameters(), lr=0.1)
    if kind == "local":
        return LocalLearner(optimizer)
    if kind in BLOCK_LEARNERS:
        return BLOCK_LEARNERS[kind](optimizer, _Comm(size), exchange=exchange)
    return DataParallelLearner(optimizer, _Comm(size), exchange=exchange, freeze_variance=freeze_variance)


BLOCK_LEARNERS = {"block_momentum": BlockMomentumLearner, "diloco": DiLoCoLearner, "local_sgd": LocalSGDLearner}


@pytest.mark.parametrize("precision_setting", ["32", "bf16", "fp16"])
def test_a_diverging_one_process_run_is_told_only_about_its_learning_rate_and_precision(tmp_path, precision_setting):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 4))
    session = training_session(model, nn.functional.cross_entropy,
                               LocalLearner(torch.optim.SGD(model.parameters(), lr=1e8)),
                               MinibatchSource(four_class_data()), 20, max_samples=400, progress_frequency=40,
                               run_dir=tmp_path, tensorboard=False, stream=io.StringIO(), precision=precision_setting)
    with pytest.raises(TrainingDiverged) as diverged:
        session.train()
    message = str(diverged.value)
    assert "lower optimizer.lr" in message and "\n" not in message
    assert not any(word in message for word in ("1-bit", "bits", "distributed_after", "warm start")), message
    assert ("session.precision=bf16" in message) is (precision_setting == "fp16"), message


def test_each_cause_is_named_only_where_the_run_has_it():
    alone = training_advice(learner("local", 1))
    assert alone == "the likely cause is a learning rate too high for this learner; lower optimizer.lr"
    assert training_advice(learner("quantized", 1, Quantized(1))) == alone  # one process exchanges nothing
    assert training_advice(learner("data_parallel", 2, AllReduce())) == alone

    one_bit = training_advice(learner("quantized", 2, Quantized(1)))
    assert "1-bit gradients started too early" in one_bit and "learner.distributed_after=SAMPLES" in one_bit
    assert "use more bits (2 or more: learner.exchange.num_bits)" in one_bit
    assert "requantize_sum" not in one_bit  # (not bound to a job: nothing is known to be re-quantized)
    for setting, told in (("auto", False), (True, True)):  # at 2 workers "auto" sums without re-quantizing
        strategy = Quantized(1, requantize_sum=setting)
        strategy.bind(SimpleNamespace(size=2))
        advice = training_advice(learner("quantized", 2, strategy))
        advised = "sum the workers' codes without re-quantizing them (learner.exchange.requantize_sum=false)"
        assert (advised in advice) is told
    assert "freeze_variance" not in one_bit  # SGD, or the variance not held
    held = training_advice(learner("quantized", 2, Quantized(1), freeze_variance=True))
    assert "let the optimizer's variance follow the gradients (learner.freeze_variance=false)" in held
    powersgd = training_advice(learner("data_parallel", 2, PowerSGD()))
    assert "gradients compressed by powersgd rank 1" in powersgd and "learner/exchange=allreduce" in powersgd
    assert "bits" not in powersgd and "distributed_after" not in powersgd

    block = training_advice(learner("block_momentum", 2, AllReduce()))
    assert "local steps started from an untrained model" in block and "learner.distributed_after" in block
    assert training_advice(learner("block_momentum", 1, AllReduce())) == alone
    fp16 = training_advice(learner("local", 1), "fp16")
    assert "float16 overflowing" in fp16 and fp16.endswith("or train in bf16 (session.precision=bf16)")


@pytest.mark.parametrize("kind", sorted(BLOCK_LEARNERS))
def test_a_block_learner_is_told_about_the_model_changes_it_sends_not_gradients(kind):
    """A block learner sums model changes: a lossy exchange compressed those, and its local steps are a cause."""
    four_bit = training_advice(learner(kind, 2, Quantized(4)))
    assert "4-bit model changes started too early" in four_bit and "gradients" not in four_bit, four_bit
    assert "local steps started from an untrained model" in four_bit and "use more bits (5 or more" in four_bit
    assert four_bit.count("learner.distributed_after") == 1, four_bit  # one warm start, not two
    bf16 = training_advice(learner(kind, 2, CompressedAllReduce("bf16")))
    assert "model changes compressed by bf16 all-reduce" in bf16 and "gradients" not in bf16, bf16
    assert "learner/exchange=allreduce" in bf16 and "train longer on one model first" in bf16


@pytest.mark.parametrize("kind", sorted(BLOCK_LEARNERS))
def test_an_outer_optimizer_from_the_config_is_named_first_with_its_lr(kind):
    """An outer optimizer's lr is a step per sync: a run it left at chance is told to set it, before the inner lr."""
    optimizer = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    built = BLOCK_LEARNERS[kind](optimizer, _Comm(1), outer_optimizer=functools.partial(torch.optim.Adam, lr=0.001))
    told = training_advice(built)
    assert told.startswith("the likely cause is the outer optimizer Adam (lr 0.001), or a learning rate too high"), told
    assert "; set learner.outer_optimizer.lr to the scale of a block's model change" in told, told
    assert "outer optimizer" not in training_advice(learner(kind, 1))  # its own outer step: the base's advice


def test_a_learner_of_ones_own_gets_the_bases_advice_and_may_add_its_own():
    """A learner written as docs/writing-a-learner.md shows: the base's advice, its exchange's on several ranks,
    and its own causes through the hook."""

    class Averaging(Learner):
        def __init__(self, optimizer, comm, exchange):
            super().__init__(optimizer, comm)
            self.exchange = exchange

        def apply_update(self) -> None:
            self.optimizer.step()

    class Cautious(Averaging):
        def collapse_advice(self) -> Advice:
            return super().collapse_advice() + Advice(("stale averages",), ("average more often (learner.every=N)",))

    sgd = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    assert training_advice(Averaging(sgd, _Comm(1), None)) == training_advice(learner("local", 1))
    assert "gradients compressed by powersgd rank 1" in training_advice(Averaging(sgd, _Comm(2), PowerSGD()))
    own = training_advice(Cautious(sgd, _Comm(2), None))
    assert own.startswith("the likely cause is a learning rate too high for this learner, or stale averages; ")
    assert own.endswith("lower optimizer.lr, or average more often (learner.every=N)")
    assert Averaging(sgd, _Comm(2), Quantized(1)).label() == "Averaging (1-bit exchange)"
