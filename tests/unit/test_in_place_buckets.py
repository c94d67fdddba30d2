"""Large gradients reduced in place (no copy into a packed bucket), and the loss-scale fold that
spares the data-parallel learner its pass over every gradient."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from dtrain import comm as dcomm
from dtrain.comm.base import CompletedHandle
from dtrain.learners import DataParallelLearner, LocalLearner
from dtrain.learners._buckets import InPlaceBucket, plan_gradient_buckets

KIB = 1024


class _PeerComm(dcomm.LocalCommunicator):
    """Rank 0 of a pretend 2-rank job whose peer adds ``peer(tensor)`` to every all-reduce."""

    def __init__(self):
        super().__init__()
        self.peer = torch.zeros_like
        self.reduced: list[int] = []  # data_ptr of every tensor all-reduced, in order

    @property
    def size(self) -> int:
        return 2

    def allreduce_async(self, tensor, op="sum"):
        self.reduced.append(tensor.data_ptr())
        tensor.add_(self.peer(tensor))
        return CompletedHandle(tensor)

    def allreduce(self, tensor, op="sum"):
        return self.allreduce_async(tensor, op).wait()

    def broadcast(self, tensor, root=0):
        return tensor


def floats(kib: int) -> torch.Tensor:
    return torch.zeros(kib * KIB // 4)


def test_large_tensors_get_buckets_of_their_own_and_a_packed_bucket_comes_last():
    # ready order: small, LARGE, small, small, LARGE (the first layer's weight is last and large)
    tensors = [floats(1), floats(64), floats(2), floats(1), floats(64)]
    buckets = plan_gradient_buckets(tensors, 1e9, in_place_bytes=64 * KIB)
    assert buckets == [[0], [1], [4], [2, 3]]  # the last packed bucket moves behind the last large one
    # every tensor large: an empty packed bucket carries the flags
    assert plan_gradient_buckets([floats(64), floats(64)], 1e9, in_place_bytes=64 * KIB) == [[0], [1], []]
    # no large tensor: the plan without in-place buckets
    assert plan_gradient_buckets(tensors[:4:2], 1e9, in_place_bytes=1e9) == plan_gradient_buckets(tensors[:4:2], 1e9)


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 3))  # 32 KiB and 1.5 KiB weights


@pytest.mark.parametrize("reduce_alone_bytes, in_place", [(8 * 2 ** 20, []), (16 * KIB, ["0.weight"]),
                                                          (1 * KIB, ["0.weight", "2.weight"])])
def test_the_in_place_limit_is_the_communicators(reduce_alone_bytes, in_place):
    """The learner reduces in place what the transport says is cheaper alone (``Communicator.reduce_alone_bytes``:
    8 MiB for Gloo, 1 MiB for MPI), with buckets of the default 25 MiB."""
    model = make_model()
    comm = _PeerComm()
    comm.reduce_alone_bytes = reduce_alone_bytes
    learner = DataParallelLearner(torch.optim.SGD(model.parameters(), lr=0.0), comm)
    learner.prepare(model)
    names = {id(parameter): name for name, parameter in model.named_parameters()}
    assert sorted(names[id(bucket.parameters[0])] for bucket in learner.buckets
                  if isinstance(bucket, InPlaceBucket)) == in_place


def test_a_large_gradient_is_reduced_in_place_without_a_copy():
    model = make_model()
    comm = _PeerComm()
    learner = DataParallelLearner(torch.optim.SGD(model.parameters(), lr=0.0), comm, bucket_size_mb=16 / 1024)
    learner.prepare(model)
    assert [type(bucket).__name__ for bucket in learner.buckets].count("InPlaceBucket") == 1
    comm.peer = lambda tensor: tensor  # the other rank had the same gradient: the sum doubles it
    features, labels = torch.randn(4, 64), torch.tensor([0, 1, 2, 0])
    learner.begin_minibatch(4, 8)
    nn.functional.cross_entropy(model(features), labels).backward()
    big_grad = model[0].weight.grad
    learner.step()
    assert model[0].weight.grad is big_grad                      # the very tensor backward made
    assert big_grad.data_ptr() in comm.reduced                   # ... was all-reduced itself
    reference = copy.deepcopy(make_model())
    nn.functional.cross_entropy(reference(features), labels).backward()
    for parameter, expected in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(parameter.grad, expected.grad)  # (g/2 + g/2): the mean over 8 samples


@pytest.mark.parametrize("peer_had_it", [True, False])
def test_an_in_place_parameter_without_a_gradient_here_gets_the_peers_or_none(peer_had_it):
    model = make_model()
    comm = _PeerComm()
    learner = DataParallelLearner(torch.optim.SGD(model.parameters(), lr=0.1, weight_decay=0.1), comm,
                                  bucket_size_mb=16 / 1024)
    learner.prepare(model)
    in_place = next(bucket for bucket in learner.buckets if isinstance(bucket, InPlaceBucket))
    assert in_place.parameters[0] is model[0].weight
    carrier = learner.buckets[-1]
    flag_slot = carrier.buffer.numel() - 1  # the in-place bucket's flag: the carrier's last slot

    def peer(tensor: torch.Tensor) -> torch.Tensor:
        contribution = torch.zeros_like(tensor)
        if tensor.numel() == model[0].weight.numel() and peer_had_it:
            contribution.fill_(0.25)
        if tensor.data_ptr() == carrier.buffer.data_ptr() and peer_had_it:
            contribution[flag_slot] = 1
        return contribution

    comm.peer = peer
    before = model[0].weight.detach().clone()
    learner.begin_minibatch(2, 4)
    model[2].weight.sum().backward()  # this rank touches only the last layer's weight
    learner.step()
    if peer_had_it:
        torch.testing.assert_close(model[0].weight.grad, torch.full_like(model[0].weight, 0.25))
    else:
        assert model[0].weight.grad is None and torch.equal(model[0].weight, before)  # no weight decay either


def test_the_folded_scale_gives_the_same_update_as_scaling_each_gradient():
    results = []
    for fold in (False, True):
        model = make_model()
        learner = DataParallelLearner(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), _PeerComm(),
                                      bucket_size_mb=16 / 1024)
        learner.prepare(model)
        torch.manual_seed(1)
        for _ in range(3):
            learner.begin_minibatch(4, 8)
            scale = learner.fold_gradient_scale() if fold else 1.0
            assert scale == (0.5 if fold else 1.0)
            (nn.functional.cross_entropy(model(torch.randn(4, 64)), torch.tensor([0, 1, 2, 0])) * scale).backward()
            learner.step()
        results.append([parameter.detach().clone() for parameter in model.parameters()])
    for unfolded, folded in zip(*results):
        assert torch.equal(unfolded, folded)  # a power-of-two scale: bit-identical


def test_nothing_is_folded_for_local_steps_or_under_fp16_loss_scaling():
    model = make_model()
    assert LocalLearner(torch.optim.SGD(model.parameters(), lr=0.1)).fold_gradient_scale() == 1.0
    learner = DataParallelLearner(torch.optim.SGD(model.parameters(), lr=0.1), _PeerComm())
    learner.prepare(model)
    learner.loss_scale = 1024.0
    learner.begin_minibatch(4, 8)
    assert learner.fold_gradient_scale() == 1.0
