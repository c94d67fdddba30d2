"""Samples/s of one ``python -m dtrain`` process against its torch thread count, on an idle machine and
on one loaded with busy processes.

    python benchmarks/thread_choice.py                              # digits, 1/2/all threads, idle and loaded by 2
    python benchmarks/thread_choice.py --threads 1 2 4 --load 0 2 --rounds 3
    python benchmarks/thread_choice.py --recipe cifar10 --max-samples 2000

Each run is the real command line (``session.num_threads=N``; ``default`` leaves it unset, i.e.
dtrain's own choice, which the start-up line names), in a fresh process without
``OMP_NUM_THREADS``, so torch starts as a user's would. ``--load K`` starts K processes that spin
on the CPU for the whole measurement (what other jobs on a shared machine look like). Rounds
alternate between the thread counts so machine noise hits all of them; the table gives the median
samples/s of the training loop (from the run's ``metrics.jsonl``: its samples over the sum of its
training periods) and each one's ratio to the best of its row.
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _run_records import run_records, training_rate


def spin(stop) -> None:
    """A busy process: pure-Python arithmetic until told to stop."""
    value = 0
    while not stop.is_set():
        for _ in range(100_000):
            value = (value * 31 + 7) % 1_000_003


#: the start-up line naming dtrain's thread choice and why (dtrain.threads.ThreadChoice.describe): printed only
THREAD_LINE = re.compile(r"^dtrain: \d+ torch threads? \(.*\)$", re.MULTILINE)


def run_once(recipe: str, threads: str, max_samples: int | None) -> tuple[float, str]:
    """(samples/s of the training loop, from the run's metrics.jsonl; the start-up line about threads) of one run."""
    environment = {key: value for key, value in os.environ.items()
                   if key not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    with tempfile.TemporaryDirectory() as run_dir:
        command = [sys.executable, "-m", "dtrain", f"+recipe={recipe}", f"run_dir={run_dir}",
                   "session.checkpoint.frequency=0", "session.tensorboard=false", "session.progress_bar=false"]
        if threads != "default":
            command.append(f"session.num_threads={threads}")
        if max_samples:
            command.append(f"session.max_samples={max_samples}")
        done = subprocess.run(command, capture_output=True, text=True, env=environment, timeout=3600)
        if done.returncode != 0:
            raise SystemExit(f"{' '.join(command)} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
        rate = training_rate(run_records(Path(run_dir)))
    thread_line = THREAD_LINE.search(done.stdout)
    if thread_line is None:
        raise SystemExit(f"no {THREAD_LINE.pattern!r} line in the output of {' '.join(command)}")
    return rate, thread_line.group(0).removeprefix("dtrain: ")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="digits")
    parser.add_argument("--threads", nargs="+", default=["1", "2", str(os.cpu_count()), "default"],
                        help="session.num_threads values ('default': unset)")
    parser.add_argument("--load", nargs="+", type=int, default=[0, 2], help="busy processes during a row")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-samples", type=int, default=None, help="session.max_samples (default: the recipe's)")
    args = parser.parse_args()
    candidates = list(dict.fromkeys(args.threads))
    print(f"{os.cpu_count()} CPUs, recipe {args.recipe}, {args.rounds} alternating rounds, samples/s (median)")
    print(f"{'busy':>5} " + " ".join(f"{'threads=' + c:>16}" for c in candidates) + "   ratios to the row's best")
    notes = set()
    for load in args.load:
        stop = multiprocessing.Event()
        spinners = [multiprocessing.Process(target=spin, args=(stop,), daemon=True) for _ in range(load)]
        for process in spinners:
            process.start()
        try:
            rates: dict[str, list[float]] = {c: [] for c in candidates}
            for _ in range(args.rounds):
                for candidate in candidates:
                    rate, line = run_once(args.recipe, candidate, args.max_samples)
                    rates[candidate].append(rate)
                    if candidate == "default" and line:
                        notes.add(line)
        finally:
            stop.set()
            for process in spinners:
                process.join()
        medians = {c: statistics.median(values) for c, values in rates.items()}
        best = max(medians.values())
        print(f"{load:>5} " + " ".join(f"{medians[c]:>16,.0f}" for c in candidates) + "   "
              + " ".join(f"{medians[c] / best:.2f}" for c in candidates), flush=True)
    for note in sorted(notes):
        print(f"default: {note}")


if __name__ == "__main__":
    main()
