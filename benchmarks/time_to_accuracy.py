"""Time to accuracy on a 2-host cluster with a shaped link: which learner reaches data_parallel's
digits test accuracy first, at 1 Gbit/s and at 100 Mbit/s.

    sudo python benchmarks/time_to_accuracy.py                        # 1gbit and 100mbit, every learner
    sudo python benchmarks/time_to_accuracy.py --rate 100mbit --learners data_parallel,powersgd,ddp_powersgd

Needs root (network namespaces; see ``dtrain/testing/netns.py``). For each ``--rate`` a 2-host
``NamespaceCluster`` is built (one rank and one thread per host, ``tbf`` at that rate on each
host's egress) and every learner trains the digits recipe with ITS DEFAULTS, exactly as
``mpiexec -n 2 python -m dtrain +recipe=digits learner=NAME`` would, with one addition: the
test set is also the cross-validation set, evaluated every ``--eval-every`` samples, so the
test accuracy is known along the way (block learners synchronize at each evaluation, as they
do before any evaluation).

The target is data_parallel's final test accuracy at that rate minus ``--tolerance`` points;
a learner's time to accuracy is the wall time from the start of training (the first progress
period's start, from ``metrics.jsonl``) to the first evaluation at or above the target.
``ddp_powersgd`` is the outside reference: torch ``DistributedDataParallel`` with torch's own
``powerSGD_hook`` set up like ``learner=powersgd``'s defaults, the same model, initial weights,
minibatch, optimizer and learning-rate schedule as the recipe (its own shuffling), in a hand-written loop (this script's ``--ddp-worker``), evaluated at the same
points.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DTRAIN_LEARNERS = ("data_parallel", "quantized", "powersgd", "block_momentum", "diloco")
REFERENCE = "ddp_powersgd"


# -- the outside reference: torch DDP with torch's PowerSGD hook -------------------------------------
def ddp_worker(args: argparse.Namespace) -> None:
    """Trains the digits recipe with torch DDP + ``powerSGD_hook``; rank 0 writes a metrics.jsonl."""
    import torch
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

    from omegaconf import OmegaConf

    from dtrain import Schedule
    from dtrain.comm import create_communicator
    from dtrain.config import register_schemas
    from dtrain.learners.base import RunFacts

    torch.set_num_threads(1)
    comm = create_communicator(backend="gloo", timeout_s=600)  # initialises torch.distributed too
    register_schemas()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        cfg = compose("config", overrides=["+recipe=digits", "learner=powersgd"])
    torch.manual_seed(cfg.seed)
    model = instantiate(cfg.model)
    optimizer = instantiate(cfg.optimizer)(model.parameters())
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    settings = instantiate(cfg.learner.exchange)  # learner=powersgd's own strategy, for its settings
    settings.plan(RunFacts(max_samples=cfg.session.max_samples, minibatch_size=cfg.session.minibatch_size))
    state = powersgd.PowerSGDState(
        process_group=None, matrix_approximation_rank=settings.matrix_approximation_rank,
        start_powerSGD_iter=settings.start_powersgd_iter, min_compression_rate=settings.min_compression_rate,
        use_error_feedback=settings.use_error_feedback, warm_start=settings.warm_start,
        orthogonalization_epsilon=settings.orthogonalization_epsilon, random_seed=settings.random_seed)
    ddp.register_comm_hook(state, powersgd.powerSGD_hook)
    train = instantiate(cfg.source.train.deserializer)
    test = instantiate(cfg.source.test.deserializer)
    features, labels = _arrays(train)
    test_features, test_labels = _arrays(test)
    torch.manual_seed(cfg.seed + 1 + comm.rank)
    minibatch, max_samples = cfg.session.minibatch_size, cfg.session.max_samples
    sweep = features.shape[0]
    node = cfg.session.lr_schedule  # the recipe's multipliers of optimizer.lr, as the session applies them
    schedule = Schedule(OmegaConf.to_container(node["values"], resolve=True), node.epoch_size, node.warmup_samples)
    base_lr = cfg.optimizer.lr
    generator = torch.Generator().manual_seed(cfg.seed)
    records, samples, next_eval = [], 0, args.eval_every
    comm.barrier()
    started = time.time()
    order = torch.randperm(sweep, generator=generator)
    position = 0
    while samples < max_samples:
        if position + minibatch > sweep:
            order, position = torch.randperm(sweep, generator=generator), 0
        size = min(minibatch, max_samples - samples)  # the last minibatch stops at max_samples, as the session's
        batch = order[position:position + size]
        position += size
        share = batch[comm.rank::comm.size]
        for group in optimizer.param_groups:
            group["lr"] = base_lr * schedule(samples)
        optimizer.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(ddp(features[share]), labels[share])
        loss.backward()
        optimizer.step()
        samples += size
        if samples >= next_eval or samples >= max_samples:
            next_eval += args.eval_every
            with torch.no_grad():
                model.eval()
                error = (model(test_features).argmax(1) != test_labels).float().mean().item()
                model.train()
            records.append({"kind": "cv", "samples": samples, "time": time.time(), "error": error})
    if comm.is_main:
        Path(args.out).write_text("".join(json.dumps({"start": started, **record}) + "\n" for record in records))
    comm.finalize()


def _arrays(deserializer):
    """All samples of a dtrain deserializer as (features, labels) tensors."""
    import numpy as np

    return deserializer.get(np.arange(deserializer.num_samples))


# -- driver ---------------------------------------------------------------------------------------
def dtrain_command(learner: str, run_dir: Path, eval_every: int) -> list[str]:
    """The user's command for ``learner`` with its defaults, plus the evaluation along the way."""
    return [sys.executable, "-m", "dtrain", "+recipe=digits", f"learner={learner}", f"run_dir={run_dir}",
            "source.cv=${source.test}", f"session.cv.frequency={eval_every}", f"session.progress_frequency={eval_every}",
            "session.checkpoint.frequency=0", "session.num_threads=1"]


