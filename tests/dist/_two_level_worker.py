"""Worker run by tests/dist/test_two_level.py under ``mpiexec -n 4``: two hosts of two ranks
(``ranks_per_host=2``), a toy model (with BatchNorm) trained through the two-level learners.

Checks (each returns a summary the test asserts on):

* ``diloco``, ``block_momentum``, ``local_sgd``, ``diloco_q4``: after every step the two ranks of each host hold the same
  parameters (bit for bit); after every sync all four do (BatchNorm statistics too). For the
  float32 cases every sync is replayed from the ranks' models before it: ``W_prev`` minus the
  outer step of DiLoCo (torch's SGD-Nesterov arithmetic, written out here), BMUF's filter or local SGD's mean, on
  the two hosts' models, to 1e-5.
* ``host_step``: a step inside a host equals one SGD step on the host's mean gradient of its ranks'
  shares (computed here from the host's whole slice of the minibatch).
* ``resume_diloco_q4``: restored mid-run from ``state_dict`` + ``local_state_dict`` it continues bit for bit.

Prints ``PASS <check> rank r/size`` per check.
"""
from __future__ import annotations

import functools
import math
import sys

import torch
from torch import nn

from tests.helpers.bmuf_reference import flat, train_learner_shares
from tests.helpers.checks import run_checks
from tests.helpers.resume import restore_learner, save_learner

from dtrain.comm import create_communicator, install_fail_fast
from dtrain.exchange import Quantized
from dtrain.learners import TwoLevelBlockMomentumLearner, TwoLevelDiLoCoLearner, TwoLevelLocalSGDLearner
from dtrain.learners.base import RunFacts, auto_warm_start
from dtrain.learners.block import auto_block_size
from dtrain.learners.diloco import auto_diloco_block_size

TOLERANCE = 1e-5
GLOBAL_SIZES = [16] * 16
generator = torch.Generator().manual_seed(5)
FEATURES = torch.randn(512, 5, generator=generator)
TARGETS = torch.randn(512, 3, generator=generator)
CASES = {
    "diloco": (TwoLevelDiLoCoLearner, dict(block_size=32, distributed_after=32), None),
    "block_momentum": (TwoLevelBlockMomentumLearner, dict(block_size=32, distributed_after=0), None),
    "local_sgd": (TwoLevelLocalSGDLearner, dict(block_size=48, distributed_after=0), None),
    "diloco_q4": (TwoLevelDiLoCoLearner, dict(block_size=32, distributed_after=0), 4),
}


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 16, bias=False), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 3))


def local_loss(model: nn.Module, start: int, stop: int) -> torch.Tensor:
    return nn.functional.mse_loss(model(FEATURES[start:stop]), TARGETS[start:stop])


def build(comm, case: str, seed: int):
    learner_class, options, bits = CASES[case]
    model = make_model(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01) if learner_class is TwoLevelDiLoCoLearner \
        else torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    exchange = Quantized(num_bits=bits) if bits else None
    return model, learner_class(optimizer, comm, exchange=exchange, ranks_per_host=2, **options)


def gathered(comm, tensor: torch.Tensor) -> list[torch.Tensor]:
    return comm.allgather(tensor.detach().float().contiguous())


def outer_reference(learner, before: list[torch.Tensor], prev: torch.Tensor, velocity: torch.Tensor | None,
                    block_samples: int):
    """The new model from the hosts' models ``before[0]`` and ``before[2]`` (ranks 0 and 2 lead the hosts); the outer
    state ``velocity`` is 0 before the first outer step (None: the outer optimizer has made none yet)."""
    prev, hosts = prev.double(), [before[0].double(), before[2].double()]
    velocity = torch.zeros_like(prev) if velocity is None else velocity
    if isinstance(learner, TwoLevelBlockMomentumLearner):  # BMUF with CNTK's time constant for N = 2 hosts
        time_constant = -learner.block_size / math.log(1 - 1 / 2)
        assert learner.time_constant == time_constant, (learner.time_constant, time_constant)
        momentum = math.exp(-block_samples / time_constant)
        smoothed = momentum * velocity.double() + (1 - momentum) * sum(prev - host for host in hosts)
        return prev - smoothed - momentum * smoothed  # Nesterov
    gradient = sum(prev - host for host in hosts) / len(hosts)
    if isinstance(learner, TwoLevelDiLoCoLearner):
        velocity = learner.outer_momentum * velocity.double() + gradient
        return prev - learner.outer_learning_rate * (gradient + learner.outer_momentum * velocity)
    return prev - gradient  # local SGD: the hosts' mean model


