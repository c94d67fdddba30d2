"""What a logger costs: milliseconds to log one ``metrics.jsonl`` record, for MLflow (a file store) and W&B
(offline), the only work a logger adds to training (records arrive once per progress period, cross-validation
and test; no logger does anything per step).

    python benchmarks/logger_cost.py                  # 200 train records of 11 values each
    python benchmarks/logger_cost.py --records 1000

Each logger starts a tracking run in a temporary run directory and is given the records as the session gives
them (``on_progress``); the table gives the mean time per record, and the same time per step of the digits
recipe's defaults (progress every 5 epochs of 1,500 samples, minibatch 32: a record per 234 steps).
"""
from __future__ import annotations

import argparse
import importlib.util
import tempfile
import time
from pathlib import Path

from dtrain.loggers import MLflowLogger, WandbLogger

#: a train record as the session writes it: 11 measured values
RECORD = {"kind": "train", "samples": 0, "time": 0.0, "loss": 1.0, "error": 0.5, "samples_per_second": 1e4,
          "lr": 0.1, "period_s": 1.0, "data_s": 0.1, "compute_s": 0.5, "update_s": 0.1, "exchange_s": 0.1,
          "optimizer_s": 0.1, "other_s": 0.1}
#: the digits recipe's steps per progress record: 5 epochs of 1,500 samples in minibatches of 32
DIGITS_STEPS_PER_RECORD = 5 * 1500 / 32


class RunStandIn:
    """What a logger reads of a run (a :class:`~dtrain.session.callbacks.RunView`'s facts), for a fresh run."""

    def __init__(self, run_dir: Path):
        self.run_dir, self.config, self.restored_from, self.world_size = run_dir, {"recipe_name": "bench"}, None, 1


def time_logger(make, records: int) -> float:
    """Mean seconds per record logged by the logger ``make()`` builds."""
    with tempfile.TemporaryDirectory() as directory:
        run = RunStandIn(Path(directory))
        logger = make()
        logger.on_run_start(run)
        start = time.perf_counter()
        for index in range(records):
            logger.on_progress(run, {**RECORD, "samples": (index + 1) * 320, "time": time.time()})
        seconds = (time.perf_counter() - start) / records
        logger.on_exception(run, RuntimeError("benchmark over"))  # ends the tracking run
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=200, help="records logged per logger (default 200)")
    args = parser.parse_args()
    loggers = {"mlflow (file store)": ("mlflow", MLflowLogger),
               "wandb (offline)": ("wandb", lambda: WandbLogger(mode="offline"))}
    print(f"| logger | ms per record ({len(RECORD) - 3} values) | us per digits step |")
    print("|---|---|---|")
    for name, (package, make) in loggers.items():
        if importlib.util.find_spec(package) is None:
            print(f"| {name} | not installed (pip install 'dtrain[{package}]') | |")
            continue
        seconds = time_logger(make, args.records)
        print(f"| {name} | {seconds * 1e3:.2f} | {seconds / DIGITS_STEPS_PER_RECORD * 1e6:.1f} |")


if __name__ == "__main__":
    main()
