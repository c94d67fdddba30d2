"""Time to accuracy on a 2-host cluster with a shaped link: which learner reaches data_parallel's
final quality first (digits test accuracy, or the language model's validation loss), at 1 Gbit/s
and at 100 Mbit/s.

    sudo python benchmarks/time_to_accuracy.py                        # 1gbit and 100mbit, every learner
    sudo python benchmarks/time_to_accuracy.py --rate 100mbit --learners data_parallel,powersgd,ddp_powersgd
    sudo python benchmarks/time_to_accuracy.py --recipe shakespeare_char --rate 100mbit   # validation loss + 0.03

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
``--recipe shakespeare_char`` trains the language model at its full length instead, evaluating the
whole held-out validation text every ``--eval-every`` characters (default: the recipe's epoch,
512,000, so 10 evaluations); its target is data_parallel's final validation loss plus
``--tolerance`` nats (default 0.03), and "reached" means a validation loss at or below it.
``ddp_powersgd`` is the outside reference: torch ``DistributedDataParallel`` with torch's own
``powerSGD_hook`` set up like ``learner=powersgd``'s defaults, the same model, initial weights,
minibatch, optimizer and learning-rate schedule as the recipe (its own shuffling), in a hand-written loop (this script's ``--ddp-worker``), evaluated at the same
points.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from _run_records import megabytes_sent, run_records

REPO = Path(__file__).resolve().parents[1]
DTRAIN_LEARNERS = ("data_parallel", "quantized", "powersgd", "block_momentum", "diloco")
REFERENCE = "ddp_powersgd"
#: names beyond the presets: a learner with one of its settings, as its overrides
VARIANTS = {"diloco_overlap": ["learner=diloco", "learner.overlap=true"],
            "sparseloco_overlap": ["learner=sparseloco", "learner.overlap=true"]}


@dataclass(frozen=True)
class Recipe:
    """What a recipe's figure is and how a run of it is evaluated along the way."""
    name: str
    figure: str  # the metrics record's value compared with the target ("accuracy" is 1 - "error")
    higher_is_better: bool
    eval_every: int  # samples between evaluations
    tolerance: float  # in the figure's unit (accuracy: a fraction)
    unit: str  # the tolerance's, as printed and given on the command line (accuracy: points)
    cv_overrides: tuple[str, ...]  # the evaluation along the way


RECIPES = {
    "digits": Recipe("digits", "accuracy", True, 1500, 0.005, "point",
                     ("source.cv=${source.test}",)),  # the test set, so the test accuracy is known along the way
    # the recipe's cv source is the held-out validation text the test pass reads: read it whole each time
    "shakespeare_char": Recipe("shakespeare_char", "loss", False, 512000, 0.03, "nats", ("session.cv.max_samples=null",)),
}


