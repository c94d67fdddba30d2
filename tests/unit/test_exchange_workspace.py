"""The quantized exchange's reused scratch buffers and its compute vs transport timing."""
from __future__ import annotations

import time

import pytest
import torch

from tests.helpers.thread_world import FakeWorld

from dtrain.compress import ColumnLayout, Workspace, dequantize, quantize, quantize_with_feedback
from dtrain.exchange.quantized import QuantizedExchange

SHAPES = [(64, 3, 3, 3), (64,), (10, 128), (33, 17)]


def test_workspace_results_equal_fresh_ones_and_reuse_the_same_storage():
    layout = ColumnLayout.for_shapes(SHAPES)
    workspace = Workspace()
    residual_plain, residual_reused = torch.zeros(layout.numel), torch.zeros(layout.numel)
    storages = set()
    for step in range(3):
        values = torch.randn(layout.numel, generator=torch.Generator().manual_seed(step))
        plain = quantize_with_feedback(values, residual_plain, layout, 1)
        reused = quantize_with_feedback(values, residual_reused, layout, 1, workspace)
        assert torch.equal(plain.codes, reused.codes) and torch.equal(plain.lower, reused.lower)
        assert torch.equal(residual_plain, residual_reused)
        storages.add(reused.codes.untyped_storage().data_ptr())
        decoded = dequantize(quantize(values, layout, 3, workspace), layout, workspace=workspace)
        assert torch.equal(decoded, dequantize(quantize(values, layout, 3), layout))
    assert len(storages) == 1  # the codes land in the same buffer every step: nothing allocated per step


class _SlowWorld(FakeWorld):
    """Every collective takes at least ``delay`` seconds, as a slow link would."""

    delay = 0.05

    def gather(self, rank, item):
        time.sleep(self.delay)
        return super().gather(rank, item)


@pytest.mark.parametrize("requantize_sum, collectives", [(True, 2), (False, 1)])
def test_exchange_splits_its_time_into_compute_and_transport(requantize_sum, collectives):
    def work(comm):
        exchange = QuantizedExchange(comm, 1, requantize_sum=requantize_sum)
        gradients = [torch.randn(shape) for shape in SHAPES]
        exchange.allreduce_(gradients)
        return exchange.seconds_last_step, exchange.transport_seconds_last_step, exchange.compute_seconds_last_step

    for total, transport, compute in _SlowWorld(2).run(work):
        # two phases, each one collective here; the gathered sum one all-gather
        assert collectives * _SlowWorld.delay <= transport < (collectives + 1) * _SlowWorld.delay
        assert 0 <= compute < total and abs(compute + transport - total) < 1e-9
