"""Step time with loggers and callbacks on against none, on a recipe run through the command line.

    python benchmarks/callback_overhead.py                                  # digits, 5 alternating rounds
    python benchmarks/callback_overhead.py --recipe shakespeare_char --samples 40000 --progress 4000
    python benchmarks/callback_overhead.py --with "logger=[mlflow] callbacks=[early_stopping]"

Each round runs ``python -m dtrain +recipe=R`` twice, once plain and once with ``--with``'s overrides (by
default two loggers and three callbacks: W&B offline, MLflow's file store, early stopping, the best
checkpoint and the time limit), both with ``--base``'s (cross-validation, which the monitors read), the order alternating between rounds so machine noise hits both. The step time
is read from each run's ``metrics.jsonl``: the training periods' ``period_s`` over their samples, the first
period left out (start-up, the loggers' connection, kernels warming up). Printed: each side's samples/s (median),
their ratio, and the median of the per-round ratios (the two runs of a round back to back).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

#: two loggers and three callbacks, the configuration the step-time promise is about
DEFAULT_WITH = ("logger=[wandb,mlflow] logger.wandb.mode=offline callbacks=[early_stopping,best_checkpoint,time_limit] "
                "callbacks.time_limit.max_time=24:00:00 callbacks.early_stopping.patience=100 "
                "callbacks.early_stopping.monitor=cv.loss callbacks.best_checkpoint.monitor=cv.loss")  # every recipe has it
#: what both sides run with: cross-validation (which the monitors of early stopping and the best checkpoint read),
#: and one torch thread (dtrain chooses threads by the load at start, which would differ between the sides)
DEFAULT_BASE = "source.cv=${source.test} session.cv.frequency=6000 session.num_threads=1"


def training_rate(recipe: str, samples: int, progress: int, extra: list[str], run_dir: Path) -> float:
    """Samples/s of one run's training periods after its first, from its ``metrics.jsonl``."""
    command = [sys.executable, "-m", "dtrain", f"+recipe={recipe}", f"session.max_samples={samples}",
               f"session.progress_frequency={progress}", f"run_dir={run_dir}", "session.progress_bar=false", *extra]
    environment = {**os.environ, "WANDB_SILENT": "true"}
    finished = subprocess.run(command, capture_output=True, text=True, env=environment)
    if finished.returncode != 0:
        raise SystemExit(f"{shlex.join(command)} failed ({finished.returncode}):\n{finished.stderr[-2000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    periods = [record for record in records if record["kind"] == "train"][1:]
    if not periods:
        raise SystemExit(f"{run_dir}: fewer than two training periods; raise --samples or lower --progress")
    seconds = sum(record["period_s"] for record in periods)
    counted = periods[-1]["samples"] - [r for r in records if r["kind"] == "train"][0]["samples"]
    return counted / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="digits")
    parser.add_argument("--samples", type=int, default=30000, help="session.max_samples of each run")
    parser.add_argument("--progress", type=int, default=3000, help="session.progress_frequency of each run")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--with", dest="with_overrides", default=DEFAULT_WITH,
                        help="the overrides that turn loggers and callbacks on")
    parser.add_argument("--base", default=DEFAULT_BASE, help="overrides both sides run with")
    args = parser.parse_args()
    extra, base = shlex.split(args.with_overrides), shlex.split(args.base)
    plain, equipped, ratios = [], [], []
    with tempfile.TemporaryDirectory() as scratch:
        for round_index in range(args.rounds):
            order = [False, True] if round_index % 2 == 0 else [True, False]
            rates = {}
            for with_extras in order:
                run_dir = Path(scratch) / f"{round_index}-{'with' if with_extras else 'plain'}"
                rates[with_extras] = training_rate(args.recipe, args.samples, args.progress,
                                                   base + (extra if with_extras else []), run_dir)
            plain.append(rates[False])
            equipped.append(rates[True])
            ratios.append(rates[True] / rates[False])
            print(f"round {round_index + 1}: plain {rates[False]:,.0f} samples/s, with {rates[True]:,.0f} "
                  f"({rates[True] / rates[False]:.3f})", flush=True)
    print(f"\nload: {os.getloadavg()[0]:.2f}; recipe {args.recipe}, {args.samples} samples, {args.rounds} rounds")
    print(f"both: {' '.join(base)}\nwith: {' '.join(extra)}")
    print(f"{'plain /s':>12} {'with /s':>12} {'with/plain':>11} {'per round':>10}")
    print(f"{statistics.median(plain):12,.0f} {statistics.median(equipped):12,.0f} "
          f"{statistics.median(equipped) / statistics.median(plain):11.3f} {statistics.median(ratios):10.3f}")


if __name__ == "__main__":
    main()
