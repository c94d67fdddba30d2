"""Worker run by tests/dist/test_two_level_gradients.py under ``mpiexec -n 4``: two hosts of two ranks
(``ranks_per_host=2``), a small MLP trained by :class:`TwoLevelDataParallelLearner` in two buckets; or
under ``mpiexec -n 3`` (hosts of 2 and 1 rank: unequal). ``python WORKER [BACKEND]``: gloo by default.

Checks (each returns a summary the test asserts on):

* ``quantized`` (1-bit, after a float32 warm start of 2 steps) and ``powersgd`` (rank 2, plain
  all-reduce for the first step): after every step the four ranks hold bit-identical parameters, and
  every step's gradient equals an independent reference computed here from all four ranks' shares:
  the host sums in float32, then the exact sum of the two hosts (warm start), the direct two-phase
  k-bit computation over two "hosts" (``ReferenceExchange``) or the flat PowerSGD strategy run over two
  threads on the host sums. Also the bytes: only the leaders send between hosts.
* ``resume_quantized``, ``resume_powersgd``: restored mid-run from ``state_dict`` + ``local_state_dict``
  the learner continues bit for bit (the leaders' residuals, P and Q restored).

Prints ``PASS <check> rank r/size`` per check.
"""
from __future__ import annotations

import functools
import sys

import torch
from torch import nn

from tests.helpers.bmuf_reference import flat
from tests.helpers.checks import run_checks
from tests.helpers.quantized_reference import ReferenceExchange
from tests.helpers.resume import restore_learner, save_learner
from tests.helpers.thread_world import FakeWorld

from dtrain.comm import create_communicator, install_fail_fast
from dtrain.compress import StripeLayout
from dtrain.data.partition import partition_slice
from dtrain.exchange import PowerSGD, Quantized
from dtrain.exchange.quantized import requantizes_sum
from dtrain.learners import TwoLevelDataParallelLearner

GLOBAL = 16
STEPS = 8
BUCKET_MB = 2048 / 2 ** 20  # two buckets: [Linear 2's bias and weight], [Linear 1's weight]
generator = torch.Generator().manual_seed(7)
FEATURES = torch.randn(GLOBAL * 3 * STEPS, 20, generator=generator)
TARGETS = torch.randn(GLOBAL * 3 * STEPS, 10, generator=generator)


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(20, 32, bias=False), nn.Tanh(), nn.Linear(32, 10))


def strategy(case: str):
    if case.startswith("quantized"):
        return Quantized(num_bits=1)
    return PowerSGD(matrix_approximation_rank=2, start_powersgd_iter=1, use_error_feedback=True)


def build(comm, case: str, seed: int):
    model = make_model(seed)
    # quantized_adamw: AdamW's variance frozen after the warm start (freeze_variance auto), on every rank
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01) if case.endswith("adamw") else \
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    warm = 2 * GLOBAL if case.startswith("quantized") else 0
    # 4 ranks: 2 x 2 from comm.ranks_per_host=2; 3 ranks: hosts of 2 and 1, as a launcher's node labels give them
    learner = TwoLevelDataParallelLearner(optimizer, comm, distributed_after=warm, bucket_size_mb=BUCKET_MB,
                                          exchange=strategy(case), ranks_per_host=2 if comm.size % 2 == 0 else None)
    return model, learner


def loss_of(model: nn.Module, start: int, stop: int) -> torch.Tensor:
    return nn.functional.mse_loss(model(FEATURES[start:stop]), TARGETS[start:stop])


def share(position: int, rank: int, size: int) -> tuple[int, int]:
    return partition_slice(position, GLOBAL, size, rank)


def train(learner, model, steps: int, position: int = 0, before_step=None) -> int:
    for _ in range(steps):
        start, stop = share(position, *reversed(learner.data_partition()))
        learner.begin_minibatch(stop - start, GLOBAL)
        if before_step is not None:
            before_step(position)
        loss_of(model, start, stop).backward()
        learner.step()
        position += GLOBAL
    return position


def host_ranks(size: int) -> list[list[int]]:
    """The ranks of each host with ``ranks_per_host=2``: [[0, 1], [2, 3]] of 4, [[0, 1], [2]] of 3."""
    return [list(range(first, min(first + 2, size))) for first in range(0, size, 2)]


def rank_gradients(model: nn.Module, position: int, rank: int, size: int, bucket) -> list[torch.Tensor]:
    """Rank ``rank``'s bucket gradients as the learner packs them: of its mean loss, times its share."""
    copy = make_model(0)
    copy.load_state_dict(model.state_dict())
    start, stop = share(position, rank, size)
    loss_of(copy, start, stop).backward()
    by_identity = dict(zip(map(id, model.parameters()), copy.parameters()))
    return [torch.mul(by_identity[id(parameter)].grad, (stop - start) / GLOBAL) for parameter in bucket.parameters]