# -- the outside reference: torch DDP with torch's PowerSGD hook -------------------------------------
DIGITS_AUTO_RANK = 4
"""The rank ``learner=powersgd`` chooses on digits (``dtrain: PowerSGD rank auto: 4, ...``), given to torch's hook."""

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
    # torch's hook takes a number: the rank learner=powersgd's "auto" chooses on digits (its run prints it)
    rank = DIGITS_AUTO_RANK if settings.rank_is_auto else settings.matrix_approximation_rank
    state = powersgd.PowerSGDState(
        process_group=None, matrix_approximation_rank=rank,
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
def dtrain_command(learner: str, run_dir: Path, eval_every: int, recipe: Recipe = RECIPES["digits"],
                   samples: int | None = None) -> list[str]:
    """The user's command for ``learner`` with its defaults, plus the evaluation along the way."""
    length = [f"session.max_samples={samples}"] if samples else []
    return [sys.executable, "-m", "dtrain", f"+recipe={recipe.name}", *VARIANTS.get(learner, [f"learner={learner}"]),
            f"run_dir={run_dir}",
            *recipe.cv_overrides, f"session.cv.frequency={eval_every}", f"session.progress_frequency={eval_every}",
            "session.checkpoint.frequency=0", "session.num_threads=1", "session.tensorboard=false", *length]


def figure_of(record: dict, recipe: Recipe) -> float:
    return 1.0 - record["error"] if recipe.figure == "accuracy" else record[recipe.figure]


def read_dtrain_run(run_dir: Path, recipe: Recipe = RECIPES["digits"]) -> dict:
    """Start time, evaluations (samples, time, figure) and the final test figure from a run's metrics.jsonl."""
    records = run_records(run_dir)
    train = [record for record in records if record["kind"] == "train"]
    start = train[0]["time"] - train[0]["period_s"]
    evaluations = [(record["samples"], record["time"] - start, figure_of(record, recipe))
                   for record in records if record["kind"] == "cv"]
    test = [record for record in records if record["kind"] == "test"]
    bytes_per_step = [record.get("bytes_sent_per_step") for record in train if record.get("bytes_sent_per_step")]
    return {"evaluations": evaluations, "final": figure_of(test[-1], recipe) if test else evaluations[-1][2],
            "train_s": train[-1]["time"] - start, "bytes_per_step": bytes_per_step[-1] if bytes_per_step else None}


def read_reference_run(path: Path) -> dict:
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    start = records[0]["start"]
    evaluations = [(record["samples"], record["time"] - start, 1.0 - record["error"]) for record in records]
    return {"evaluations": evaluations, "final": evaluations[-1][2], "train_s": evaluations[-1][1], "bytes_per_step": None}


def time_to(target: float, evaluations: list[tuple[int, float, float]],
            higher_is_better: bool = True) -> tuple[float, int] | None:
    """(seconds, samples) of the first evaluation at or beyond ``target``; None if never."""
    for samples, seconds, value in evaluations:
        if (value >= target - 1e-9) if higher_is_better else (value <= target + 1e-9):
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
                    command = dtrain_command(learner, run_dir, args.eval_every, args.recipe, args.samples)
                began = time.monotonic()
                result = cluster.run(launcher + command, timeout=args.timeout, env=env)
                if result.returncode != 0:
                    print(f"  {learner}: failed (exit {result.returncode}); its output:\n{result.report()}", flush=True)
                    continue
                results[learner] = read_reference_run(out) if learner == REFERENCE else read_dtrain_run(run_dir, args.recipe)
                results[learner]["wall_s"] = time.monotonic() - began
                results[learner]["mb_sent"] = None if learner == REFERENCE else megabytes_sent(result.stdout)
                evaluations = " ".join(f"{samples}:{seconds:.0f}s:{value:.4f}"
                                       for samples, seconds, value in results[learner]["evaluations"])
                print(f"  {rate} {learner}: final {args.recipe.figure} {results[learner]['final']:.4f}, "
                      f"{results[learner]['train_s']:.1f} s of training; evaluations (samples:time:figure) "
                      f"{evaluations}", flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return results


def scale(recipe: Recipe) -> float:
    """The tolerance's command-line unit per figure unit (points per accuracy fraction)."""
    return 100.0 if recipe.figure == "accuracy" else 1.0


def print_table(rate: str, results: dict[str, dict], recipe: Recipe, tolerance: float,
                target: float | None = None) -> None:
    """The table at one rate; the target is data_parallel's final figure within ``tolerance``, or ``target``
    (an earlier run's, in the figure's units) when given, with no data_parallel row to compare times."""
    shown = (lambda value: f"{value:.2%}") if recipe.figure == "accuracy" else (lambda value: f"{value:.4f}")
    baseline = results.get("data_parallel")
    if target is not None:
        reference_time = None
        print(f"\n=== {rate}: target {recipe.figure} {shown(target)} (--target: an earlier data_parallel run's) ===")
    elif baseline is None:
        print(f"\n{rate}: data_parallel did not finish, so there is no target")
        return
    else:
        better = 1 if recipe.higher_is_better else -1
        target = baseline["final"] - better * tolerance
        reference_time = time_to(target, baseline["evaluations"], recipe.higher_is_better)
        print(f"\n=== {rate}: target = data_parallel's final {recipe.figure} {shown(baseline['final'])} "
              f"{'-' if recipe.higher_is_better else '+'} {tolerance * scale(recipe):g} {recipe.unit} = "
              f"{shown(target)} ===")
    print(f"{'learner':<16}{'final ' + recipe.figure:>15}{'time to target (s)':>20}{'samples':>10}{'vs data_parallel':>18}"
          f"{'train (s)':>11}{'kB sent/step':>14}{'MB sent':>10}")
    for learner, row in results.items():
        reached = time_to(target, row["evaluations"], recipe.higher_is_better)
        seconds = f"{reached[0]:.1f}" if reached else "not reached"
        samples = f"{reached[1]}" if reached else "-"
        ratio = f"{reached[0] / reference_time[0]:.2f}x" if reached and reference_time else "-"
        per_step = f"{row['bytes_per_step'] / 1e3:,.1f}" if row.get("bytes_per_step") else "-"
        sent = f"{row['mb_sent']:,.1f}" if row.get("mb_sent") is not None else "-"
        print(f"{learner:<16}{shown(row['final']):>15}{seconds:>20}{samples:>10}{ratio:>18}{row['train_s']:>11.1f}"
              f"{per_step:>14}{sent:>10}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", action="append", help="tc rate per host link, repeatable (default: 1gbit and 100mbit)")
    parser.add_argument("--recipe", choices=sorted(RECIPES), default="digits")
    parser.add_argument("--learners", default=None,
                        help="comma-separated learner= names, or diloco_overlap, sparseloco_overlap (the preset with "
                             "learner.overlap=true); data_parallel sets the target (default: every dtrain learner, and "
                             f"{REFERENCE} on digits)")
    parser.add_argument("--eval-every", type=int, default=None,
                        help="samples between evaluations (default: digits 1,500, a sweep; shakespeare_char 512,000)")
    parser.add_argument("--samples", type=int, default=None,
                        help="global samples per dtrain run (default: the recipe's own; a quick look, not the figure)")
    parser.add_argument("--tolerance", type=float, default=None,
                        help="distance from data_parallel's final figure (default: digits 0.5 point, "
                             "shakespeare_char 0.03 nats)")
    parser.add_argument("--target", type=float, default=None,
                        help="the figure to reach, from an earlier data_parallel run at this rate (digits: accuracy "
                             "in %%; shakespeare_char: validation loss); data_parallel is then not run")
    parser.add_argument("--timeout", type=float, default=900, help="seconds allowed per run")
    parser.add_argument("--ddp-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.ddp_worker:
        ddp_worker(args)
        return
    args.recipe = RECIPES[args.recipe]
    args.eval_every = args.eval_every or args.recipe.eval_every
    tolerance = args.recipe.tolerance if args.tolerance is None else args.tolerance / scale(args.recipe)
    default_learners = (*DTRAIN_LEARNERS, REFERENCE) if args.recipe.name == "digits" else DTRAIN_LEARNERS
    args.learners = [name for name in (args.learners or ",".join(default_learners)).split(",") if name]
    if REFERENCE in args.learners and (args.recipe.name != "digits" or args.samples):
        parser.error(f"{REFERENCE} trains the digits recipe at its own length only")
    if "data_parallel" in args.learners:
        args.learners.remove("data_parallel")
    if args.target is None:
        args.learners.insert(0, "data_parallel")
    elif not args.learners:
        parser.error("--target without --learners: name the learners to time against it")
    for rate in args.rate or ["1gbit", "100mbit"]:
        load = os.getloadavg()[0]
        results = run_rate(rate, args)
        print(f"(1-min load average {load:.1f} before the runs at {rate}; 2 of it is ours)")
        target = None if args.target is None else args.target / scale(args.recipe)
        print_table(rate, results, args.recipe, tolerance, target)


if __name__ == "__main__":
    main()
