"""dtrain's data-parallel learner against torch ``DistributedDataParallel`` in the same job.

    python benchmarks/ddp_comparison.py                      # conv net and a 25 MB MLP, 2 ranks
    python benchmarks/ddp_comparison.py --models mlp --steps 30 --rounds 7
    python benchmarks/ddp_comparison.py --models transformer   # the shakespeare_char recipe's model

The script starts ``mpiexec -n <ranks>`` of itself (``--worker``). In every rank both trainers
exist side by side, built from the same seed (identical initial parameters), reading the same
global minibatches of in-memory random data through ``MinibatchSource`` (each rank its share),
with ``torch.optim.SGD`` (lr 0.01, momentum 0.9), Gloo, and one torch thread per rank. The
``transformer`` is the ``shakespeare_char`` recipe's character model (4 layers, 128 wide, context 128)
reading that recipe's windows of the shipped corpus (stream ``text``: input ``text[:-1]``, target
``text[1:]``, 8 windows = 1,024 characters per rank) with the token-mean cross-entropy. A round
times ``--steps`` steps of one trainer and then of the other (the order alternates between
rounds, so load from other work on the machine hits both alike); the figure is the median step
time over ``--rounds`` rounds. After the last round both have taken the same steps on the same
data, so their parameters should agree: the largest absolute difference is printed (0 means
bit-identical work).

DDP runs with its defaults (25 MiB buckets, a 1 MiB first bucket); dtrain with
``data_parallel_distributed_learner`` and its default ``bucket_size_mb`` (also a 1 MiB first
bucket). Two ratios are printed: of the medians, and the median of the per-round ratios (each
round's two trainers run back to back, so on a loaded machine that pairing cancels more of the
drifting load than the medians do).
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import subprocess
import time

import numpy as np
import torch
from _mpiexec import mpi_environment, mpiexec_command

MODELS = ("conv", "mlp", "transformer")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS),
                        help="conv: CNTK's CIFAR-10 ConvNet, 32 per rank; mlp: 1024-2048-2048-10, 64 per rank; "
                             "transformer: the character language model, 1,024 characters per rank")
    parser.add_argument("--ranks", type=int, default=2, help="processes, default 2")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per trainer per round, default 20")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps of each trainer first, default 3")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds (median), default 5")
    parser.add_argument("--backend", choices=("gloo", "mpi"), default="gloo",
                        help="dtrain's comm.backend (DDP always runs on Gloo: torch's MPI backend needs a source "
                             "build); default gloo")
    parser.add_argument("--model", choices=MODELS, help=argparse.SUPPRESS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args()


class MLP(torch.nn.Sequential):
    """1024-2048-2048-10 with ReLU: 6.3 M parameters, 25 MB of float32 gradients."""

    def __init__(self) -> None:
        super().__init__(torch.nn.Linear(1024, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 2048), torch.nn.ReLU(),
                         torch.nn.Linear(2048, 10))


def build(model_name: str) -> tuple[torch.nn.Module, tuple[int, ...], int]:
    """The model, one sample's feature shape, and the samples per rank per step."""
    from dtrain.models import ConvNetCIFAR10

    if model_name == "conv":
        return ConvNetCIFAR10(dropout=0.0), (3, 32, 32), 32
    if model_name == "transformer":
        from dtrain.models import CharTransformer

        return CharTransformer(73, context_length=128), (), 1024  # 1,024 predicted characters per rank
    return MLP(), (1024,), 64


def make_source(model_name: str, shape: tuple[int, ...]):
    """The benchmark's data: random features and labels in memory, or the language model's windows."""
    from dtrain import MinibatchSource
    from dtrain.data import ArrayDeserializer, CharCorpus

    if model_name == "transformer":
        return MinibatchSource(CharCorpus("train", context_length=128), randomization_seed=1, defining_stream="text[1:]")
    generator = np.random.default_rng(0)
    features = generator.normal(size=(4096, *shape)).astype(np.float32)
    labels = generator.integers(0, 10, size=4096)
    return MinibatchSource(ArrayDeserializer(features, labels, num_classes=10), randomization_seed=1)


def loss_of(model: torch.nn.Module, batch, model_name: str) -> torch.Tensor:
    """The minibatch's mean loss: over samples, or over predicted characters (the recipe's token mean)."""
    if model_name == "transformer":
        from dtrain.session import SequenceCrossEntropy

        text = batch["text"]
        return SequenceCrossEntropy()(model(text.steps(0, -1)), text.steps(1, None))
    return torch.nn.functional.cross_entropy(model(batch.features), batch.labels)


