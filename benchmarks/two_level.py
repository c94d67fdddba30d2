"""The two-level learners (DiLoCo with 4-bit outer deltas; gradients compressed between the host
leaders every step: two_level_quantized, two_level_powersgd) against flat float32 data_parallel and
flat 1-bit quantized on two simulated hosts: bytes between hosts, test quality, compute utilisation.

    sudo python benchmarks/two_level.py                                   # 100mbit, digits
    sudo python benchmarks/two_level.py --rate 100mbit --recipes digits,shakespeare_char
    sudo python benchmarks/two_level.py --learners data_parallel,quantized,two_level_quantized,two_level_powersgd
    sudo python benchmarks/two_level.py --recipes shakespeare_char --full-length --ranks-per-host 1 \
        --learners two_level_diloco --timeout 2400                          # the language model's own length
    sudo python benchmarks/two_level.py --ranks-per-host 1 --learners diloco,sparseloco    # overlapped or not

Needs root (network namespaces; see dtrain/testing/netns.py). A 2-host ``NamespaceCluster`` (``tbf``
at ``--rate`` on each host's egress) runs each recipe under ``mpiexec`` with the cluster's hostfile,
2 ranks per host (hosts from the launcher), Gloo, 1 thread per rank, in the ways of :data:`LEARNERS`.

Per run: ``MB between hosts``: both hosts' ``eth0`` ``sent_bytes`` over the whole run (start-up and the
final test included), and net of the same job stopped after one minibatch (start-up, checkpoint
and test: the fixed cost); the test accuracy (classification) or loss; ``compute %``: the run's
``compute_s`` (forward and backward) over the wall time of its training periods, and ``busy %``:
everything but the exchange (``1 - exchange_s / period_s``), both summed over ``metrics.jsonl``'s
training records.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# checkpoints only at the end: a mid-run checkpoint gathers every rank's optimizer state on rank 0
RECIPES = {
    "digits": ["session.checkpoint.frequency=null"],
    "shakespeare_char": ["session.cv.frequency=0", "session.checkpoint.frequency=null"],
}
#: without --full-length: 81,920 characters, 1.6% of the language model's run (a look at bytes and times)
SHORTENED = {"shakespeare_char": ["session.max_samples=81920", "session.epoch_size=40960"]}
SHORT = {"digits": ("session.max_samples=32",), "shakespeare_char": ("session.max_samples=2048",)}
LEARNERS = {
    "flat data_parallel fp32": ["learner=data_parallel", "comm.hierarchical=false"],
    "two_level_diloco 4-bit": ["learner=two_level_diloco", "learner/exchange=quantized", "learner.exchange.num_bits=4"],
    "two_level_diloco 4-bit, block 4096": ["learner=two_level_diloco", "learner/exchange=quantized",
                                           "learner.exchange.num_bits=4", "learner.block_size=4096"],
    "two_level_diloco 4-bit, block 4096, inner SGD": ["learner=two_level_diloco", "learner/exchange=quantized",
                                                      "learner.exchange.num_bits=4", "learner.block_size=4096",
                                                      "optimizer=sgd"],
    "flat quantized 1-bit": ["learner=quantized", "comm.hierarchical=false"],
    "flat quantized 1-bit, local warm start": ["learner=quantized", "comm.hierarchical=false",
                                               "learner.warm_start_mode=local"],
    "two_level_quantized 1-bit": ["learner=two_level_quantized"],
    "two_level_quantized 1-bit, local warm start": ["learner=two_level_quantized", "learner.warm_start_mode=local"],
    "two_level_powersgd": ["learner=two_level_powersgd"],
    # one-level block learners, one model per rank (--ranks-per-host 1: one per host), with and without the overlapped
    # outer step (learner.overlap: each block's exchange runs while the next block trains)
    "flat diloco fp32": ["learner=diloco", "comm.hierarchical=false"],
    "flat diloco fp32, overlap": ["learner=diloco", "comm.hierarchical=false", "learner.overlap=true"],
    "flat sparseloco": ["learner=sparseloco", "comm.hierarchical=false"],
    "flat sparseloco, overlap": ["learner=sparseloco", "comm.hierarchical=false", "learner.overlap=true"],
}


#: rows whose settings are sized for one recipe (4,096 samples: 128 of digits' minibatches, 2 of the language model's)
ONLY_FOR = {"two_level_diloco 4-bit, block 4096": "digits", "two_level_diloco 4-bit, block 4096, inner SGD": "digits"}


def chosen(learners: str | None, recipe: str) -> list[str]:
    """The rows of :data:`LEARNERS` for ``recipe`` whose ``learner=NAME`` is in the comma-separated ``learners``
    (all when None); the flat float32 row always runs first: every ratio is against it."""
    names = [name for name in LEARNERS if ONLY_FOR.get(name, recipe) == recipe
             and (learners is None or LEARNERS[name][0].removeprefix("learner=") in learners.split(","))]
    flat = next(iter(LEARNERS))
    return [flat, *(name for name in names if name != flat)]


def median_quality(qualities: list[str]) -> str:
    """``"99.66%"`` or ``"loss 1.2345"`` per seed -> their median with each in brackets."""
    unit = "%" if qualities[0].endswith("%") else ""
    values = [float(quality.removeprefix("loss ").removesuffix("%")) for quality in qualities]
    each = " ".join(f"{value:g}" for value in values)
    return f"{'' if unit else 'loss '}{statistics.median(values):g}{unit} [{each}]"


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def run_one(cluster, recipe: str, name: str, workdir: Path, timeout: float, extra: tuple[str, ...] = (),
            ranks_per_host: int = 2, full_length: bool = False) -> dict:
    run_dir = workdir / f"{recipe}-{len(os.listdir(workdir))}"
    args = [sys.executable, "-m", "dtrain", f"+recipe={recipe}", *LEARNERS[name], "comm.backend=gloo",
            "session.num_threads=1", "session.tensorboard=false", *RECIPES[recipe],
            *(() if full_length else SHORTENED.get(recipe, ())), *extra, f"run_dir={run_dir}"]
    result, wall, sent = cluster.run_counting_traffic(args, ranks_per_host, timeout, env={"PYTHONPATH": str(REPO)})
    if result.returncode != 0:
        raise SystemExit(f"the run failed:\n{result.report()}")
    rows = records(run_dir)
    train = [row for row in rows if row.get("kind") == "train"]
    test = ([row for row in rows if row.get("kind") == "test"] or [row for row in rows if row.get("kind") == "cv"])[-1]
    period = sum(row["period_s"] for row in train)
    return {"recipe": recipe, "learner": name, "between_hosts_mb": sent / 1e6, "wall_s": wall,
            "quality": f"{100 * test['accuracy']:.2f}%" if "accuracy" in test else f"loss {test['loss']:.4f}",
            "compute": sum(row["compute_s"] for row in train) / period,
            "busy": 1 - sum(row["exchange_s"] for row in train) / period,
            "learner_line": next((line for line in result.stdout.splitlines() if "learner " in line), "")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", default="100mbit", help="tc rate per host link")
    parser.add_argument("--recipes", default="digits", help="comma-separated recipes")
    parser.add_argument("--timeout", type=float, default=900, help="seconds allowed per run")
    parser.add_argument("--ranks-per-host", type=int, default=2, choices=(1, 2),
                        help="1: each rank has a core of its own on a 2-core machine, for the compute utilisation")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0],
                        help="seeds of the full runs: the test figure is their median [each]; bytes and times are "
                             "the first seed's")
    parser.add_argument("--learners", default=None,
                        help="comma-separated learner= names to run (default: every row); flat data_parallel always runs")
    parser.add_argument("--full-length", action="store_true",
                        help="the language model at the recipe's own length (5,120,000 characters; default: 81,920)")
    args = parser.parse_args()
    from dtrain.testing.netns import NamespaceCluster, available

    ok, reason = available()
    if not ok:
        raise SystemExit(f"cannot build a namespace cluster: {reason}")
    load_before = os.getloadavg()[0]
    rows = []
    with tempfile.TemporaryDirectory() as workdir, NamespaceCluster(num_hosts=2, rate=args.rate,
                                                                           slots=args.ranks_per_host) as cluster:
        for recipe in args.recipes.split(","):
            for name in chosen(args.learners, recipe):
                runs = [run_one(cluster, recipe, name, Path(workdir), args.timeout, (f"seed={seed}",),
                                args.ranks_per_host, args.full_length) for seed in args.seeds]
                rows.append(runs[0])
                if len(runs) > 1:
                    rows[-1]["quality"] = median_quality([run["quality"] for run in runs])
                # the same job stopped after one minibatch: start-up, checkpoint and test, the fixed cost
                fixed = run_one(cluster, recipe, name, Path(workdir), args.timeout, SHORT[recipe], args.ranks_per_host)
                rows[-1]["net_mb"] = rows[-1]["between_hosts_mb"] - fixed["between_hosts_mb"]
                print(f"  done: {recipe} {name} ({rows[-1]['wall_s']:.0f} s) {rows[-1]['learner_line']}", flush=True)
    print(f"\n=== 2 hosts x {args.ranks_per_host} ranks (network namespaces), tbf {args.rate} per host egress, Gloo, 1 thread per rank; "
          f"1-min load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after ===")
    print("| recipe | learner | MB between hosts | x fewer | net of the fixed cost: MB | x fewer | test | compute % | "
          "busy % (not exchanging) | wall s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        flat = next(r for r in rows if r["recipe"] == row["recipe"] and r["learner"].startswith("flat"))
        print(f"| {row['recipe']} | {row['learner']} | {row['between_hosts_mb']:.2f} | "
              f"{flat['between_hosts_mb'] / row['between_hosts_mb']:.0f} | {row['net_mb']:.2f} | "
              f"{flat['net_mb'] / row['net_mb']:.0f} | {row['quality']} | {100 * row['compute']:.0f} | "
              f"{100 * row['busy']:.0f} | {row['wall_s']:.0f} |")


if __name__ == "__main__":
    main()
