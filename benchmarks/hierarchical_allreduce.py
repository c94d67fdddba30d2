"""Flat vs hierarchical all-reduce for data_parallel on two simulated hosts: time per step, bytes between hosts.

    sudo python benchmarks/hierarchical_allreduce.py                      # 1gbit and 100mbit, digits + shakespeare_char
    sudo python benchmarks/hierarchical_allreduce.py --rate 1gbit --recipes digits

Needs root (network namespaces; see dtrain/testing/netns.py). For each ``--rate`` a 2-host
``NamespaceCluster`` is built (one veth per host, ``tbf`` at that rate on each host's egress) and
``python -m dtrain +recipe=R learner=data_parallel`` runs on it under ``mpiexec`` with the cluster's
hostfile, three ways: 2 hosts x 2 ranks with ``comm.hierarchical=false`` and ``true``, and 2 hosts x
1 rank (for reference: there the hierarchical all-reduce is the flat one). Hosts come from the
launcher, as in a real job. Every rank uses 1 thread and Gloo (``comm.backend=gloo``).

Per run the table gives:

* ``s/step``: the global minibatch over the ``samples/s`` of the run's last progress period
  (``metrics.jsonl``; the first period, with the start-up's warm-up, is left out), slowest rank's clock;
* ``exchange ms``: the step's time in the gradient exchange (the same record's ``exchange_s`` per step);
* ``MB between hosts/step``: what both hosts' ``eth0`` sent during the whole run (the kernel's
  ``sent_bytes``, headers included) over the run's steps: an upper bound on the steps' own traffic
  (the start-up's parameter broadcast, heartbeats and the final test are in it, the same in both
  modes), next to the model's figure: flat ring over 4 ranks on 2 hosts of consecutive ranks,
  ``2 x 2(N-1)/N x n`` for both hosts, hierarchical ``2 x 2(H-1)/H x n`` (n: gradient bytes).

The machine is shared: the load average before and after each rate is printed; compare the two modes
within a rate, where they ran one after the other.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

RECIPES = {
    # recipe -> overrides that shorten it to a few dozen steps (progress every half run: the last half is timed)
    "digits": ["session.max_samples=3200", "session.progress_frequency=1600"],
    "shakespeare_char": ["session.max_samples=81920", "session.epoch_size=40960", "session.cv.frequency=0"],
}
LAYOUTS = [(2, "false"), (2, "true"), (1, "false")]  # (ranks per host, comm.hierarchical)


def last_period(run_dir: Path) -> dict:
    """The last training record of the run's ``metrics.jsonl``."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [record for record in records if record.get("kind") == "train"][-1]


def gradient_bytes(run_dir: Path) -> int:
    """Float32 bytes of the trained model's parameters (what one all-reduce sums)."""
    from safetensors import safe_open

    with safe_open(str(run_dir / "model.safetensors"), "pt") as weights:
        return sum(_numel(weights.get_slice(name).get_shape()) for name in weights.keys()) * 4


def _numel(shape: list[int]) -> int:
    total = 1
    for size in shape:
        total *= size
    return total


def run_one(cluster, recipe: str, per_host: int, hierarchical: str, workdir: Path, timeout: float) -> dict:
    """One training run on the cluster; its step time and bytes between hosts."""
    from omegaconf import OmegaConf

    run_dir = workdir / f"{recipe}-{per_host}-{hierarchical}"
    args = [sys.executable, "-m", "dtrain", f"+recipe={recipe}", "learner=data_parallel", "comm.backend=gloo",
            f"comm.hierarchical={hierarchical}", "session.num_threads=1", "session.tensorboard=false",
            *RECIPES[recipe], f"run_dir={run_dir}"]
    result, wall, sent = cluster.run_counting_traffic(args, per_host, timeout, env={"PYTHONPATH": str(REPO)})
    if result.returncode != 0:
        raise SystemExit(f"the run failed:\n{result.report()}")
    config = OmegaConf.load(run_dir / "config.yaml")
    minibatch, samples = config.session.minibatch_size, config.session.max_samples
    period = last_period(run_dir)
    steps_in_period = period["period_s"] * period["samples_per_second"] / minibatch
    return {"recipe": recipe, "layout": f"2x{per_host}", "hierarchical": hierarchical,
            "step_s": minibatch / period["samples_per_second"],
            "exchange_ms": 1e3 * period["exchange_s"] / steps_in_period,
            "between_hosts_per_step": sent / (samples / minibatch), "wall_s": wall,
            "gradient_bytes": gradient_bytes(run_dir), "chosen": [line for line in result.stdout.splitlines()
                                                                 if "all-reduce" in line and line.startswith("dtrain:")]}


