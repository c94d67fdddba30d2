"""Worker run by tests/dist/test_diloco_mpi.py under mpiexec: ``python _diloco_worker.py``.

Cases (each rank trains a toy model on its share of every global minibatch):

* ``bmuf_q8``, ``bmuf_q4``: block momentum whose block deltas travel 8-bit / 4-bit with error
  feedback (``dtrain.exchange.Quantized``); ``diloco``: DiLoCo with fp32 deltas; ``diloco_q4``:
  DiLoCo with 4-bit deltas. After every sync the ranks all-gather their parameters (the difference must be exactly 0);
  each case is a named check returning every sync's difference, bytes and compression ratio.
* ``diloco`` is also replayed by the single-process reference (tests/helpers/diloco_reference.py:
  torch's SGD with Nesterov on ``W_prev - mean W_i``) and must agree to 1e-5 (float32).
* ``resume``: for ``bmuf_q4`` and ``diloco_q4`` a learner restored mid-run from
  ``state_dict`` + ``local_state_dict`` (the residuals) continues bit for bit; restored without
  the residuals it does not (so the test sees them matter).

Prints ``PASS <case> rank r/size`` per case.
"""
from __future__ import annotations

import functools
import io
import sys

import torch
from torch import nn

from tests.helpers.bmuf_reference import flat, train_learner_shares
from tests.helpers.checks import run_checks
from tests.helpers.compare import assert_syncs_match
from tests.helpers.diloco_reference import simulate_diloco

from dtrain.comm import create_communicator, install_fail_fast
from dtrain.exchange import Quantized
from dtrain.learners import BlockMomentumLearner, DiLoCoLearner

TOLERANCE = 1e-5
GLOBAL_SIZES = [16] * 16
generator = torch.Generator().manual_seed(3)
FEATURES = torch.randn(512, 5, generator=generator)
TARGETS = torch.randn(512, 3, generator=generator)
CASES = {
    # name: (learner class, options, exchange bits or None)
    "bmuf_q8": (BlockMomentumLearner, dict(block_size=32, distributed_after=0), 8),
    "bmuf_q4": (BlockMomentumLearner, dict(block_size=32, distributed_after=0), 4),
    "diloco": (DiLoCoLearner, dict(block_size=32, distributed_after=16), None),
    "diloco_q4": (DiLoCoLearner, dict(block_size=32, distributed_after=0), 4),
}


def make_model(seed: int) -> nn.Module:
    # no bias before the BatchNorm: its gradient would be rounding noise, which Adam's
    # normalisation turns into lr-sized steps that no two summation orders agree on
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 16, bias=False), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 3))


def make_optimizer(model: nn.Module, learner_class) -> torch.optim.Optimizer:
    if learner_class is DiLoCoLearner:
        return torch.optim.AdamW(model.parameters(), lr=0.01)
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def local_loss(model: nn.Module, start: int, stop: int) -> torch.Tensor:
    return nn.functional.mse_loss(model(FEATURES[start:stop]), TARGETS[start:stop])


def build(comm, case: str, seed: int):
    learner_class, options, bits = CASES[case]
    model = make_model(seed)
    exchange = Quantized(num_bits=bits) if bits else None
    learner = learner_class(make_optimizer(model, learner_class), comm, exchange=exchange, **options)
    return model, learner


def check_one_model(comm, case: str, model, learner, snapshots: list, syncs: list) -> None:
    mine = flat(model.parameters())
    difference = max(float((theirs - mine).abs().max()) for theirs in comm.allgather(mine))
    buffers = flat(model.buffers()) if list(model.buffers()) else torch.zeros(0)
    buffer_difference = max(float((theirs - buffers).abs().max()) for theirs in comm.allgather(buffers.float()))
    assert difference == 0.0 and buffer_difference == 0.0, (case, learner.syncs, difference, buffer_difference)
    snapshots.append(mine)
    syncs.append({"sync": learner.syncs, "difference": difference, "bytes": learner.bytes_sent_last_step,
                  "ratio": learner.compression_ratio})


def train(comm, case: str) -> tuple[list[torch.Tensor], torch.Tensor, list[dict]]:
    """Trains ``case``; returns the model after every sync, the final one, and each sync's figures."""
    model, learner = build(comm, case, seed=comm.rank)  # different on every rank: prepare() broadcasts rank 0's
    learner.prepare(model)
    snapshots: list[torch.Tensor] = []
    syncs: list[dict] = []
    train_learner_shares(learner, model, local_loss, GLOBAL_SIZES,
                         on_sync=lambda: check_one_model(comm, case, model, learner, snapshots, syncs))
    if learner.global_samples_in_block:
        learner.synchronize()
        check_one_model(comm, case, model, learner, snapshots, syncs)
    assert learner.syncs >= 4, learner.syncs
    assert learner.exchange_seconds_last_step >= 0.0
    return snapshots, flat(model.parameters()), syncs


def simulate(size: int, case: str) -> tuple[list[torch.Tensor], torch.Tensor]:
    learner_class, options, _ = CASES[case]
    models = [make_model(0) for _ in range(size)]
    return simulate_diloco(models, [make_optimizer(model, learner_class) for model in models], local_loss,
                           GLOBAL_SIZES, **options)


def check_resume(comm, case: str) -> None:
    """Restored mid-run (replicated + per-rank state), the learner continues bit for bit."""
    model, learner = build(comm, case, seed=0)
    learner.prepare(model)
    position = train_learner_shares(learner, model, local_loss, [16] * 6)
    learner.synchronize()
    saved = io.BytesIO()
    torch.save({"learner": learner.state_dict(), "local": learner.local_state_dict(),
                "model": model.state_dict()}, saved)
    train_learner_shares(learner, model, local_loss, [16] * 6, position=position)
    learner.synchronize()
    expected = flat(model.parameters())

    outcomes = {}
    for with_residuals in (True, False):
        saved.seek(0)
        state = torch.load(saved, weights_only=True)
        model2, restored = build(comm, case, seed=0)
        model2.load_state_dict(state["model"])
        restored.load_state_dict(state["learner"])
        if with_residuals:
            restored.load_local_state_dict(state["local"])
        restored.prepare(model2)
        train_learner_shares(restored, model2, local_loss, [16] * 6, position=position)
        restored.synchronize()
        outcomes[with_residuals] = flat(model2.parameters())
    assert torch.equal(outcomes[True], expected), (case, float((outcomes[True] - expected).abs().max()))
    assert not torch.equal(outcomes[False], expected), f"{case}: the residuals made no difference"
    residuals = state["local"]["exchange"]["per_key"]["model"]["worker_residual"]
    assert residuals is not None and float(residuals.abs().sum()) > 0
    comm.barrier()


def check_case(comm, case: str) -> list[dict]:
    """One model on every rank after every sync; DiLoCo equal to the reference. Returns the syncs' figures."""
    snapshots, final, syncs = train(comm, case)
    if case == "diloco":
        expected_snapshots, expected_final = simulate(comm.size, case)
        assert_syncs_match(f"{case}: outer step", snapshots + [final], expected_snapshots + [expected_final],
                           TOLERANCE)
    comm.barrier()
    return syncs


def main() -> None:
    comm = create_communicator(backend="gloo", timeout_s=60)
    install_fail_fast(comm)
    torch.set_num_threads(1)  # oversubscribed ranks on a small machine
    run_checks(comm, {**{case: functools.partial(check_case, case=case) for case in CASES},
                      **{f"resume_{case}": functools.partial(check_resume, case=case) for case in ("bmuf_q4", "diloco_q4")}})
    comm.finalize()


if __name__ == "__main__":
    sys.exit(main())
