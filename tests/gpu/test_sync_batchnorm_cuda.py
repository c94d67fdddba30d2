"""dtrain's synchronized BatchNorm on CUDA against ``torch.nn.SyncBatchNorm``'s own CUDA kernels, and a model
trained with one CUDA rank and one CPU rank against one process. Skipped where ``torch.cuda.is_available()`` is
False (CI has no GPU); run with ``python -m pytest -m gpu``.

Two ranks are two threads (``tests.helpers.thread_world``). Both BatchNorm functions are called directly
(forward, then backward with a given output gradient) rather than through autograd, whose single CUDA device
thread would run the two ranks' backward passes one after the other and deadlock their collectives.
"""
from __future__ import annotations

import copy
import threading

import pytest
import torch
from torch import nn

from dtrain.nn import BatchNormSync, convert_sync_batchnorm
from dtrain.nn.sync_batchnorm import _SyncBatchNormFunction

from tests.helpers.thread_world import FakeWorld

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


class _Context:
    """What an autograd Function's ``ctx`` offers its forward and backward."""

    def __init__(self, needs_input_grad):
        self.needs_input_grad = needs_input_grad

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors


class _GlooLikeGroup:
    """torch's SyncBatchNorm asks its process group for the backend; Gloo's path uses ``dist.all_gather``."""

    @staticmethod
    def _get_backend_name():
        return "gloo"


def _torch_collectives(monkeypatch, world: FakeWorld):
    """torch.distributed's all_gather and all_reduce for threads: each thread's rank is in ``local.rank``."""
    local = threading.local()

    def all_gather(outputs, tensor, group=None, async_op=False):
        for output, item in zip(outputs, world.gather(local.rank, tensor.clone())):
            output.copy_(item)

    def all_reduce(tensor, op=None, group=None, async_op=False):
        tensor.copy_(torch.stack(world.gather(local.rank, tensor.clone())).sum(0))

    monkeypatch.setattr(torch.distributed, "all_gather", all_gather)
    monkeypatch.setattr(torch.distributed, "all_reduce", all_reduce)
    return local


@pytest.mark.parametrize("shares", [(6, 6), (7, 3), (5, 0)])
def test_forward_backward_and_running_statistics_match_torch_sync_batchnorm(monkeypatch, shares):
    from torch.nn.modules._functions import SyncBatchNorm as TorchSyncBatchNorm

    channels, total = 4, sum(shares)
    generator = torch.Generator().manual_seed(0)
    inputs = (torch.randn(total, channels, 5, 5, generator=generator) * 3 + 1).cuda()
    grads = torch.randn(total, channels, 5, 5, generator=generator).cuda()
    weight, bias = torch.rand(channels).cuda() + 0.5, torch.randn(channels).cuda()
    starts = [0, shares[0]]
    world = FakeWorld(2, devices=["cuda"])
    local = _torch_collectives(monkeypatch, world)

    def work(comm):
        local.rank = comm.rank
        share = slice(starts[comm.rank], starts[comm.rank] + shares[comm.rank])
        x, dy = inputs[share].contiguous(), grads[share].contiguous()
        theirs_mean, theirs_var = torch.zeros(channels).cuda(), torch.ones(channels).cuda()
        ctx = _Context((True, True, True))
        theirs = TorchSyncBatchNorm.forward(ctx, x, weight, bias, theirs_mean, theirs_var, 1e-5, 0.1,
                                            _GlooLikeGroup(), 2)
        theirs_grads = TorchSyncBatchNorm.backward(ctx, dy)[:3]
        ours_mean, ours_var = torch.zeros(channels).cuda(), torch.ones(channels).cuda()
        ctx = _Context((True, True, True))
        ours = _SyncBatchNormFunction.forward(ctx, x, weight, bias, ours_mean, ours_var, 1e-5, 0.1, BatchNormSync(comm))
        ours_grads = _SyncBatchNormFunction.backward(ctx, dy)[:3]
        return theirs, theirs_grads, theirs_mean, theirs_var, ours, ours_grads, ours_mean, ours_var

    for theirs, theirs_grads, theirs_mean, theirs_var, ours, ours_grads, ours_mean, ours_var in world.run(work):
        assert ours.is_cuda
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(ours_mean, theirs_mean, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(ours_var, theirs_var, rtol=1e-5, atol=1e-6)
        if theirs.numel():
            torch.testing.assert_close(ours_grads[0], theirs_grads[0], rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(ours_grads[1], theirs_grads[1], rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(ours_grads[2], theirs_grads[2], rtol=1e-4, atol=1e-4)


def test_a_cuda_rank_and_a_cpu_rank_equal_one_process():
    """A BatchNorm model, rank 0 on CUDA and rank 1 on the CPU, uneven shares: one process's gradients and
    running statistics (on CUDA, whose float32 differs from the CPU's in the last bits)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                          nn.Linear(100, 3))
    inputs, targets = torch.randn(9, 2, 5, 5), torch.randint(0, 3, (9,))
    reference = copy.deepcopy(model).cuda()
    nn.functional.cross_entropy(reference(inputs.cuda()), targets.cuda()).backward()

    def work(comm):
        local = convert_sync_batchnorm(copy.deepcopy(model).to(comm.device), BatchNormSync(comm))
        share = slice(0, 6) if comm.rank == 0 else slice(6, 9)
        output = local(inputs[share].to(comm.device))
        loss = nn.functional.cross_entropy(output, targets[share].to(comm.device)) * (output.shape[0] / 9)
        loss.backward()
        return [comm.allreduce(p.grad.clone()).cpu() for p in local.parameters()], local[1].running_var.cpu()

    for grads, running_var in FakeWorld(2, devices=["cuda", "cpu"]).run(work):
        for got, want in zip(grads, reference.parameters()):
            torch.testing.assert_close(got, want.grad.cpu(), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(running_var, reference[1].running_var.cpu(), rtol=1e-5, atol=1e-6)
