"""The data-parallel learner in one process: bucket planning, exact weighting, argument checks.

A fake two-rank communicator (``_RecordingComm``) records what the learner sends and answers
as if the other rank had sent given values, so hooks, ordering and weighting are checked
without starting processes; real ranks are in tests/dist/test_data_parallel_mpi.py.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from dtrain import comm as dcomm
from dtrain.comm.base import CompletedHandle
from dtrain.exchange import AllReduce, Quantized
from dtrain.learners import (DataParallelLearner, LocalLearner, TwoLevelDataParallelLearner,
                             data_parallel_distributed_learner)
from dtrain.learners._buckets import BYTES_PER_MB, FIRST_BUCKET_BYTES, plan_buckets, plan_gradient_buckets


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 40), nn.ReLU(), nn.Linear(40, 30), nn.ReLU(), nn.Linear(30, 3))


# -- bucket planning ------------------------------------------------------------------------------
@pytest.mark.parametrize("limit_bytes", [1, 100, 800, 4000, 10 ** 9])
def test_buckets_cover_every_parameter_once_in_order_within_the_limit(limit_bytes):
    parameters = list(make_model().parameters())[::-1]
    buckets = plan_buckets(parameters, limit_bytes)
    assert [index for bucket in buckets for index in bucket] == list(range(len(parameters)))
    for bucket in buckets:
        size = sum(parameters[index].numel() * 4 for index in bucket)
        assert size <= limit_bytes or len(bucket) == 1  # only a lone oversized tensor may exceed it
    if limit_bytes == 10 ** 9:
        assert len(buckets) == 1


def test_buckets_never_mix_dtypes():
    tensors = [torch.zeros(10), torch.zeros(10, dtype=torch.float64), torch.zeros(10), torch.zeros(3, dtype=torch.float64)]
    buckets = plan_buckets(tensors, 10 ** 6)
    assert sorted(map(sorted, buckets)) == [[0, 2], [1, 3]]
    with pytest.raises(ValueError, match="positive"):
        plan_buckets(tensors, 0)


def test_learner_buckets_are_in_reverse_parameter_order():
    model = make_model()
    learner = DataParallelLearner(torch.optim.SGD(model.parameters(), lr=0.1), _RecordingComm(), bucket_size_mb=2000 / BYTES_PER_MB)
    learner.prepare(model)
    flat = [parameter for bucket in learner.buckets for parameter in bucket.parameters]
    assert [id(p) for p in flat] == [id(p) for p in reversed(list(model.parameters()))]
    assert len(learner.buckets) > 2
    assert all(bucket.num_bytes <= 2000 or len(bucket.parameters) == 1 for bucket in learner.buckets)
    learner.finalize()


def test_first_gradient_bucket_is_small_as_in_ddp():
    # 1 KiB, 12 KiB, 2 MiB, 4 KiB, 1 MiB tensors: a 25 MiB limit alone would make one bucket
    tensors = [torch.zeros(256), torch.zeros(3072), torch.zeros(512, 1024), torch.zeros(1024), torch.zeros(256, 1024)]
    buckets = plan_gradient_buckets(tensors, 25 * BYTES_PER_MB)
    assert buckets == [[0, 1], [2, 3, 4]]
    assert FIRST_BUCKET_BYTES == torch.distributed._DEFAULT_FIRST_BUCKET_BYTES
    # a limit below 1 MiB applies to the first bucket too
    assert plan_gradient_buckets(tensors, 8000) == plan_buckets(tensors, 8000)
    with pytest.raises(ValueError, match="first_bucket_bytes"):
        plan_buckets(tensors, 100, first_bucket_bytes=0)


def test_the_last_layers_gradients_are_reduced_while_backward_still_runs():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 512), nn.ReLU(), nn.Linear(512, 10))
    comm = _RecordingComm()
    learner = DataParallelLearner(torch.optim.SGD(model.parameters(), lr=0.1), comm)  # 25 MiB buckets
    learner.prepare(model)
    comm.calls.clear()
    learner.begin_minibatch(4, 8)
    first_layer_output = model[0](torch.randn(4, 256))
    launched_before_first_layer = []  # all-reduces issued when backward reaches layer 0
    first_layer_output.register_hook(lambda _: launched_before_first_layer.append(len(comm.calls)))
    model[1:](first_layer_output).sum().backward()
    learner.step()
    last_layers = 512 * 10 + 10 + 512  # the first bucket: Linear(512, 10) and the bias of Linear(1024, 512)
    assert [numel for _, numel in comm.calls] == [last_layers + 3, 1024 * 512 + 1024 + 256 * 1024 + 3]
    assert launched_before_first_layer == [1]
    learner.finalize()


# -- a fake communicator of size 2 ------------------------------------------------------------------
class _RecordingComm(dcomm.LocalCommunicator):
    """Rank 0 of a pretend 2-rank job: the other rank's contribution is ``peer(tensor)``."""

    def __init__(self, peer=torch.zeros_like):
        super().__init__()
        self.peer = peer
        self.calls: list[tuple[str, int]] = []  # (operation, numel) in issue order

    @property
    def size(self) -> int:
        return 2

    def allreduce_async(self, tensor, op="sum"):
        self.calls.append(("allreduce", tensor.numel()))
        tensor.add_(self.peer(tensor))
        if op == "mean":
            tensor.div_(2)
        return CompletedHandle(tensor)

    def allreduce(self, tensor, op="sum"):
        return self.allreduce_async(tensor, op).wait()

    def broadcast(self, tensor, root=0):
        self.calls.append(("broadcast", tensor.numel()))
        return tensor


