"""Worker run by tests/dist/test_session_options_mpi.py under mpiexec: ``python _session_options_worker.py RUN_DIR``.

Checks the session settings ``micro_batch_size``, ``clip_grad_norm`` and ``precision="fp16"`` with
real ranks; each check returns its figures, which the test asserts one check per test id
(``tests.helpers.checks``).

Checks:
  micro_batches  data-parallel with passes of 2 samples equals the uncapped run and one process
                 (shares of 7, 1, 3 and 13: uneven, and ranks with 0 samples); the gradient
                 all-reduce runs once per bucket per minibatch (not once per pass).
  clipping       data-parallel and quantized (32 bits: lossless) with clip_grad_norm equal one
                 process clipping the global minibatch's gradient; block momentum clips every local
                 step; every learner ends with identical parameters on all ranks.
  fp16           an overflow on rank 1 alone skips that step on every rank (data_parallel,
                 quantized, block momentum), the loss scale halves everywhere, ranks stay identical.
  compile_check  compile=True with a "compiled" model whose first layer gets no gradient on rank 1
                 only: every rank refuses with the same line before any step, parameters unchanged.
"""
from __future__ import annotations

import io
import sys
from functools import partial
from pathlib import Path

import torch
from torch import nn

import dtrain
from dtrain.comm import LocalCommunicator, create_communicator
from dtrain.exchange import Quantized
from dtrain.learners import (DataParallelLearner, Learner, LocalLearner, block_momentum_distributed_learner,
                             data_parallel_distributed_learner)

from tests.helpers.checks import run_checks
from tests.helpers.compare import differing_on_ranks, max_difference
from tests.helpers.toy_data import four_class_data

MINIBATCH_SCHEDULE = dtrain.Schedule([[2, 7], [1, 1], [1, 3], [1, 13]], epoch_size=7)
MAX_SAMPLES = 200
CLIP = 0.05


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 4))


