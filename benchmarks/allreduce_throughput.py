"""Throughput of the data-parallel learner's bucketed gradient all-reduce against a raw all-reduce.

    mpiexec -n 2 python benchmarks/allreduce_throughput.py
    mpiexec -n 2 python benchmarks/allreduce_throughput.py --megabytes 50 --bucket-mb 25 --repeats 20

(As root, Open MPI also needs ``OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1``.)

The "model" is a stack of square float32 weight matrices holding about ``--megabytes`` MB (10^6
bytes) of parameters. Rows of the table, each the median over ``--repeats`` timed rounds:

* raw all_reduce, one tensor: the communicator's all-reduce of one flat tensor of the same bytes
  (``torch.distributed.all_reduce`` with Gloo, ``MPI_Allreduce`` with ``--backend mpi``);
* raw all_reduce, same buckets: the learner's buckets reduced back to back (async, then wait all);
* learner reduction path: (backward + ``learner.step()``) minus (backward + ``optimizer.step()``)
  without the learner, i.e. the time the learner adds: packing gradients into buckets, the
  all-reduces, waiting and copying back. The backward only accumulates a gradient into each
  parameter, so it adds no compute for the all-reduce to hide behind.

GB/s is algorithm bandwidth: gradient bytes / seconds (10^9 bytes). The ratio is against the
first row. The measurements alternate within every round, so other load on the machine hits all
of them alike. A note line also gives the time of the one copy the learner adds (every gradient,
scaled, into its bucket slot, as the hooks do; DDP does the same copy).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from dtrain.comm import create_communicator
from dtrain.learners import DataParallelLearner


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--megabytes", type=float, default=32.0, help="parameter bytes in MB (10^6), default 32")
    parser.add_argument("--bucket-mb", type=float, default=25.0, help="learner bucket size in MiB, default 25")
    parser.add_argument("--repeats", type=int, default=15, help="timed rounds per row (median), default 15")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank, default 1")
    parser.add_argument("--backend", choices=("gloo", "mpi"), default="gloo",
                        help="comm.backend: how tensors travel between the ranks, default gloo")
    parser.add_argument("--netns", metavar="RATE", help="run on 2 simulated hosts linked at RATE (e.g. 1gbit; needs "
                        "root; see netns_cluster.py) instead of the ranks of this mpiexec")
    return parser.parse_args()


def run_on_cluster(args: argparse.Namespace) -> None:
    """Runs this benchmark (without ``--netns``) on a 2-host ``NamespaceCluster`` at ``args.netns`` and prints its table."""
    from dtrain.testing.netns import NamespaceCluster

    repo = Path(__file__).resolve().parents[1]  # the ranks import this benchmark's dtrain

    worker = [sys.executable, str(Path(__file__).resolve()), "--megabytes", str(args.megabytes), "--bucket-mb",
              str(args.bucket_mb), "--repeats", str(args.repeats), "--threads", str(args.threads), "--backend", args.backend]
    env = {"PYTHONPATH": str(repo)}
    with NamespaceCluster(num_hosts=2, rate=args.netns) as cluster:
        result = cluster.run(cluster.mpiexec_args(npernode=1, export=list(env)) + worker, timeout=1800, env=env)
    if result.returncode != 0:
        raise SystemExit(f"the benchmark failed on the cluster:\n{result.report()}")
    print(f"2 hosts (network namespaces) linked at {args.netns}, one rank each")
    print(result.stdout, end="")


def make_parameters(megabytes: float) -> list[torch.nn.Parameter]:
    side = 1024
    count = max(1, round(megabytes * 1e6 / (side * side * 4)))
    return [torch.nn.Parameter(torch.randn(side, side)) for _ in range(count)]


def median_seconds(runs: dict[str, Callable[[], None]], repeats: int, comm) -> dict[str, float]:
    """Median wall time of each ``run()`` over ``repeats`` rounds, all ranks starting each together.

    The runs alternate within every round, so load from other processes hits all of them alike.
    """
    times: dict[str, list[float]] = {name: [] for name in runs}
    for round_index in range(repeats + 1):
        for name, run in runs.items():
            comm.barrier()
            start = time.perf_counter()
            run()
            if round_index:  # round 0 warms up: connections, allocations
                times[name].append(time.perf_counter() - start)
    medians = torch.tensor([statistics.median(times[name]) for name in runs], dtype=torch.float64)
    comm.allreduce(medians, op="max")  # the slowest rank decides how long a step takes
    return dict(zip(runs, medians.tolist()))


def main() -> None:
    args = parse_args()
    if args.netns:
        run_on_cluster(args)
        return
    torch.set_num_threads(args.threads)
    comm = create_communicator(backend=args.backend)  # CPU tensors, also on a GPU machine
    if comm.size < 2:
        raise SystemExit("run under mpiexec with at least 2 ranks: mpiexec -n 2 python benchmarks/allreduce_throughput.py")
    parameters = make_parameters(args.megabytes)
    num_bytes = sum(p.numel() * p.element_size() for p in parameters)
    ones = [torch.ones_like(p) for p in parameters]

    def backward() -> None:
        # accumulates ones into every .grad; post-accumulate hooks fire as in a real backward
        torch.autograd.backward(parameters, grad_tensors=ones)

    optimizer = torch.optim.SGD(parameters, lr=0.0)
    learner = DataParallelLearner(optimizer, comm, bucket_size_mb=args.bucket_mb)
    learner.prepare(torch.nn.ParameterList(parameters))

    scaled_ones = [one / comm.size for one in ones]

    def learner_round() -> None:
        learner.begin_minibatch(1, comm.size)
        # as training_session does: the 1/N scale rides in backward (the loss), not in a pass over the gradients
        assert learner.fold_gradient_scale() == 1 / comm.size
        torch.autograd.backward(parameters, grad_tensors=scaled_ones)
        learner.step()

    flat = torch.zeros(num_bytes // 4)
    bucket_buffers = [torch.zeros(sum(shape.numel() for shape in bucket.shapes_with_flags)) for bucket in learner.buckets]

    def raw_bucketed() -> None:
        for handle in [comm.allreduce_async(buffer) for buffer in bucket_buffers]:
            handle.wait()

    def packing() -> None:
        # what the hooks copy: every gradient, scaled, into its bucket slot (no communication)
        for bucket in learner.buckets:  # large gradients are reduced in place: nothing to copy
            for gradient, source in zip(getattr(bucket, "gradients", []), ones):
                gradient.copy_(source)

    def local_round() -> None:
        # the same work without the learner: hooks stay registered but are not armed
        optimizer.zero_grad(set_to_none=True)
        backward()
        optimizer.step()

    seconds = median_seconds({"raw": lambda: comm.allreduce(flat), "bucketed": raw_bucketed,
                              "learner": learner_round, "local": local_round, "packing": packing}, args.repeats, comm)
    raw_seconds, bucketed_seconds = seconds["raw"], seconds["bucketed"]
    learner_seconds, local_seconds = seconds["learner"], seconds["local"]
    reduction_seconds = learner_seconds - local_seconds
    learner.finalize()

    if comm.is_main:
        rows = [
            ("raw all_reduce, one tensor", raw_seconds),
            (f"raw all_reduce, {len(learner.buckets)} buckets", bucketed_seconds),
            ("learner reduction path", reduction_seconds),
        ]
        print(f"{comm.size} ranks ({comm.backend}), {len(parameters)} parameters, {num_bytes / 1e6:.1f} MB of "
              f"gradients, buckets of {args.bucket_mb:g} MiB, {args.threads} thread(s) per rank, median of {args.repeats}")
        print(f"(learner backward+step {1e3 * learner_seconds:.1f} ms; local backward+step "
              f"{1e3 * local_seconds:.1f} ms; of the learner's, copying the gradients into the buckets "
              f"{1e3 * seconds['packing']:.1f} ms)")
        print(f"{'path':<34}{'ms':>9}{'GB/s':>9}{'ratio':>8}")
        for name, row_seconds in rows:
            print(f"{name:<34}{1e3 * row_seconds:>9.1f}{num_bytes / row_seconds / 1e9:>9.2f}{raw_seconds / row_seconds:>8.2f}")
    comm.finalize()


if __name__ == "__main__":
    main()
