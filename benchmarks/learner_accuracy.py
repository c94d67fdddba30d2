"""Test accuracy of every learner with its DEFAULTS, and what each default buys, under mpiexec.

    python benchmarks/learner_accuracy.py                          # the table in benchmarks/README.md: 2 and 4 ranks, seeds 0 1 2
    python benchmarks/learner_accuracy.py --ranks 2 --seeds 0 --only data_parallel quantized
    python benchmarks/learner_accuracy.py --recipe shakespeare_char --only defaults   # validation loss, nats/char
    python benchmarks/learner_accuracy.py --recipe cmudict_g2p --only defaults        # word error rate %
    python benchmarks/learner_accuracy.py --recipe conv1d_adam --ranks 2 --only defaults  # Adam inner steps
    python benchmarks/learner_accuracy.py --recipe conv1d10_adam --ranks 2 --only "quantized (1-bit)"  # 10 classes
    python benchmarks/learner_accuracy.py --recipe conv1d10_adam --only defaults --set optimizer=adamw model=gru1d
    python benchmarks/learner_accuracy.py --ranks 8 --only diloco --row "diloco, block 1120: learner=diloco learner.block_size=1120"

Every row trains the `digits` recipe (30,000 samples = 20 sweeps) with the same global minibatch,
learning-rate schedule and number of samples; only the learner (and the one setting named in
the row) differs. The "defaults" rows give nothing but `learner=<name>`: the warm start
(`distributed_after: auto`) and block size (`block_size: auto`) are derived by the learner from
the run (docs/semantics.md#warm-start). The other rows switch one default off to show what it
buys. Each cell is the MEDIAN test accuracy over the seeds (297 test images: one image is 0.34
point), with the gap to data_parallel's median at the same number of ranks; a run that ends with
"training collapsed" or "training diverged" is counted as such, never as an accuracy.

``--recipe shakespeare_char`` and ``--recipe cmudict_g2p`` run the sequence recipes with their own
defaults (``--samples`` default: the recipe's ``session.max_samples``): the figure is the test pass's
validation loss in nats per character (lower is better) or its word error rate in % (lower is
better), and the gap is to data_parallel's median in those units.

The figures are read from each run's ``metrics.jsonl`` (its test record). Each cell also gives the
megabytes rank 0 sent to the other ranks over the run (the summary's ``exchange:`` line, the one
place that total is written; median over the seeds) and the median wall time of a run.
"""
from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _mpiexec import mpi_environment, mpiexec_command
from _run_records import last_record, megabytes_sent, run_records, value

CONFIGS = {
    "data_parallel": ["learner=data_parallel"],
    "quantized (1-bit)": ["learner=quantized"],
    "block_momentum": ["learner=block_momentum"],
    "powersgd": ["learner=powersgd"],
    "data_parallel, bf16 exchange": ["learner=data_parallel", "learner/exchange=bf16"],
    "data_parallel, fp16 exchange": ["learner=data_parallel", "learner/exchange=fp16"],
    "powersgd rank 1": ["learner=powersgd", "learner.exchange.matrix_approximation_rank=1"],
    "powersgd, no all-reduce start": ["learner=powersgd", "learner.exchange.start_powersgd_iter=0"],
    "quantized, 2-bit": ["learner=quantized", "learner.exchange.num_bits=2"],
    "1-bit, no warm start": ["learner=quantized", "learner.distributed_after=0"],
    "1-bit, no error feedback": ["learner=quantized", "learner.exchange.error_feedback=false"],
    "block_momentum, no warm start": ["learner=block_momentum", "learner.distributed_after=0"],
    "block_momentum, block 4096": ["learner=block_momentum", "learner.block_size=4096"],
    "diloco": ["learner=diloco"],
    "block_momentum, 4-bit outer": ["learner=block_momentum", "learner/exchange=quantized", "learner.exchange.num_bits=4"],
    "block_momentum, 8-bit outer": ["learner=block_momentum", "learner/exchange=quantized", "learner.exchange.num_bits=8"],
    "diloco, 4-bit outer": ["learner=diloco", "learner/exchange=quantized", "learner.exchange.num_bits=4"],
    "sparseloco": ["learner=sparseloco"],
    "diloco, adam outer": ["learner=diloco", "learner/outer_optimizer=adam"],
    # the overlapped outer step: each block's exchange runs while the next block trains, its step one block late
    "diloco, overlap": ["learner=diloco", "learner.overlap=true"],
    "sparseloco, overlap": ["learner=sparseloco", "learner.overlap=true"],
    "block_momentum, overlap": ["learner=block_momentum", "learner.overlap=true"],
    # 4 ranks as 2 "hosts" of 2 (exact inside, DiLoCo between the leaders); MB sent: rank 0's, between hosts
    "two_level_diloco 2 hosts, 4-bit outer": ["learner=two_level_diloco", "comm.ranks_per_host=2",
                                              "learner/exchange=quantized", "learner.exchange.num_bits=4"],
    "block_momentum, local lr share": ["learner=block_momentum", "learner.local_learning_rate=share"],
    "block_momentum, no momentum reset": ["learner=block_momentum", "learner.reset_sgd_momentum_after_aggregation=false"],
    "quantized, variance not frozen": ["learner=quantized", "learner.freeze_variance=false"],
    "powersgd rank 8": ["learner=powersgd", "learner.exchange.matrix_approximation_rank=8"],
    "powersgd rank 16": ["learner=powersgd", "learner.exchange.matrix_approximation_rank=16"],
    "powersgd, variance frozen": ["learner=powersgd", "learner.freeze_variance=true"],
}
DEFAULTS = ["data_parallel", "quantized (1-bit)", "block_momentum", "powersgd", "diloco"]
#: the sequence recipes' default rows also hold the block learners with 4-bit outer exchange
SEQUENCE_DEFAULTS = [*DEFAULTS, "block_momentum, 4-bit outer", "diloco, 4-bit outer"]


