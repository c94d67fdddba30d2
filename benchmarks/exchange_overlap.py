"""Does each exchange strategy overlap backward? Step time with the overlap on and off, under mpiexec.

    mpiexec -n 2 python benchmarks/exchange_overlap.py
    mpiexec -n 2 python benchmarks/exchange_overlap.py --strategies quantized1 powersgd1 --steps 30

(As root, Open MPI also needs OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1.)

A multi-layer perceptron (a deep stack of square layers, so backward is long and there are
many buckets) is trained by :class:`dtrain.learners.DataParallelLearner` with each strategy,
once with ``overlap_backward=True`` (buckets start during backward: the default) and once with
``False`` (every bucket starts after backward). Printed per strategy: the median step time
(forward + backward + exchange + optimizer, slowest rank) both ways and
``exchange_seconds_last_step`` (the exchange time after backward that did not overlap).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from dtrain.comm import create_communicator
from dtrain.exchange import AllReduce, CompressedAllReduce, PowerSGD, Quantized
from dtrain.learners import DataParallelLearner

STRATEGIES = {
    "allreduce": lambda: AllReduce(),
    "bf16": lambda: CompressedAllReduce("bf16"),
    "quantized1": lambda: Quantized(1),
    "powersgd1": lambda: PowerSGD(matrix_approximation_rank=1, start_powersgd_iter=0),
}


def measure(comm, strategy: str, overlap: bool, steps: int, width: int, depth: int) -> tuple[float, float]:
    """Median (step seconds, non-overlapped exchange seconds) over ``steps`` after 3 warm-up steps."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[layer for _ in range(depth) for layer in (torch.nn.Linear(width, width),
                                                                            torch.nn.Tanh())])
    learner = DataParallelLearner(torch.optim.SGD(model.parameters(), lr=1e-3), comm, bucket_size_mb=1.0,
                                  exchange=STRATEGIES[strategy](), overlap_backward=overlap)
    learner.prepare(model)
    generator = torch.Generator().manual_seed(comm.rank)
    inputs = torch.randn(256, width, generator=generator)
    step_seconds, exchange_seconds = [], []
    for step in range(steps + 3):
        comm.barrier()
        started = time.perf_counter()
        learner.begin_minibatch(256, 256 * comm.size)
        model(inputs).square().mean().backward()
        learner.step()
        elapsed = comm.allreduce(torch.tensor([time.perf_counter() - started, learner.exchange_seconds_last_step],
                                              dtype=torch.float64), op="max")
        if step >= 3:
            step_seconds.append(float(elapsed[0]))
            exchange_seconds.append(float(elapsed[1]))
    learner.finalize()
    return statistics.median(step_seconds), statistics.median(exchange_seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--strategies", nargs="+", choices=sorted(STRATEGIES), default=list(STRATEGIES))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=8)
    args = parser.parse_args()
    comm = create_communicator(backend="gloo")
    if comm.size < 2:
        raise SystemExit("run under mpiexec with at least 2 ranks")
    rows = []
    for strategy in args.strategies:
        with_overlap = measure(comm, strategy, True, args.steps, args.width, args.depth)
        without = measure(comm, strategy, False, args.steps, args.width, args.depth)
        rows.append((strategy, with_overlap, without))
    if comm.is_main:
        print(f"{args.depth} x Linear({args.width}, {args.width}), 1 MiB buckets, {comm.size} ranks, "
              f"{torch.get_num_threads()} torch threads per rank; median of {args.steps} steps, slowest rank")
        print(f"{'strategy':>12} | {'step ms, overlap':>16} | {'exchange after bw':>17} | {'step ms, no overlap':>19} "
              f"| {'exchange after bw':>17}")
        for strategy, (step_on, exchange_on), (step_off, exchange_off) in rows:
            print(f"{strategy:>12} | {1e3 * step_on:>16.1f} | {1e3 * exchange_on:>17.1f} | {1e3 * step_off:>19.1f} "
                  f"| {1e3 * exchange_off:>17.1f}")
    comm.finalize()


if __name__ == "__main__":
    main()