def model_between_hosts(row: dict) -> float:
    """Bytes both hosts send per step by the model (ring over ranks in order; leaders' ring)."""
    n = row["gradient_bytes"]
    if row["layout"] == "2x2" and row["hierarchical"] == "true":
        return 2 * n  # each leader: 2(H-1)/H * n with H = 2
    ranks = 4 if row["layout"] == "2x2" else 2
    return 2 * 2 * (ranks - 1) / ranks * n  # two ring edges cross the hosts, each 2(N-1)/N * n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", action="append", help="tc rate per host link, repeatable (default 1gbit, 100mbit)")
    parser.add_argument("--recipes", default="digits,shakespeare_char", help="comma-separated recipes")
    parser.add_argument("--timeout", type=float, default=300, help="seconds allowed per run")
    args = parser.parse_args()
    from dtrain.testing.netns import NamespaceCluster, available

    ok, reason = available()
    if not ok:
        raise SystemExit(f"cannot build a namespace cluster: {reason}")
    for rate in args.rate or ["1gbit", "100mbit"]:
        load_before = os.getloadavg()[0]
        rows = []
        with tempfile.TemporaryDirectory() as workdir, NamespaceCluster(num_hosts=2, rate=rate, slots=2) as cluster:
            for recipe in args.recipes.split(","):
                for per_host, hierarchical in LAYOUTS:
                    rows.append(run_one(cluster, recipe, per_host, hierarchical, Path(workdir), args.timeout))
                    print(f"  done: {recipe} 2x{per_host} hierarchical={hierarchical} "
                          f"({rows[-1]['wall_s']:.0f} s; {' / '.join(rows[-1]['chosen']) or 'no start-up line'})",
                          flush=True)
        print(f"\n=== 2 hosts (network namespaces), tbf {rate} per host egress, Gloo, 1 thread per rank; 1-min load "
              f"average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after (2-core machine, shared) ===")
        print(f"{'recipe':<17} {'hosts x ranks':>13} {'hierarchical':>12} {'s/step':>8} {'exchange ms':>11} "
              f"{'MB between hosts/step':>21} {'model MB':>9} {'gradient MB':>11}")
        for row in rows:
            print(f"{row['recipe']:<17} {row['layout']:>13} {row['hierarchical']:>12} {row['step_s']:8.3f} "
                  f"{row['exchange_ms']:11.1f} {row['between_hosts_per_step'] / 1e6:21.3f} "
                  f"{model_between_hosts(row) / 1e6:9.3f} {row['gradient_bytes'] / 1e6:11.3f}")
        for recipe in args.recipes.split(","):
            flat, hier = (next(r for r in rows if r["recipe"] == recipe and r["layout"] == "2x2"
                               and r["hierarchical"] == mode) for mode in ("false", "true"))
            print(f"{recipe} at {rate}, 2x2: hierarchical / flat step time {hier['step_s'] / flat['step_s']:.2f}, "
                  f"bytes between hosts {hier['between_hosts_per_step'] / flat['between_hosts_per_step']:.2f}")


if __name__ == "__main__":
    main()