def optimizer_of(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def train(model: nn.Module, learner: Learner, run_dir: Path, **options) -> None:
    dtrain.training_session(
        model=model, loss=nn.functional.cross_entropy, learner=learner,
        minibatch_source=dtrain.MinibatchSource(four_class_data(), randomize=True, randomization_seed=5),
        minibatch_size=MINIBATCH_SCHEDULE, max_samples=MAX_SAMPLES, run_dir=run_dir, tensorboard=False,
        stream=io.StringIO(), independent_processes=learner.comm.size == 1, **options,
    ).train()


def reference(run_dir: Path, comm, **options) -> nn.Module:
    """One process, the same global minibatches (every rank computes it for itself)."""
    model = make_model()
    train(model, LocalLearner(optimizer_of(model), LocalCommunicator()), run_dir / f"reference{comm.rank}", **options)
    return model


def check_micro_batches(comm, run_dir: Path) -> dict:
    uncapped = make_model()
    train(uncapped, data_parallel_distributed_learner(optimizer_of(uncapped), comm, bucket_size_mb=0.002),
          run_dir / "uncapped")
    model = make_model()
    learner = data_parallel_distributed_learner(optimizer_of(model), comm, bucket_size_mb=0.002)
    launches = []  # the storage of every tensor all-reduced asynchronously (bucket buffers among them)
    original = comm.allreduce_async
    comm.allreduce_async = lambda tensor, op="sum": (launches.append(tensor.data_ptr()), original(tensor, op=op))[1]
    minibatches = []
    original_step = learner.step
    learner.step = lambda: (minibatches.append(learner.global_samples), original_step())[1]
    passes = []
    model.register_forward_hook(lambda module, inputs, output: passes.append(inputs[0].shape[0]))
    try:
        train(model, learner, run_dir / "capped", micro_batch_size=2)
    finally:
        del comm.allreduce_async
        del learner.step
    one_process = reference(run_dir, comm)
    return {
        "num_buckets": len(learner.buckets), "minibatches": len(minibatches),
        "bucket_allreduces": sum(ptr in {bucket.buffer.data_ptr() for bucket in learner.buckets} for ptr in launches),
        "largest_pass": max(passes), "passes": len(passes),
        "difference_to_uncapped": max_difference(model, uncapped),
        "difference_to_one_process": max_difference(model, one_process),
        "moved": max_difference(model, make_model()),
        "differing_parameters": differing_on_ranks(comm, dict(model.named_parameters())),
    }


def check_clipping(comm, run_dir: Path) -> dict:
    one_process = reference(run_dir, comm, clip_grad_norm=CLIP)
    unclipped = reference(run_dir / "unclipped", comm)
    results = {"clip_changes_the_result": max_difference(one_process, unclipped)}
    for name, build in (("data_parallel", lambda opt: data_parallel_distributed_learner(opt, comm)),
                        ("quantized", lambda opt: DataParallelLearner(opt, comm, exchange=Quantized(32)))):
        model = make_model()
        train(model, build(optimizer_of(model)), run_dir / name, clip_grad_norm=CLIP)
        results[name] = {"difference_to_one_process": max_difference(model, one_process),
                         "differing_parameters": differing_on_ranks(comm, dict(model.named_parameters()))}
    model = make_model()
    learner = block_momentum_distributed_learner(optimizer_of(model), comm, block_size=40)
    norms = []  # the gradient norm each local optimizer step is given (after the session's clipping)
    original_step = learner.optimizer.step
    learner.optimizer.step = lambda: (norms.append(float(torch.nn.utils.get_total_norm(
        [p.grad for p in learner.parameters if p.grad is not None]))), original_step())[1]
    train(model, learner, run_dir / "block_momentum", clip_grad_norm=CLIP)
    del learner.optimizer.step
    results["block_momentum"] = {"local_steps": len(norms), "largest_norm_stepped": max(norms),
                                 "differing_parameters": differing_on_ranks(comm, dict(model.named_parameters()))}
    return results


class OverflowOnRank:
    """Cross-entropy multiplied by 1e38 on one rank's ``call``-th evaluation (its fp16 gradient overflows)."""

    def __init__(self, rank: int, overflow_rank: int, call: int):
        self.overflows, self.call, self.calls = rank == overflow_rank, call, 0

    def __call__(self, output, labels):
        self.calls += 1
        loss = nn.functional.cross_entropy(output, labels)
        return loss * 1e38 if self.overflows and self.calls == self.call else loss


def check_fp16(comm, run_dir: Path) -> dict:
    results = {}
    builders = {
        "data_parallel": lambda opt: data_parallel_distributed_learner(opt, comm),
        "quantized": lambda opt: DataParallelLearner(opt, comm, exchange=Quantized(1)),
        "block_momentum": lambda opt: block_momentum_distributed_learner(opt, comm, block_size=40),
    }
    for name, build in builders.items():
        model = make_model()
        learner = build(optimizer_of(model))
        session = dtrain.training_session(
            model=model, loss=OverflowOnRank(comm.rank, 1, 3), learner=learner,
            minibatch_source=dtrain.MinibatchSource(four_class_data(), randomize=True, randomization_seed=5),
            minibatch_size=16, max_samples=160, run_dir=run_dir / f"fp16_{name}", tensorboard=False,
            stream=io.StringIO(), precision="fp16")
        session.train()
        everyone = comm.allgather_object((session.skipped_steps, session.loss_scaler.scale))
        results[name] = {"skipped_and_scale_per_rank": everyone,
                         "finite": all(bool(torch.isfinite(p).all()) for p in model.parameters()),
                         "differing_parameters": differing_on_ranks(comm, dict(model.named_parameters()))}
    return results


class FirstLayerWithoutGradientOnRank1(nn.Module):
    """What ``torch.compile`` returns in ``check_compile_check``: the model, except that on rank 1 no
    gradient reaches its first layer (a compiler bug seen by one rank only)."""

    def __init__(self, model: nn.Module, rank: int):
        super().__init__()
        self.model, self.rank = model, rank

    def forward(self, features):
        hidden = self.model[0](features)
        return self.model[1:](hidden.detach() if self.rank == 1 else hidden)


def check_compile_check(comm, run_dir: Path) -> dict:
    model = make_model()
    before = [parameter.detach().clone() for parameter in model.parameters()]
    original = torch.compile
    torch.compile = partial(FirstLayerWithoutGradientOnRank1, rank=comm.rank)
    try:
        train(model, data_parallel_distributed_learner(optimizer_of(model), comm), run_dir / "compile_check",
              compile=True)
        refusal = None
    except ValueError as error:
        refusal = str(error)
    finally:
        torch.compile = original
    unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    return {"refusals": comm.allgather_object(refusal), "unchanged": comm.allgather_object(unchanged)}


def main() -> None:
    run_dir = Path(sys.argv[1])
    torch.set_num_threads(1)
    comm = create_communicator(backend="gloo", timeout_s=60)  # CPU tensors, also on a GPU machine
    run_checks(comm, {name: partial(check, run_dir=run_dir) for name, check in (
        ("micro_batches", check_micro_batches), ("clipping", check_clipping), ("fp16", check_fp16),
        ("compile_check", check_compile_check))})
    comm.finalize()


if __name__ == "__main__":
    main()