class Reference:
    """The step's expected gradient per bucket: host sums, then the hosts' exchange written out here."""

    def __init__(self, case: str, learner, size: int) -> None:
        self.case, self.learner, self.size = case, learner, size
        self.hosts = host_ranks(size)
        # the hosts' 1-bit exchange forms its sums as "auto" does for this many hosts
        requantize = requantizes_sum("auto", len(self.hosts), 1)
        self.quantized = [ReferenceExchange(StripeLayout([tuple(s) for s in bucket.shapes], len(self.hosts)), 1,
                                            requantize) for bucket in learner.buckets]
        self.powersgd = [strategy(case) for _ in self.hosts]  # the flat strategy on the "hosts" (threads)

    def expected(self, model: nn.Module, position: int) -> list[torch.Tensor]:
        learner = self.learner
        hosts_by_bucket = []
        for bucket in learner.buckets:
            ranks = [rank_gradients(model, position, rank, self.size, bucket) for rank in range(self.size)]
            hosts_by_bucket.append([[functools.reduce(torch.add, tensors) for tensors in zip(*(ranks[r] for r in host))]
                                    for host in self.hosts])  # in rank order, as the reduce onto the leader sums
        if learner.in_full_precision_warm_start():
            return [torch.cat([functools.reduce(torch.add, tensors).reshape(-1) for tensors in zip(*hosts)])
                    for hosts in hosts_by_bucket]
        if self.case.startswith("quantized"):
            return [reference.step(hosts) for reference, hosts in zip(self.quantized, hosts_by_bucket)]

        def exchange(comm):
            flat_strategy = self.powersgd[comm.rank]
            flat_strategy.bind(comm)
            flat_strategy.begin_step()
            results = []
            for index, (bucket, hosts) in enumerate(zip(learner.buckets, hosts_by_bucket)):
                flat = torch.cat([tensor.reshape(-1) for tensor in hosts[comm.rank]])
                results.append(flat_strategy.allreduce_(index, flat, bucket.shapes).clone())
            return results
        return FakeWorld(len(self.hosts)).run(exchange)[0]


def check_case(comm, case: str) -> dict:
    model, learner = build(comm, case, seed=comm.rank)  # different per rank: prepare() broadcasts rank 0's
    learner.prepare(model)
    reference = Reference(case, learner, comm.size)
    seen: dict = {}

    def expect(position: int) -> None:
        seen["expected"] = reference.expected(model, position)

    worst, between, position, variances = 0.0, [], 0, []
    for _ in range(STEPS):
        position = train(learner, model, 1, position, before_step=expect)
        everyone = comm.allgather(flat(model.parameters()))
        assert all(torch.equal(everyone[0], theirs) for theirs in everyone), f"{case}: ranks differ after a step"
        if case.endswith("adamw"):
            variances.append(torch.cat([learner.optimizer.state[p]["exp_avg_sq"].reshape(-1).clone()
                                        for p in model.parameters()]))
            everyone = comm.allgather(variances[-1])
            assert all(torch.equal(everyone[0], theirs) for theirs in everyone), f"{case}: variances differ"
        for bucket, expected in zip(learner.buckets, seen["expected"]):
            got = torch.cat([p.grad.reshape(-1) for p in bucket.parameters])
            worst = max(worst, float((got - expected).abs().max()))
            assert torch.equal(got, expected), f"{case}: step at {position - GLOBAL} differs by {worst}"
        between.append(learner.bytes_between_hosts_last_step)
    comm.barrier()
    # the warm start's 2 steps move the variance; from the first 1-bit step on it is held where they left it
    held = bool(variances) and not torch.equal(variances[0], variances[1]) and all(
        torch.equal(variance, variances[1]) for variance in variances[2:])
    return {"between": between, "sent": learner.bytes_sent_last_step, "leader": learner.is_leader,
            "compressed": between[-1] < learner.exchange.full_precision_bytes_last_step, "variance_held": held}


def check_resume(comm, case: str) -> None:
    """Restored mid-run (replicated + per-rank state), the learner continues bit for bit."""
    model, learner = build(comm, case, seed=0)
    learner.prepare(model)
    position = train(learner, model, 4)
    learner.synchronize()
    saved = save_learner(learner, model)
    train(learner, model, 4, position)
    expected = flat(model.parameters())
    model2, restored = build(comm, case, seed=1)
    restore_learner(saved, restored, model2)
    train(restored, model2, 4, position)
    got = flat(model2.parameters())
    assert torch.equal(got, expected), float((got - expected).abs().max())
    learner.finalize()
    restored.finalize()
    comm.barrier()


def main() -> None:
    comm = create_communicator(backend=sys.argv[1] if len(sys.argv) > 1 else "gloo", timeout_s=60, hierarchical=False)
    if comm.size % 2:  # what a launcher reports for unequal nodes: ranks 0 and 1 on one, the last rank alone
        comm.node_label = f"node-{comm.rank // 2}"
        comm._local_rank, comm._local_size = comm.rank % 2, min(2, comm.size - 2 * (comm.rank // 2))
    install_fail_fast(comm)
    torch.set_num_threads(1)  # oversubscribed ranks on a small machine
    cases = ("quantized", "powersgd")
    run_checks(comm, {**{case: functools.partial(check_case, case=case) for case in (*cases, "quantized_adamw")},
                      **{f"resume_{case}": functools.partial(check_resume, case=case)
                         for case in (*cases, "quantized_adamw")}})
    comm.finalize()


if __name__ == "__main__":
    sys.exit(main())