def test_gradients_are_weighted_by_local_share_and_summed():
    model = make_model()
    learner = DataParallelLearner(torch.optim.SGD(model.parameters(), lr=0.0), _RecordingComm(), bucket_size_mb=1e-3)
    learner.prepare(model)
    learner.comm.calls.clear()  # forget prepare's broadcasts
    features, labels = torch.randn(3, 5), torch.tensor([0, 2, 1])
    alone = copy.deepcopy(model)
    nn.functional.cross_entropy(alone(features), labels).backward()
    local_grads = [p.grad for p in alone.parameters()]
    learner.begin_minibatch(3, 7)  # this rank has 3 of 7 samples; the fake peer sends zeros
    nn.functional.cross_entropy(model(features), labels).backward()
    reductions_during_backward = len(learner.comm.calls)
    learner.step()
    assert reductions_during_backward == len(learner.buckets)  # every bucket launched by the hooks
    for parameter, local in zip(model.parameters(), local_grads):
        torch.testing.assert_close(parameter.grad, local * 3 / 7)
    assert learner.samples_seen == 7


def test_a_rank_without_samples_still_reduces_every_bucket_in_order():
    model = make_model()
    peer_grad = 0.5
    comm = _RecordingComm()
    learner = DataParallelLearner(torch.optim.SGD(model.parameters(), lr=0.0), comm, bucket_size_mb=1e-20)
    learner.prepare(model)
    # every parameter is a bucket of its own, reduced in place; the last bucket carries only their flags
    carrier = learner.buckets[-1]
    assert not carrier.parameters and len(learner.buckets) == len(list(model.parameters())) + 1
    comm.peer = lambda t: torch.ones_like(t) if t.data_ptr() == carrier.buffer.data_ptr() else torch.full_like(t, peer_grad)
    comm.calls.clear()
    learner.begin_minibatch(0, 5)  # no backward on this rank
    learner.step()
    assert comm.calls == [("allreduce", bucket.buffer.numel()) for bucket in learner.buckets]
    for parameter in model.parameters():  # the peer's gradient (and its "has gradient" flag) arrive
        torch.testing.assert_close(parameter.grad, torch.full_like(parameter, peer_grad))


def test_a_parameter_no_rank_used_keeps_no_gradient():
    model = make_model()
    learner = DataParallelLearner(torch.optim.SGD(model.parameters(), lr=0.1, weight_decay=0.1), _RecordingComm())
    learner.prepare(model)
    unused = model[4].bias
    before = unused.detach().clone()
    learner.begin_minibatch(2, 4)
    model[4].weight.sum().backward()  # touches only the last weight
    learner.step()
    assert unused.grad is None and torch.equal(unused, before)  # weight decay did not touch it
    torch.testing.assert_close(model[4].weight.grad, torch.full_like(model[4].weight, 0.5))


def test_two_backwards_in_one_minibatch_are_refused():
    model = make_model()
    learner = DataParallelLearner(torch.optim.SGD(model.parameters(), lr=0.1), _RecordingComm())
    learner.prepare(model)
    learner.begin_minibatch(1, 2)
    model(torch.randn(1, 5)).sum().backward()
    with pytest.raises(RuntimeError, match="one backward"):
        model(torch.randn(1, 5)).sum().backward()


def test_hooks_are_removed_by_finalize():
    model = make_model()
    comm = _RecordingComm()
    learner = DataParallelLearner(torch.optim.SGD(model.parameters(), lr=0.1), comm)
    learner.prepare(model)
    learner.finalize()
    learner._reducing = True  # even if armed, no hook is left to fire
    model(torch.randn(2, 5)).sum().backward()
    assert not any(operation == "allreduce" for operation, _ in comm.calls)


