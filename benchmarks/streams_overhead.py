"""The training loop's cost of named streams: this checkout against another (the single-tensor path),
on the same data and model, in one run.

    git worktree add /tmp/dtrain-before <commit before named streams>
    python benchmarks/streams_overhead.py --baseline /tmp/dtrain-before --rounds 21 --samples 6400

Two worker processes, one importing dtrain from this checkout and one from ``--baseline``, each
train the digits CNN (``DigitsCNN``) on the digits training set held in memory, with the session as
the command line runs it (progress lines, metrics files; no checkpoints), through the API both
versions share (``MinibatchSource(ArrayDeserializer)``, ``training_session``). The workers stay up
(torch and the kernels warm) and take turns, which side goes first alternating, so machine noise
hits both alike. Printed: each side's samples/s (median), their ratio, the median of the per-round
ratios (the two runs of a round back to back) and the cost per step in microseconds.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

#: what each worker runs: one line of JSON per request ({"samples": N}) -> {"rate": samples/s}
WORKER = r'''
import io, json, sys, tempfile, torch
from dtrain import LocalLearner, MinibatchSource, training_session
from dtrain.data import ArrayDeserializer, Digits
from dtrain.host_memory import keep_freed_host_memory
from dtrain.models import DigitsCNN

torch.set_num_threads(int(sys.argv[1]))
keep_freed_host_memory(True)
digits = Digits("train")
features, labels = digits.get(list(range(digits.num_samples)))
data = ArrayDeserializer(features, labels, num_classes=10)

def run(samples):
    torch.manual_seed(0)
    model = DigitsCNN()
    learner = LocalLearner(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    with tempfile.TemporaryDirectory() as run_dir:
        result = training_session(model, torch.nn.functional.cross_entropy, learner, MinibatchSource(data), 32,
                                  max_samples=samples, progress_frequency=7500, run_dir=run_dir,
                                  tensorboard=False, stream=io.StringIO()).train()
    return result.samples_seen / result.seconds

run(640)  # warm-up: allocator, kernels
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    print(json.dumps({"rate": run(json.loads(line)["samples"])}), flush=True)
'''


class Worker:
    """A Python process importing dtrain from ``tree``, training on request."""

    def __init__(self, tree: Path, threads: int):
        environment = {**os.environ, "PYTHONPATH": str(tree)}
        self.process = subprocess.Popen([sys.executable, "-c", WORKER, str(threads)], cwd=tree, env=environment,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        json.loads(self.process.stdout.readline())

    def rate(self, samples: int) -> float:
        self.process.stdin.write(json.dumps({"samples": samples}) + "\n")
        self.process.stdin.flush()
        return json.loads(self.process.stdout.readline())["rate"]

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, required=True, help="a checkout of the version to compare against")
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--samples", type=int, default=6400, help="samples per measurement")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each worker")
    args = parser.parse_args()
    here = Path(__file__).resolve().parent.parent
    load = os.getloadavg()[0]
    workers = {"this checkout": Worker(here, args.threads), "baseline": Worker(args.baseline.resolve(), args.threads)}
    rates: dict[str, list[float]] = {name: [] for name in workers}
    try:
        for index in range(args.rounds):
            names = list(workers) if index % 2 else list(reversed(workers))
            for name in names:
                rates[name].append(workers[name].rate(args.samples))
    finally:
        for worker in workers.values():
            worker.close()
    mine, theirs = statistics.median(rates["this checkout"]), statistics.median(rates["baseline"])
    paired = statistics.median(a / b for a, b in zip(rates["this checkout"], rates["baseline"]))
    cost_us = 1e6 * 32 * (1 / mine - 1 / theirs)
    print(f"digits CNN, minibatch 32, {args.samples} samples x {args.rounds} alternating rounds, {args.threads} "
          f"thread(s) each; load average {load:.2f} at the start, {os.getloadavg()[0]:.2f} at the end")
    print(f"{'baseline /s':>12} {'this /s':>10} {'baseline/this':>14} {'per round':>10} {'µs/step more':>13}")
    print(f"{theirs:>12,.0f} {mine:>10,.0f} {theirs / mine:>14.4f} {1 / paired:>10.4f} {cost_us:>13.1f}")


if __name__ == "__main__":
    main()
