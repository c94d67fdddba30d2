"""Weak scaling of the data-parallel learner: samples/s with 1 process against 2 (same per-rank minibatch).

    python benchmarks/weak_scaling.py                              # CIFAR ConvNet, 1 and 2 processes
    python benchmarks/weak_scaling.py --model digits --per-rank-minibatch 64 --steps 200

The script starts ``mpiexec -n 1`` and ``mpiexec -n 2`` of itself (``--worker``) and prints a table.
Each rank uses one torch thread, so 2 processes use 2 cores; every rank reads ``--per-rank-minibatch``
samples per step (global minibatch = size * that) from in-memory random data through
``MinibatchSource`` and trains with ``data_parallel_distributed_learner`` (the calls
``training_session`` makes per minibatch: read, begin_minibatch, forward, backward, step).
Rate = global samples / wall seconds over ``--steps`` steps after ``--warmup`` steps, the median
over ``--rounds`` rounds in which the runs alternate; efficiency = rate(2) / (2 * rate(1)).

The 2-process data-parallel run has one row per ``--backends`` entry: ``gloo`` (tensors through
Gloo's TCP) and ``mpi`` (through MPI's shared memory, what ``comm.backend=auto`` picks for an
``mpiexec`` job on one node). A last row runs 2 processes that do not communicate (each its own
local learner on its share): the machine's own ceiling for 2 processes, e.g. when other work
shares the cores, so the learner's cost is the gap between that row and a data-parallel one.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import time

import numpy as np
import torch
from _mpiexec import mpi_environment, mpiexec_command

MODELS = ("cifar", "digits")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=MODELS, default="cifar", help="ConvNet_CIFAR10 (default) or the digits CNN")
    parser.add_argument("--per-rank-minibatch", type=int, default=32, help="samples per rank per step, default 32")
    parser.add_argument("--steps", type=int, default=40, help="timed steps, default 40")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first, default 5")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of the three runs (median), default 3")
    parser.add_argument("--bucket-mb", type=float, default=25.0, help="learner bucket size in MiB, default 25")
    parser.add_argument("--backends", nargs="+", choices=("gloo", "mpi"), default=["gloo", "mpi"],
                        help="how the ranks' tensors travel (comm.backend), one 2-process row each; default both")
    parser.add_argument("--backend", default="gloo", help=argparse.SUPPRESS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--independent", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args()


# -- one rank ---------------------------------------------------------------------------------------
def worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    from dtrain import MinibatchSource
    from dtrain import LocalLearner
    from dtrain.comm import LocalCommunicator, create_communicator
    from dtrain.data import ArrayDeserializer
    from dtrain.learners import data_parallel_distributed_learner
    from dtrain.models import ConvNetCIFAR10, DigitsCNN

    comm = create_communicator(backend=args.backend)  # CPU tensors, also on a GPU machine
    torch.manual_seed(0)
    if args.model == "cifar":
        model, shape = ConvNetCIFAR10(), (3, 32, 32)
    else:
        model, shape = DigitsCNN(), (1, 8, 8)
    generator = np.random.default_rng(0)
    features = generator.normal(size=(2048, *shape)).astype(np.float32)
    source = MinibatchSource(ArrayDeserializer(features, generator.integers(0, 10, size=2048), num_classes=10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    if args.independent:  # no communication: every rank trains alone on its share
        learner = LocalLearner(optimizer, LocalCommunicator())
    else:
        learner = data_parallel_distributed_learner(optimizer, comm, bucket_size_mb=args.bucket_mb)
    learner.prepare(model)
    global_minibatch = args.per_rank_minibatch * comm.size

    def train_step() -> None:
        batch = source.next_minibatch(global_minibatch, comm.size, comm.rank)
        learner.begin_minibatch(batch.num_samples, batch.global_num_samples)
        scale = learner.fold_gradient_scale()  # as training_session does: the 1/N rides in backward
        (torch.nn.functional.cross_entropy(model(batch.features), batch.labels) * scale).backward()
        learner.step()

    for _ in range(args.warmup):
        train_step()
    comm.barrier()
    start = time.perf_counter()
    for _ in range(args.steps):
        train_step()
    learner.synchronize()
    elapsed = max(comm.allgather_object(time.perf_counter() - start))
    if comm.is_main:
        parameters = sum(p.numel() for p in model.parameters())
        print("RESULT " + json.dumps({"size": comm.size, "independent": args.independent, "samples_per_second": args.steps * global_minibatch / elapsed,
                                      "step_ms": 1e3 * elapsed / args.steps, "parameters": parameters}), flush=True)
    learner.finalize()
    comm.finalize()


# -- the driver ------------------------------------------------------------------------------------
def run(nprocs: int, args: argparse.Namespace, independent: bool = False, backend: str = "gloo") -> dict:
    arguments = ["--worker", *(["--independent"] if independent else []), "--model", args.model, "--per-rank-minibatch", str(args.per_rank_minibatch),
                 "--steps", str(args.steps), "--warmup", str(args.warmup), "--bucket-mb", str(args.bucket_mb), "--backend", backend]
    done = subprocess.run(mpiexec_command(nprocs, [__file__, *arguments]), capture_output=True, text=True,
                          env=mpi_environment(OMP_NUM_THREADS="1"), timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"mpiexec -n {nprocs} failed (exit {done.returncode}):\n{done.stdout}\n{done.stderr}")
    return json.loads(lines[0][len("RESULT "):])


def _median_run(results: list[dict]) -> dict:
    """The result with the median rate (the upper one of an even count)."""
    return sorted(results, key=lambda result: result["samples_per_second"])[len(results) // 2]


def main() -> None:
    args = parse_args()
    if args.worker:
        worker(args)
        return
    # the runs alternate, so load from other work on the machine hits all of them alike
    runs = {"one": (1, False, "gloo"), **{backend: (2, False, backend) for backend in args.backends},
            "ceiling": (2, True, "gloo")}
    rounds = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, (nprocs, independent, backend) in runs.items():
            rounds[name].append(run(nprocs, args, independent, backend))
    medians = {name: _median_run(rounds[name]) for name in runs}
    one, ceiling = medians["one"], medians["ceiling"]
    print(f"model {args.model} ({one['parameters']:,} parameters), {args.per_rank_minibatch} samples per rank per "
          f"step, 1 torch thread per rank, {args.steps} timed steps, buckets of {args.bucket_mb:g} MiB, "
          f"median of {args.rounds} rounds")
    print(f"{'run':<30}{'processes':>9}{'global mb':>11}{'step ms':>10}{'samples/s':>11}{'efficiency':>12}  every round")
    rows = [("data-parallel", "one"), *((f"data-parallel, {backend}", backend) for backend in args.backends),
            ("independent (no communication)", "ceiling")]
    for name, key in rows:
        result = medians[key]
        every_round = "/".join(f"{r['samples_per_second']:.0f}" for r in rounds[key])
        print(f"{name:<30}{result['size']:>9}{result['size'] * args.per_rank_minibatch:>11}{result['step_ms']:>10.1f}"
              f"{result['samples_per_second']:>11.0f}"
              f"{result['samples_per_second'] / (result['size'] * one['samples_per_second']):>12.2f}  {every_round}")
    for backend in args.backends:
        efficiency = medians[backend]["samples_per_second"] / (2 * one["samples_per_second"])
        of_ceiling = medians[backend]["samples_per_second"] / ceiling["samples_per_second"]
        print(f"{backend}: weak-scaling efficiency rate2 / (2 * rate1) = {efficiency:.2f}, {of_ceiling:.2f} of the ceiling")


if __name__ == "__main__":
    main()