# -- one worker -----------------------------------------------------------------------------------
def test_one_worker_steps_exactly_like_the_local_learner():
    results = []
    for make_learner in (LocalLearner, data_parallel_distributed_learner):
        model = make_model()
        learner = make_learner(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
        learner.prepare(model)
        torch.manual_seed(1)
        for _ in range(3):
            learner.begin_minibatch(4, 4)
            nn.functional.cross_entropy(model(torch.randn(4, 5)), torch.tensor([0, 1, 2, 0])).backward()
            learner.step()
        learner.finalize()
        results.append(([p.detach().clone() for p in model.parameters()], learner.samples_seen))
    assert all(torch.equal(a, b) for a, b in zip(results[0][0], results[1][0])) and results[0][1] == results[1][1]
    assert not DataParallelLearner(torch.optim.SGD(make_model().parameters(), lr=0.1)).buckets


def test_state_dict_round_trip_and_kind():
    model = make_model()
    learner = data_parallel_distributed_learner(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    assert learner.kind == "data_parallel"
    learner.samples_seen = 96
    other = data_parallel_distributed_learner(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    other.load_state_dict(learner.state_dict())
    assert other.samples_seen == 96
    with pytest.raises(ValueError, match="'local'"):
        other.load_state_dict(LocalLearner(torch.optim.SGD(model.parameters(), lr=0.1)).state_dict())


# -- arguments ------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, message", [
    ({"num_quantization_bits": 0}, "num_quantization_bits=0: expected a whole number of bits from 1 to 32"),
    ({"num_quantization_bits": 33}, "num_quantization_bits"),
    ({"num_quantization_bits": 8.0}, "num_quantization_bits"),
    ({"bucket_size_mb": 0}, "bucket_size_mb=0: expected a positive finite number of MiB"),
    ({"bucket_size_mb": -1.5}, "bucket_size_mb"),
    ({"bucket_size_mb": float("inf")}, "bucket_size_mb=inf: expected a positive finite number"),
    ({"distributed_after": -1}, "distributed_after=-1: expected a non-negative whole number of samples"),
])
def test_bad_arguments_are_refused_with_the_fix(kwargs, message):
    with pytest.raises(ValueError, match=message):
        data_parallel_distributed_learner(torch.optim.SGD(make_model().parameters(), lr=0.1), **kwargs)


def test_fewer_bits_build_the_data_parallel_learner_with_the_k_bit_exchange():
    """CNTK's ``num_quantization_bits`` is a thin way onto the one data-parallel learner: its exchange is k-bit."""
    learner = data_parallel_distributed_learner(torch.optim.SGD(make_model().parameters(), lr=0.1),
                                                num_quantization_bits=2)
    assert type(learner) is DataParallelLearner and learner.kind == "data_parallel"
    assert isinstance(learner.exchange, Quantized) and learner.exchange.num_bits == 2
    assert learner.exchange.error_feedback and learner.exchange.requantize_sum == "auto"
    full = data_parallel_distributed_learner(torch.optim.SGD(make_model().parameters(), lr=0.1))
    assert isinstance(full.exchange, AllReduce)


@pytest.mark.parametrize("build", [data_parallel_distributed_learner, DataParallelLearner, TwoLevelDataParallelLearner])
@pytest.mark.parametrize("keywords, message", [
    ({"error_feedback": False}, "error_feedback=False: no longer a learner keyword; pass "
                                "exchange=Quantized(num_bits, error_feedback=False)"),
    ({"requantize_sum": True}, "requantize_sum=True: no longer a learner keyword; pass "
                               "exchange=Quantized(num_bits, requantize_sum=True)"),
    ({"warm_start": "local"}, "warm_start='local': no longer a learner keyword; pass warm_start_mode='local'"),
])
def test_retired_learner_keywords_are_refused_in_one_line_naming_what_to_pass_now(build, keywords, message):
    with pytest.raises(TypeError) as refused:
        build(torch.optim.SGD(make_model().parameters(), lr=0.1), **keywords)
    assert str(refused.value) == message


def test_the_learners_refuse_the_quantized_learners_bits_and_an_unknown_keyword_as_python_does():
    optimizer = torch.optim.SGD(make_model().parameters(), lr=0.1)
    with pytest.raises(TypeError, match=r"^num_quantization_bits=4: no longer a learner keyword; pass "
                                        r"exchange=Quantized\(4\)$"):
        DataParallelLearner(optimizer, num_quantization_bits=4)
    with pytest.raises(TypeError, match=r"^DataParallelLearner\(\) got an unexpected keyword argument 'bits'$"):
        DataParallelLearner(optimizer, bits=4)
    with pytest.raises(ImportError):
        from dtrain.learners import QuantizedDataParallelLearner  # noqa: F401 -- one class now


def test_an_unprepared_multi_worker_learner_refuses_to_train():
    learner = DataParallelLearner(torch.optim.SGD(make_model().parameters(), lr=0.1), _RecordingComm())
    with pytest.raises(RuntimeError, match="prepare"):
        learner.begin_minibatch(1, 2)