def check_case(comm, case: str) -> dict:
    model, learner = build(comm, case, seed=comm.rank)  # different per rank: prepare() broadcasts rank 0's
    learner.prepare(model)
    seen: dict = {}
    sync = learner._sync

    def recorded_sync(*args, **kwargs):  # the models, W_prev and the outer state just before the sync
        seen.update(before=flat(model.parameters()), prev=learner.prev_parameters.clone(),
                    block_samples=learner.global_samples_in_block,
                    velocity=None if learner.smoothed_gradient is None else learner.smoothed_gradient.clone())
        return sync(*args, **kwargs)

    learner._sync = recorded_sync
    position, syncs, worst = 0, 0, 0.0
    for global_size in GLOBAL_SIZES:
        syncs_before = learner.syncs
        position = train_learner_shares(learner, model, local_loss, [global_size], position=position)
        everyone = gathered(comm, flat(model.parameters()))
        host = comm.rank // 2
        assert torch.equal(everyone[2 * host], everyone[2 * host + 1]), f"{case}: host {host} ranks differ"
        if learner.syncs != syncs_before:
            syncs += 1
            assert all(torch.equal(everyone[0], theirs) for theirs in everyone), f"{case}: hosts differ after a sync"
            buffers = gathered(comm, flat(model.buffers()))
            assert all(torch.equal(buffers[0], theirs) for theirs in buffers), f"{case}: buffers differ after a sync"
            if CASES[case][2] is None:
                expected = outer_reference(learner, gathered(comm, seen["before"]), seen["prev"], seen["velocity"],
                                           seen["block_samples"])
                worst = max(worst, float((everyone[0].double() - expected).abs().max()))
    assert syncs >= 4, (case, syncs)
    assert worst <= TOLERANCE, (case, worst)
    comm.barrier()
    return {"syncs": syncs, "worst": worst, "bytes": learner.bytes_sent_last_step if learner.is_leader else None}


def check_host_step(comm) -> float:
    """One step inside a host: SGD on the host's mean gradient over its whole slice of the minibatch."""
    model, learner = build(comm, "local_sgd", seed=0)
    learner.prepare(model)
    reference = make_model(0)
    start = (comm.rank // 2) * 8  # this host's 8 of the 16 samples, 4 per rank (BatchNorm over each rank's 4)
    ((local_loss(reference, start, start + 4) + local_loss(reference, start + 4, start + 8)) / 2).backward()
    with torch.no_grad():
        expected = torch.cat([(p - 0.05 * p.grad).reshape(-1) for p in reference.parameters()])
    train_learner_shares(learner, model, local_loss, [16])
    difference = float((flat(model.parameters()) - expected).abs().max())
    assert difference <= 1e-6, difference
    comm.barrier()
    return difference


def check_auto_block_size(comm) -> int:
    """Block momentum's ``block_size="auto"`` takes N = the hosts (the models that train apart), not the ranks;
    so does DiLoCo's own (20 syncs after the warm start at 2 workers, ``H`` times 2/N beyond)."""
    facts = RunFacts(samples_per_sweep=1500, max_samples=30000, minibatch_size=32)
    model = make_model(0)
    learner = TwoLevelBlockMomentumLearner(torch.optim.SGD(model.parameters(), lr=0.05), comm, ranks_per_host=2)
    learner.plan(facts)
    warm_start = auto_warm_start(facts)
    assert auto_block_size(facts, 2, warm_start) != auto_block_size(facts, 4, warm_start)  # so the test can tell
    assert learner.block_size == auto_block_size(facts, 2, warm_start), learner.block_size
    assert learner.sync_period == learner.block_size // 4  # the job's ranks share each block
    assert learner.distributed_after == auto_warm_start(facts)
    diloco = TwoLevelDiLoCoLearner(torch.optim.AdamW(make_model(0).parameters()), comm, ranks_per_host=2)
    diloco.plan(facts)
    assert auto_diloco_block_size(facts, warm_start, 4) == 544  # so the test can tell hosts from ranks
    assert diloco.block_size == auto_diloco_block_size(facts, warm_start, 2) == 1120, diloco.block_size
    return learner.block_size


def check_resume(comm, case: str) -> None:
    """Restored mid-run (replicated + per-rank state), the learner continues bit for bit."""
    model, learner = build(comm, case, seed=0)
    learner.prepare(model)
    position = train_learner_shares(learner, model, local_loss, [16] * 6)
    learner.synchronize()
    saved = save_learner(learner, model)
    train_learner_shares(learner, model, local_loss, [16] * 6, position=position)
    learner.synchronize()
    expected = flat(model.parameters())
    model2, restored = build(comm, case, seed=0)
    restore_learner(saved, restored, model2)
    train_learner_shares(restored, model2, local_loss, [16] * 6, position=position)
    restored.synchronize()
    assert torch.equal(flat(model2.parameters()), expected), float((flat(model2.parameters()) - expected).abs().max())
    comm.barrier()


def main() -> None:
    comm = create_communicator(backend="gloo", timeout_s=60)
    install_fail_fast(comm)
    torch.set_num_threads(1)  # oversubscribed ranks on a small machine
    run_checks(comm, {**{case: functools.partial(check_case, case=case) for case in CASES},
                      "host_step": check_host_step, "auto_block_size": check_auto_block_size,
                      "resume_diloco_q4": functools.partial(check_resume, case="diloco_q4")})
    comm.finalize()


if __name__ == "__main__":
    sys.exit(main())