#: recipe -> (what the figure is, its key in the test record of metrics.jsonl, scale, decimals)
RECIPES = {
    "digits": ("test accuracy %", "accuracy", 100, 2),
    "shakespeare_char": ("validation loss, nats per character", "loss", 1, 3),
    "cmudict_g2p": ("word error rate %", "wer", 100, 2),
    "conv1d_adam": ("test accuracy %", "accuracy", 100, 2),
    "conv1d10_adam": ("test accuracy %", "accuracy", 100, 2),
}
#: how a run whose training collapsed or diverged ends: exit 2 and this one error line (no record says so)
FAILED_TRAINING = re.compile(r"^dtrain: error: training (collapsed|diverged): ", re.MULTILINE)
#: recipes of benchmarks/conf (the 1-D convolutional task with Adam, benchmarks/conv1d_task.py): run from
#: benchmarks/ with --config-dir, on arrays written once to a temporary directory
BENCHMARK_RECIPES = {"conv1d_adam", "conv1d10_adam"}
HERE = Path(__file__).resolve().parent


def run(ranks: int, overrides: list[str], seed: int, samples: int | None,
        recipe: str = "digits", data_root: str | None = None) -> tuple[float | str, float, float | None]:
    """Trains once; returns (the recipe's figure, or 'collapsed'/'diverged', wall seconds, MB rank 0 sent)."""
    length = [f"session.max_samples={samples}"] if samples else []
    own = ["--config-dir", str(HERE / "conf")] if recipe in BENCHMARK_RECIPES else []
    data = [f"data.root={data_root}"] if data_root else []
    with tempfile.TemporaryDirectory() as run_dir:
        command = mpiexec_command(ranks, ["-m", "dtrain", *own, f"+recipe={recipe}", *overrides, f"seed={seed}",
                                          *data, *length, "session.checkpoint.frequency=0",
                                          "session.tensorboard=false", f"run_dir={run_dir}"])
        started = time.perf_counter()
        result = subprocess.run(command, capture_output=True, text=True, env=mpi_environment(OMP_NUM_THREADS="1"),
                                timeout=7200, cwd=HERE if own else None)
        seconds = time.perf_counter() - started
        output = result.stdout + result.stderr
        # what an automatic PowerSGD rank came to, and its re-checks: printed by the run only, echoed whole
        for line in output.splitlines():
            if line.startswith("dtrain: PowerSGD rank auto"):
                print(f"#   {line.removeprefix('dtrain: ')}", flush=True)
        failed = FAILED_TRAINING.search(output)
        if result.returncode != 0 and failed:  # exit 2 from dtrain, mpiexec's own code around it
            return failed.group(1), seconds, None
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(overrides)} failed ({result.returncode}):\n{result.stdout[-2000:]}\n"
                               f"{result.stderr[-2000:]}")
        _, key, scale, _ = RECIPES[recipe]
        figure = value(last_record(run_records(Path(run_dir)), "test"), key, scale)
    return figure, seconds, megabytes_sent(result.stdout) if ranks > 1 else None


def summarize(outcomes: list[float | str], recipe: str = "digits") -> tuple[float | None, str]:
    """(median figure or None, the cell's text: median, the seeds' values, failures)."""
    figures = [outcome for outcome in outcomes if isinstance(outcome, float)]
    failures = [outcome for outcome in outcomes if isinstance(outcome, str)]
    if len(failures) * 2 > len(outcomes) or not figures:
        return None, f"{failures[0]} ({len(failures)}/{len(outcomes)})"
    worst = 0.0 if RECIPES[recipe][0].endswith("accuracy %") else float("inf")  # a failed run counts as the worst
    median = statistics.median(figures + [worst] * len(failures))
    decimals = RECIPES[recipe][3]
    values = " ".join(f"{outcome:.{decimals}f}" if isinstance(outcome, float) else outcome for outcome in outcomes)
    return median, f"{median:.{decimals}f} [{values}]"