# -- one rank ----------------------------------------------------------------------------------------
def worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    from dtrain.comm import create_communicator
    from dtrain.learners import data_parallel_distributed_learner

    comm = create_communicator(args.backend)  # "mpi": dtrain's tensors through MPI, DDP's through its Gloo group
    torch.manual_seed(0)
    model, shape, per_rank = build(args.model)
    ddp_model = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(model))
    ddp_optimizer = torch.optim.SGD(ddp_model.parameters(), lr=0.01, momentum=0.9)
    learner = data_parallel_distributed_learner(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9), comm)
    learner.prepare(model)

    sources = {name: make_source(args.model, shape) for name in ("ddp", "dtrain")}
    global_minibatch = per_rank * comm.size

    def ddp_step() -> None:
        batch = sources["ddp"].next_minibatch(global_minibatch, comm.size, comm.rank)
        ddp_optimizer.zero_grad(set_to_none=True)
        loss_of(ddp_model, batch, args.model).backward()
        ddp_optimizer.step()

    def dtrain_step() -> None:
        batch = sources["dtrain"].next_minibatch(global_minibatch, comm.size, comm.rank)
        learner.begin_minibatch(batch.num_samples, batch.global_num_samples)
        scale = learner.fold_gradient_scale()  # as training_session does: the 1/N rides in backward
        (loss_of(model, batch, args.model) * scale).backward()
        learner.step()

    def timed(step, count: int) -> float:
        comm.barrier()
        start = time.perf_counter()
        for _ in range(count):
            step()
        comm.barrier()
        return max(comm.allgather_object(time.perf_counter() - start)) / count

    timed(ddp_step, args.warmup)
    timed(dtrain_step, args.warmup)
    times: dict[str, list[float]] = {"ddp": [], "dtrain": []}
    for round_index in range(args.rounds):
        order = (("ddp", ddp_step), ("dtrain", dtrain_step))
        for name, step in order if round_index % 2 == 0 else reversed(order):
            times[name].append(timed(step, args.steps))
    difference = max(float((a.detach() - b.detach()).abs().max())
                     for a, b in zip(ddp_model.module.parameters(), model.parameters()))
    difference = max(comm.allgather_object(difference))
    if comm.is_main:
        print("RESULT " + json.dumps({
            "model": args.model, "parameters": sum(p.numel() for p in model.parameters()), "per_rank": per_rank,
            "ddp_ms": [1e3 * t for t in times["ddp"]], "dtrain_ms": [1e3 * t for t in times["dtrain"]],
            "max_parameter_difference": difference}), flush=True)
    learner.finalize()
    ddp_model = None  # its reducer holds the process group: release it before the group goes
    comm.finalize()


# -- the driver ----------------------------------------------------------------------------------------
def run(model_name: str, args: argparse.Namespace) -> dict:
    arguments = ["--worker", "--model", model_name, "--steps", str(args.steps), "--warmup", str(args.warmup),
                 "--rounds", str(args.rounds), "--backend", args.backend]
    done = subprocess.run(mpiexec_command(args.ranks, [__file__, *arguments]), capture_output=True, text=True,
                          env=mpi_environment(OMP_NUM_THREADS="1"), timeout=1800)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"mpiexec -n {args.ranks} failed (exit {done.returncode}):\n{done.stdout}\n{done.stderr}")
    return json.loads(lines[0][len("RESULT "):])


def main() -> None:
    args = parse_args()
    if args.worker:
        worker(args)
        return
    print(f"{args.ranks} ranks, DDP on Gloo, dtrain on {args.backend}, 1 torch thread per rank, {args.steps} timed steps per trainer per round, "
          f"median of {args.rounds} alternating rounds")
    print(f"{'model':<7}{'parameters':>12}{'per rank':>10}{'DDP ms/step':>13}{'dtrain ms/step':>16}{'dtrain/DDP':>12}"
          f"{'per round':>11}{'max |dparam|':>14}  every round (DDP | dtrain)")
    for model_name in args.models:
        result = run(model_name, args)
        ddp, ours = statistics.median(result["ddp_ms"]), statistics.median(result["dtrain_ms"])
        paired = statistics.median(b / a for a, b in zip(result["ddp_ms"], result["dtrain_ms"]))
        rounds = "/".join(f"{t:.0f}" for t in result["ddp_ms"]) + " | " + "/".join(f"{t:.0f}" for t in result["dtrain_ms"])
        print(f"{model_name:<7}{result['parameters']:>12,}{result['per_rank']:>10}{ddp:>13.1f}{ours:>16.1f}"
              f"{ours / ddp:>12.3f}{paired:>11.3f}{result['max_parameter_difference']:>14.3g}  {rounds}", flush=True)


if __name__ == "__main__":
    main()