def read_dtrain_run(run_dir: Path) -> dict:
    """Start time, evaluations (samples, time, accuracy) and final test accuracy from a run's metrics.jsonl."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = [record for record in records if record["kind"] == "train"]
    start = train[0]["time"] - train[0]["period_s"]
    evaluations = [(record["samples"], record["time"] - start, 1.0 - record["error"])
                   for record in records if record["kind"] == "cv"]
    test = [record for record in records if record["kind"] == "test"]
    bytes_per_step = [record.get("bytes_sent_per_step") for record in train if record.get("bytes_sent_per_step")]
    return {"evaluations": evaluations, "final": test[-1]["accuracy"] if test else evaluations[-1][2],
            "train_s": train[-1]["time"] - start, "bytes_per_step": bytes_per_step[-1] if bytes_per_step else None}


def read_reference_run(path: Path) -> dict:
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    start = records[0]["start"]
    evaluations = [(record["samples"], record["time"] - start, 1.0 - record["error"]) for record in records]
    return {"evaluations": evaluations, "final": evaluations[-1][2], "train_s": evaluations[-1][1], "bytes_per_step": None}


def time_to(target: float, evaluations: list[tuple[int, float, float]]) -> tuple[float, int] | None:
    """(seconds, samples) of the first evaluation at or above ``target``; None if never."""
    for samples, seconds, accuracy in evaluations:
        if accuracy >= target - 1e-9:
            return seconds, samples
    return None


def run_rate(rate: str, args: argparse.Namespace) -> dict[str, dict]:
    from dtrain.testing.netns import NamespaceCluster

    env = {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    results: dict[str, dict] = {}
    workdir = Path(tempfile.mkdtemp(prefix="tta-"))
    os.chmod(workdir, 0o777)
    try:
        with NamespaceCluster(num_hosts=2, rate=rate) as cluster:
            launcher = cluster.mpiexec_args(npernode=1, export=list(env))
            for learner in args.learners:
                run_dir = workdir / f"{rate}-{learner}"
                if learner == REFERENCE:
                    out = workdir / f"{rate}-{learner}.jsonl"
                    command = [sys.executable, str(Path(__file__).resolve()), "--ddp-worker", "--out", str(out),
                               "--eval-every", str(args.eval_every)]
                else:
                    command = dtrain_command(learner, run_dir, args.eval_every)
                began = time.monotonic()
                result = cluster.run(launcher + command, timeout=args.timeout, env=env)
                if result.returncode != 0:
                    print(f"  {learner}: failed (exit {result.returncode}); its output:\n{result.report()}", flush=True)
                    continue
                results[learner] = read_reference_run(out) if learner == REFERENCE else read_dtrain_run(run_dir)
                results[learner]["wall_s"] = time.monotonic() - began
                print(f"  {rate} {learner}: final test accuracy {results[learner]['final']:.2%}, "
                      f"{results[learner]['train_s']:.1f} s of training", flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return results


def print_table(rate: str, results: dict[str, dict], tolerance: float) -> None:
    baseline = results.get("data_parallel")
    if baseline is None:
        print(f"\n{rate}: data_parallel did not finish, so there is no target")
        return
    target = baseline["final"] - tolerance / 100
    reference_time = time_to(target, baseline["evaluations"])
    print(f"\n=== {rate}: target = data_parallel's final test accuracy {baseline['final']:.2%} - {tolerance} point "
          f"= {target:.2%} ===")
    print(f"{'learner':<16}{'final acc':>10}{'time to target (s)':>20}{'samples':>9}{'vs data_parallel':>18}"
          f"{'train (s)':>11}{'kB sent/step':>14}")
    for learner, row in results.items():
        reached = time_to(target, row["evaluations"])
        seconds = f"{reached[0]:.1f}" if reached else "not reached"
        samples = f"{reached[1]}" if reached else "-"
        ratio = f"{reached[0] / reference_time[0]:.2f}x" if reached and reference_time else "-"
        sent = f"{row['bytes_per_step'] / 1e3:,.1f}" if row.get("bytes_per_step") else "-"
        print(f"{learner:<16}{row['final']:>10.2%}{seconds:>20}{samples:>9}{ratio:>18}{row['train_s']:>11.1f}{sent:>14}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", action="append", help="tc rate per host link, repeatable (default: 1gbit and 100mbit)")
    parser.add_argument("--learners", default=",".join((*DTRAIN_LEARNERS, REFERENCE)),
                        help="comma-separated; data_parallel sets the target")
    parser.add_argument("--eval-every", type=int, default=1500, help="samples between test evaluations (one sweep)")
    parser.add_argument("--tolerance", type=float, default=0.5, help="points below data_parallel's accuracy")
    parser.add_argument("--timeout", type=float, default=900, help="seconds allowed per run")
    parser.add_argument("--ddp-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.ddp_worker:
        ddp_worker(args)
        return
    args.learners = [name for name in args.learners.split(",") if name]
    if "data_parallel" in args.learners:
        args.learners.remove("data_parallel")
    args.learners.insert(0, "data_parallel")
    for rate in args.rate or ["1gbit", "100mbit"]:
        load = os.getloadavg()[0]
        results = run_rate(rate, args)
        print(f"(1-min load average {load:.1f} before the runs at {rate}; 2 of it is ours)")
        print_table(rate, results, args.tolerance)


if __name__ == "__main__":
    main()
