"""The advice that ends a diverged or collapsed run names only what the run uses: no 1-bit gradients or
warm start in a one-process run, fp16 only in fp16, bits only with a k-bit exchange on several ranks."""
from __future__ import annotations

import io
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from dtrain import LocalLearner, MinibatchSource, training_session
from dtrain.exchange import AllReduce, PowerSGD, Quantized
from dtrain.session import TrainingDiverged
from dtrain.session.collapse import training_advice

from tests.helpers.toy_data import four_class_data


def learner(kind: str, size: int, exchange=None, freeze_variance: bool = False) -> SimpleNamespace:
    """What ``training_advice`` reads of a learner."""
    return SimpleNamespace(kind=kind, comm=SimpleNamespace(size=size), exchange=exchange,
                           freeze_variance=freeze_variance)


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
    fp16 = training_advice(learner("local", 1), "fp16")
    assert "float16 overflowing" in fp16 and fp16.endswith("or train in bf16 (session.precision=bf16)")
