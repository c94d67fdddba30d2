"""Synchronized BatchNorm against per-rank BatchNorm: does a run mean the same at any world size?

    python benchmarks/sync_batchnorm.py                       # the docs/batchnorm.md table: 1, 2 and 4 ranks
    python benchmarks/sync_batchnorm.py --max-samples 6000    # shorter, on a loaded machine

Every row trains the `digits` recipe with `model.batch_norm=true` (Conv-BatchNorm-ReLU) and the
data_parallel learner's defaults, under `mpiexec -n N` (oversubscribed when N exceeds the cores),
with and without `session.sync_batchnorm=true`; only the world size and that switch differ. It prints
the final test accuracy and loss, and the largest difference of the final parameters and of the
BatchNorm running statistics (read from each run's `model.safetensors`) to the one-process run.
With sync BatchNorm every row should equal one process to float tolerance; without it, per-rank
statistics over a quarter of the minibatch move both. Training amplifies rounding: the first row, the
one-process run again with 2 torch threads instead of 1 (the same arithmetic rounded differently),
shows how far float noise alone moves the final model; a row within that floor is "equal to float
tolerance over the whole run".
"""
from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
import time
from pathlib import Path

from _mpiexec import mpi_environment, mpiexec_command
from _run_records import last_record, run_records, value


def train(ranks: int, sync: bool, run_dir: Path, max_samples: int | None, seed: int, threads: int = 1) -> dict:
    """One run (``threads`` torch threads per rank); returns its test accuracy and loss (from its metrics.jsonl),
    wall seconds and final state."""
    from safetensors.torch import load_file

    length = [f"session.max_samples={max_samples}", f"session.num_threads={threads}"] if max_samples else \
        [f"session.num_threads={threads}"]
    program = ["-m", "dtrain", "+recipe=digits", "model.batch_norm=true", "learner=data_parallel",
               f"session.sync_batchnorm={'true' if sync else 'false'}", f"seed={seed}", *length,
               "session.checkpoint.frequency=0", "session.tensorboard=false", f"run_dir={run_dir}"]
    command = mpiexec_command(ranks, program)
    started = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, env=mpi_environment(OMP_NUM_THREADS="1"),
                            timeout=7200)
    seconds = time.perf_counter() - started
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed (exit {result.returncode}):\n"
                         f"{(result.stdout + result.stderr)[-3000:]}")
    test = last_record(run_records(run_dir), "test")
    return {"accuracy": value(test, "accuracy", 100), "loss": value(test, "loss"), "seconds": seconds,
            "state": load_file(run_dir / "model.safetensors")}


def largest_differences(state: dict, reference: dict) -> tuple[float, float]:
    """(largest parameter difference, largest running-statistics difference) to ``reference``."""
    parameters = statistics = 0.0
    for key, value in reference.items():
        if key.endswith("num_batches_tracked"):
            continue
        difference = float((state[key].double() - value.double()).abs().max())
        if key.endswith(("running_mean", "running_var")):
            statistics = max(statistics, difference)
        else:
            parameters = max(parameters, difference)
    return parameters, statistics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--max-samples", type=int, default=None, help="global samples (default: the recipe's 30,000)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    os.chdir(Path(__file__).resolve().parent)
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        reference = train(1, False, Path(scratch) / "reference", args.max_samples, args.seed)
        # the same one-process run with 2 torch threads: other rounding only, the floor of any comparison
        floor = train(1, False, Path(scratch) / "floor", args.max_samples, args.seed, threads=2)
        rows.append(("1 (2 threads)", False, floor, *largest_differences(floor["state"], reference["state"])))
        for ranks in args.ranks:
            for sync in (False, True):
                run = reference if ranks == 1 and not sync else \
                    train(ranks, sync, Path(scratch) / f"{ranks}-{sync}", args.max_samples, args.seed)
                rows.append((ranks, sync, run, *largest_differences(run["state"], reference["state"])))
    samples = f"{args.max_samples:,}" if args.max_samples else "30,000"
    print(f"digits, model.batch_norm=true, learner=data_parallel, global minibatch 32, {samples} samples, "
          f"seed {args.seed}")
    print("| ranks | sync_batchnorm | test accuracy | test loss | largest parameter difference to 1 process "
          "| largest running-statistics difference | wall s |")
    print("|---|---|---|---|---|---|---|")
    for ranks, sync, run, parameters, statistics in rows:
        print(f"| {ranks} | {'true' if sync else 'false'} | {run['accuracy']:.2f}% | {run['loss']:.4f} "
              f"| {parameters:.2e} | {statistics:.2e} | {run['seconds']:.0f} |")


if __name__ == "__main__":
    main()
