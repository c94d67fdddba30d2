"""Worker for ``test_exchange_strategies.py``: every exchange strategy of the data-parallel learner
under a real ``mpiexec``.

For each strategy (float32, bf16, fp16, 1- and 4-bit quantized, PowerSGD rank 1 and 2), with
uneven shares (the last rank has no samples on odd steps) and a parameter that never gets a
gradient:

* parameters are bit-identical on every rank after every step, and the unused parameter keeps
  ``.grad is None`` and its value (the "has a gradient" flags stay exact for lossy strategies);
* bytes per step are reported, below float32's for the compressing ones;
* a resume from (model, learner.state_dict(), learner.local_state_dict()) at the same world
  size continues bit-exactly, and for strategies with state, dropping the per-rank state gives
  a different result (the state matters and is what was saved);
* a replicated state saved at another world size resets the strategy's state, with a line;
* ``Communicator.all_to_all`` (native and the allgather fallback) with per-pair lengths.

Each strategy and ``all_to_all`` is a named check (``tests.helpers.checks``); a strategy's check
returns its bytes per step (``sent``, ``full``) and whether it has state.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import io
import os

import torch

from dtrain.comm import Communicator, create_communicator
from dtrain.exchange import Sparse
from dtrain.learners import DataParallelLearner

from tests.helpers.checks import run_checks
from tests.helpers.sparseloco_reference import sparse_step
from tests.helpers.strategies import STRATEGIES


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3)
        self.head = torch.nn.Linear(8 * 4 * 4, 10)
        self.unused = torch.nn.Linear(4, 4)  # never in the graph: no rank has a gradient for it

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.conv(images)).flatten(1))


def share(rank: int, size: int, step: int) -> int:
    return 0 if (rank == size - 1 and step % 2) else 3 + rank


def build(comm, strategy: str):
    torch.manual_seed(7)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    # small buckets: several per step, so per-bucket state and launch order are exercised
    learner = DataParallelLearner(optimizer, comm, bucket_size_mb=0.002, exchange=STRATEGIES[strategy]())
    learner.prepare(model)
    return model, learner


def run_steps(comm, model, learner, first: int, count: int, check: bool = True) -> None:
    unused_before = model.unused.weight.detach().clone()
    for step in range(first, first + count):
        local = share(comm.rank, comm.size, step)
        learner.begin_minibatch(local, sum(share(rank, comm.size, step) for rank in range(comm.size)))
        if local:
            generator = torch.Generator().manual_seed(1000 * step + comm.rank)
            images = torch.randn(local, 3, 6, 6, generator=generator)
            labels = torch.randint(0, 10, (local,), generator=generator)
            torch.nn.functional.cross_entropy(model(images), labels).backward()
        learner.step()
        if check:
            flat = parameters(model)
            if not all(torch.equal(other, flat) for other in comm.allgather(flat)):
                raise AssertionError(f"step {step}: parameters differ between ranks")
            if model.unused.weight.grad is not None or not torch.equal(model.unused.weight, unused_before):
                raise AssertionError(f"step {step}: the unused parameter got a gradient or moved")
            if model.head.weight.grad is None:
                raise AssertionError(f"step {step}: a used parameter has no gradient")


def parameters(model) -> torch.Tensor:
    return torch.cat([parameter.detach().reshape(-1) for parameter in model.parameters()])


def check_strategy(comm, strategy: str) -> dict[str, int]:
    model, learner = build(comm, strategy)
    run_steps(comm, model, learner, 0, 3)
    saved = (copy.deepcopy(model.state_dict()), copy.deepcopy(learner.state_dict()),
             copy.deepcopy(learner.local_state_dict()))
    run_steps(comm, model, learner, 3, 3)
    straight = parameters(model)
    sent, full = learner.bytes_sent_last_step, learner.exchange.full_precision_bytes_last_step
    learner.finalize()

    def resumed(with_local_state: bool) -> torch.Tensor:
        model, learner = build(comm, strategy)
        model.load_state_dict(saved[0])
        learner.load_state_dict(copy.deepcopy(saved[1]))
        if with_local_state:
            learner.load_local_state_dict(copy.deepcopy(saved[2]))
        run_steps(comm, model, learner, 3, 3, check=with_local_state)
        learner.finalize()
        return parameters(model)

    if not torch.equal(resumed(True), straight):
        raise AssertionError(f"{strategy}: resuming at the same world size is not bit-exact")
    stateful = learner.exchange.stateful
    if stateful and torch.equal(resumed(False), straight):
        raise AssertionError(f"{strategy}: without the per-rank state the resume is the same: the state is not used")

    # the replicated state of a run of another world size: the strategy's state is reset, with a line
    model, learner = build(comm, strategy)
    learner.load_local_state_dict(copy.deepcopy(saved[2]))
    other = {**copy.deepcopy(saved[1]), "exchange_world_size": comm.size + 1}
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        learner.load_state_dict(other)
    fresh = STRATEGIES[strategy]()
    fresh.bind(comm)
    state, expected = learner.exchange.state_dict(), fresh.state_dict()
    if stateful:
        leftovers = [key for key, value in expected.items() if isinstance(value, dict) and key != "rng"
                     and (len(value) == 0) != (len(state.get(key, {})) == 0)]
        if set(state) != set(expected) or leftovers or state.get("steps_begun") != expected.get("steps_begun"):
            raise AssertionError(f"{strategy}: the exchange state survived a world-size change: {leftovers}")
        if comm.is_main and "starting it afresh" not in printed.getvalue():
            raise AssertionError(f"{strategy}: no line about the reset: {printed.getvalue()!r}")
    learner.finalize()
    return {"sent": sent, "full": full, "stateful": int(stateful)}


def check_all_to_all(comm) -> None:
    """``comm.all_to_all`` with lengths differing per pair, native and through the allgather fallback,
    with and without the receive sizes given."""
    sends = [torch.arange(comm.rank + 2 * peer + 1, dtype=torch.float32) + 100 * comm.rank for peer in range(comm.size)]
    expected = [torch.arange(source + 2 * comm.rank + 1, dtype=torch.float32) + 100 * source
                for source in range(comm.size)]
    sizes = [message.numel() for message in expected]
    for received in (comm.all_to_all(sends), comm.all_to_all(sends, receive_sizes=sizes),
                     Communicator.all_to_all(comm, sends)):
        if len(received) != comm.size or not all(torch.equal(a, b) for a, b in zip(received, expected)):
            raise AssertionError(f"all_to_all gave {received}, expected {expected}")


def check_sparse_reference(comm) -> dict:
    """``Sparse`` on 3 steps of one key equals the reference of SparseLoCo's algorithm computed here for every rank:
    the sum (to float rounding), which values each rank sent, its error feedback conserved (decay * e + x = e' +
    sent), and the bytes: each rank's message to the N - 1 others."""
    settings = dict(chunk_size=64, top_k=5, num_bits=2, decay=0.9)
    strategy = Sparse(**settings)
    strategy.bind(comm)
    numel = 300  # 4 full chunks and a shorter one
    references = [torch.zeros(numel) for _ in range(comm.size)]
    for step in range(3):
        inputs = [torch.randn(numel, generator=torch.Generator().manual_seed(100 * step + rank))
                  for rank in range(comm.size)]
        sents = []
        for rank in range(comm.size):
            references[rank], sent = sparse_step(references[rank], inputs[rank], **settings)
            sents.append(sent)
        strategy.begin_step()
        flat = strategy.allreduce_("model", inputs[comm.rank].clone(), [torch.Size([numel])])
        expected = torch.stack(sents).sum(0)
        if not torch.allclose(flat, expected, atol=1e-5, rtol=0):
            raise AssertionError(f"step {step}: the sum is off by {(flat - expected).abs().max():.3g}")
        if not all(torch.equal(other, flat) for other in comm.allgather(flat)):
            raise AssertionError(f"step {step}: the sums differ between ranks")
        mine = strategy.errors["model"]
        if not torch.allclose(mine, references[comm.rank], atol=1e-5, rtol=0):
            raise AssertionError(f"step {step}: rank {comm.rank}'s error feedback is off by "
                                 f"{(mine - references[comm.rank]).abs().max():.3g}")
        kept = 4 * 5 + 4  # a shorter last chunk of 44 keeps ceil(5 * 44 / 64) = 4
        message = (kept * 6 + 7) // 8 + (kept * 2 + 7) // 8 + 8 * 5
        if strategy.bytes_sent_last_step != (comm.size - 1) * message:
            raise AssertionError(f"{strategy.bytes_sent_last_step} bytes sent, expected {(comm.size - 1) * message}")
    strategy.close()
    return {"sent": strategy.bytes_sent_last_step, "full": strategy.full_precision_bytes_last_step}


def main() -> None:
    torch.set_num_threads(1)
    # CPU tensors, also on a GPU machine
    comm = create_communicator(backend=os.environ.get("WORKER_BACKEND", "gloo"), timeout_s=60)
    run_checks(comm, {"all_to_all": check_all_to_all, "sparse_reference": check_sparse_reference,
                      **{name: functools.partial(check_strategy, strategy=name) for name in STRATEGIES}})
    comm.finalize()


if __name__ == "__main__":
    main()
