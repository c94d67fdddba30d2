"""Test accuracy of each distributed learner at the same number of samples, under mpiexec.

    python benchmarks/learner_accuracy.py                       # digits, 2 ranks, seeds 0 1 2
    python benchmarks/learner_accuracy.py --ranks 4 --seeds 0 --samples 30000

Every row trains the `digits` recipe with the same global minibatch, learning-rate schedule and
number of samples; only the learner differs. It shows what 1-bit SGD's error feedback and
full-precision warm start are worth, and whether block momentum keeps up with data_parallel.
Each configuration runs once per seed; the table gives the mean and the spread of the test
accuracy, and the wall time of one run; a run whose loss turns NaN counts as diverged.
"""
from __future__ import annotations

import argparse
import math
import re
import statistics
import subprocess
import tempfile
import time

from _mpiexec import mpi_environment, mpiexec_command

CONFIGS = {
    "data_parallel": ["learner=data_parallel"],
    "1-bit, warm start": ["learner=quantized", "learner.distributed_after=3000"],
    "1-bit, no warm start": ["learner=quantized"],
    "1-bit, no error feedback": ["learner=quantized", "learner.distributed_after=3000", "learner.error_feedback=false"],
    "block_momentum 640": ["learner=block_momentum", "learner.block_size=640"],
}


def run(ranks: int, overrides: list[str], seed: int, samples: int) -> tuple[float, float]:
    """Trains once; returns (test accuracy in %, wall seconds)."""
    with tempfile.TemporaryDirectory() as run_dir:
        command = mpiexec_command(ranks, ["-m", "dtrain", "+recipe=digits", *overrides, f"seed={seed}",
                                          f"session.max_samples={samples}", "session.checkpoint.frequency=0",
                                          "session.tensorboard=false", f"run_dir={run_dir}"])
        started = time.perf_counter()
        result = subprocess.run(command, capture_output=True, text=True, env=mpi_environment(), timeout=1800)
        seconds = time.perf_counter() - started
    match = re.search(r"test: accuracy ([\d.]+)%", result.stdout)
    if "training diverged" in result.stderr:
        return float("nan"), seconds
    if result.returncode != 0 or match is None:
        raise RuntimeError(f"{' '.join(overrides)} failed ({result.returncode}):\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}")
    return float(match.group(1)), seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--samples", type=int, default=30000, help="global samples per run (the recipe's 20 sweeps)")
    parser.add_argument("--only", nargs="*", default=None, help="configuration names to run (default: all)")
    args = parser.parse_args()
    names = args.only or list(CONFIGS)
    print(f"digits recipe, {args.ranks} ranks, {args.samples} samples, seeds {args.seeds}")
    print(f"{'learner':<26} {'test accuracy %':>16} {'spread':>8} {'s/run':>7}")
    for name in names:
        results = [run(args.ranks, CONFIGS[name], seed, args.samples) for seed in args.seeds]
        accuracies = [accuracy for accuracy, _ in results if not math.isnan(accuracy)]
        diverged = len(results) - len(accuracies)
        seconds = statistics.mean(s for _, s in results)
        mean = f"{statistics.mean(accuracies):.2f}" if accuracies else "-"
        spread = f"{max(accuracies) - min(accuracies):.2f}" if accuracies else "-"
        note = f"  diverged in {diverged} of {len(results)} runs" if diverged else ""
        print(f"{name:<26} {mean:>16} {spread:>8} {seconds:>7.1f}{note}", flush=True)


if __name__ == "__main__":
    main()