def parse_row(row: str) -> tuple[str, list[str]]:
    """``'NAME: learner=diloco learner.block_size=1120'`` -> (NAME, its overrides)."""
    name, separator, overrides = row.partition(":")
    if not separator or not name.strip() or not overrides.split():
        raise SystemExit(f"--row {row!r}: expected 'NAME: OVERRIDE [OVERRIDE ...]', e.g. "
                         f"'diloco, block 1120: learner=diloco learner.block_size=1120'")
    return name.strip(), overrides.split()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--recipe", choices=sorted(RECIPES), default="digits")
    parser.add_argument("--samples", type=int, default=None,
                        help="global samples per run (default: digits 30,000 = 20 sweeps; the sequence recipes' own)")
    parser.add_argument("--only", nargs="*", default=None, help="row names to run (default: all; 'defaults': the "
                                                                 "three default rows)")
    parser.add_argument("--set", nargs="+", default=[], metavar="OVERRIDE",
                        help="overrides for every row, data_parallel's too, e.g. --set optimizer=adamw model=gru1d "
                             "(another optimizer or model, each gap still to data_parallel with the same)")
    parser.add_argument("--row", action="append", default=[], metavar="'NAME: OVERRIDE ...'",
                        help="a row of your own, run after --only's, e.g. 'diloco, block 1120: learner=diloco "
                             "learner.block_size=1120' (repeatable)")
    args = parser.parse_args()
    own_rows = dict(parse_row(row) for row in args.row)
    CONFIGS.update(own_rows)
    names = args.only or ([] if own_rows else list(CONFIGS))
    if names == ["defaults"]:
        names = SEQUENCE_DEFAULTS if args.recipe in ("shakespeare_char", "cmudict_g2p") else DEFAULTS
    names = [*names, *(name for name in own_rows if name not in names)]
    if "data_parallel" not in names:
        names = ["data_parallel", *names]  # the reference every gap is measured against
    if args.recipe == "digits" and args.samples is None:
        args.samples = 30000
    if args.recipe not in BENCHMARK_RECIPES:
        print_table(args, names, None)
        return
    import conv1d_task

    with tempfile.TemporaryDirectory(prefix="conv1d_task_") as data_root:  # removed at the end, or on Ctrl-C
        conv1d_task.write_arrays(Path(data_root), task=args.recipe)
        print_table(args, names, data_root)


def print_table(args, names: list[str], data_root: str | None) -> None:
    """Runs every row at every world size and seed, printing each row as it completes."""
    length = f"{args.samples:,} samples" if args.samples else "the recipe's samples"
    settings = f" with {' '.join(args.set)}" if args.set else ""
    print(f"{args.recipe} recipe{settings}, {length}, median {RECIPES[args.recipe][0]} over seeds {args.seeds} "
          f"[each seed], gap to data_parallel, MB rank 0 sent over the run (median), wall time (median)")
    header = f"| {'learner':<30} |" + "".join(f" {f'{n} ranks':<34} | {'gap':>6} | {'MB sent':>9} | {'time':>6} |"
                                              for n in args.ranks)
    print(header, flush=True)
    print("|" + "---|" * (1 + 4 * len(args.ranks)), flush=True)
    reference: dict[int, float] = {}
    for name in names:
        cells = []
        for ranks in args.ranks:
            runs = []
            for seed in args.seeds:
                runs.append(run(ranks, [*CONFIGS[name], *args.set], seed, args.samples, args.recipe, data_root))
                outcome, seconds, megabytes = runs[-1]
                figure = outcome if isinstance(outcome, str) else f"{outcome:.{RECIPES[args.recipe][3]}f}"
                # each run as it ends, on stderr: a sequence recipe's row takes hours, and a run stopped later keeps these
                print(f"# {name}, {ranks} ranks, seed {seed}: {figure}, {megabytes} MB sent, {seconds:.0f} s",
                      file=sys.stderr, flush=True)
            outcomes = [outcome for outcome, _, _ in runs]
            median, text = summarize(outcomes, args.recipe)
            sent = [megabytes for _, _, megabytes in runs if megabytes is not None]
            sent_text = f"{statistics.median(sent):,.1f}" if sent else "-"
            seconds = f"{statistics.median(s for _, s, _ in runs):.0f} s"
            if name == "data_parallel" and median is not None:
                reference[ranks] = median
            decimals = RECIPES[args.recipe][3]
            gap = (f"{median - reference[ranks]:+.{decimals}f}" if median is not None and ranks in reference
                   else "-")
            cells.append(f" {text:<34} | {gap:>6} | {sent_text:>9} | {seconds:>6} |")
        print(f"| {name:<30} |" + "".join(cells), flush=True)


if __name__ == "__main__":
    main()
