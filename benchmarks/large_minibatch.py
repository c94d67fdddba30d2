"""A 16x larger global minibatch with LARS/LAMB, learning-rate scaling and warm-up, against the
small-minibatch baseline in the same number of samples (docs/large-minibatch.md).

    python benchmarks/large_minibatch.py                      # digits rows (one process each)
    python benchmarks/large_minibatch.py --recipe shakespeare_char --epoch-size 51200   # the LM, shortened
    python benchmarks/large_minibatch.py --only baseline lars
    python benchmarks/large_minibatch.py --recipe cmudict_g2p --seeds 0 --only lamb   # G2P, full length
    python benchmarks/large_minibatch.py --recipe shakespeare_char --seeds 0 --only "8x the samples"

Each row is one ``python -m dtrain`` run in one process (data_parallel on N ranks computes the same
update as one process: docs/semantics.md), so the global minibatch is the only thing that grows.
Every row of a recipe trains the same number of samples, the large rows in 1/16 of the steps, except
the language model's rows that say "4x / 8x the samples" (a quarter and half of the baseline's steps).
The figure is the test error in % (digits), the validation loss in nats per character (the
language model) or the test word error rate in % (G2P), the MEDIAN over ``--seeds`` (each seed in
brackets: digits tests on 297 images, so one image is 0.34 point and one seed's luck moves a row by a
point), with the gap between medians to the recipe's baseline; goals: within 0.5 point / 0.05 nats /
0.5 point of WER.
A row whose run fails, or whose overrides the config refuses (exit 2), prints why in place of its figure, the
other rows still run, and the script then exits 1: a table with a missing row is not a result.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _run_records import last_record, lr_scaling_text, run_records, value

SCALE = 16  # the large global minibatch is SCALE x the recipe's

#: recipe -> (figure, its key in the test record of metrics.jsonl, scale, decimals, goal on the gap, base minibatch,
#: warm-up samples)
RECIPES = {
    "digits": ("test error %", "error", 100, 2, 0.5, 32, 3000),
    "shakespeare_char": ("validation loss (nats/char)", "loss", 1, 3, 0.05, 2048, None),
    "cmudict_g2p": ("word error rate %", "wer", 100, 2, 0.5, 512, None),
}


def large(optimizer: list[str], rule: str, recipe: str, base_minibatch: int, warmup: int | None) -> list[str]:
    """The overrides of a 16x-minibatch row: scaled lr from the reference minibatch, warmed up."""
    overrides = [f"session.minibatch_size={SCALE * base_minibatch}", f"session.lr_scaling={rule}",
                 f"session.lr_reference_minibatch_size={base_minibatch}", *optimizer]
    if warmup is not None:
        overrides.append(f"session.lr_schedule.warmup_samples={warmup}")
    return overrides


#: the language model's session.epoch_size (its max_samples and lr schedule count in epochs)
LM_EPOCH = 512000


def rows(recipe: str, base_minibatch: int, warmup: int | None,
         epoch_size: int | None = None) -> list[tuple[str, list[str]]]:
    """(setting, overrides) per row; the first is the baseline. Extend the list to add a row."""
    big = lambda optimizer, rule, warmup_samples=warmup: large(optimizer, rule, recipe, base_minibatch,  # noqa: E731
                                                               warmup_samples)
    if recipe == "digits":
        return [
            ("baseline: sgd, minibatch 32", []),
            ("sgd, linear scaling + warm-up", big([], "linear")),
            ("sgd, sqrt scaling + warm-up", big([], "sqrt")),
            ("lars, lr 5 (LARS's own scale, no rule)", big(["optimizer=lars", "optimizer.lr=5"], "none")),
            ("lamb (the recipe's lr), linear scaling + warm-up", big(["optimizer=lamb"], "linear")),
            ("lamb, as above, warm-up over 1,500 samples", big(["optimizer=lamb"], "linear", warmup_samples=1500)),
            ("lamb, as above + weight EMA 0.9", big(["optimizer=lamb", "session.ema_decay=0.9"], "linear")),
            ("rmsprop warm-up -> sgd, linear", big(["optimizer=rmsprop_warmup_sgd", "optimizer.center_samples=6000",
                                                    "optimizer.period_samples=6000"], "linear")),
            ("BN baseline: model.batch_norm=true, minibatch 32", ["model.batch_norm=true"]),
            ("BN: lars (the recipe's lr), linear scaling + warm-up", ["model.batch_norm=true",
                                                                      *big(["optimizer=lars"], "linear")]),
            ("BN: lars, as above + recomputed statistics", ["model.batch_norm=true",
                                                            "session.batchnorm_statistics=recomputed",
                                                            *big(["optimizer=lars"], "linear")]),
            ("BN: lamb (the recipe's lr), linear scaling + warm-up", ["model.batch_norm=true",
                                                                      *big(["optimizer=lamb"], "linear")]),
        ]
    if recipe == "cmudict_g2p":  # AdamW, with the recipe's warm-up over half a sweep in every row
        return [
            ("baseline: adamw, minibatch 512", []),
            ("adamw, sqrt scaling + warm-up", big([], "sqrt")),
            ("lamb, sqrt scaling + warm-up", big(["optimizer=lamb", "optimizer.lr=0.002"], "sqrt")),
            ("lamb, linear scaling + warm-up", big(["optimizer=lamb", "optimizer.lr=0.002"], "linear")),
        ]
    lamb = ["optimizer=lamb", "optimizer.lr=0.002"]
    # more samples for the large minibatch: longer epochs stretch max_samples and the lr schedule alike (the
    # warm-up keeps its samples); docs/large-minibatch.md predicts the factor from the gradient noise scale
    longer = lambda factor: [f"session.epoch_size={factor * (epoch_size or LM_EPOCH)}"]  # noqa: E731
    return [  # shakespeare_char: its preset is AdamW, with its own warm-up in lr_schedule.warmup_samples
        ("baseline: adamw, minibatch 2048", [f"session.lr_schedule.warmup_samples={warmup}"] if warmup else []),
        ("adamw, sqrt scaling + warm-up", big([], "sqrt")),
        ("lamb, sqrt scaling + warm-up", big(lamb, "sqrt")),
        ("lamb, sqrt scaling + warm-up, 4x the samples", big(lamb, "sqrt") + longer(4)),
        ("lamb, sqrt scaling + warm-up, 8x the samples", big(lamb, "sqrt") + longer(8)),
    ]


def run(recipe: str, overrides: list[str], epoch_size: int | None, seed: int,
        threads: int | None = None) -> tuple[str, float | None, float | None, str]:
    """One run: (status, figure, EMA figure, lr scaling), read from its metrics.jsonl and config.yaml."""
    _, key, scale, *_ = RECIPES[recipe]
    with tempfile.TemporaryDirectory() as run_dir:
        extra = [f"session.epoch_size={epoch_size}"] if epoch_size else []
        extra.append(f"seed={seed}")
        if threads is not None:
            extra.append(f"session.num_threads={threads}")
        command = [sys.executable, "-m", "dtrain", f"+recipe={recipe}", f"run_dir={run_dir}", "session.progress_bar=false",
                   "session.tensorboard=false", "session.checkpoint.frequency=0", *extra, *overrides]
        done = subprocess.run(command, capture_output=True, text=True)
        output = done.stdout + done.stderr
        if done.returncode == 2:  # refused: the reason is the error line, shown as it is
            line = next((line for line in output.splitlines() if "error:" in line), output.strip()[-200:])
            return f"refused: {line.split('error: ', 1)[-1]}", None, None, ""
        if done.returncode != 0:
            return f"failed (exit {done.returncode}): {output.strip().splitlines()[-1][:160]}", None, None, ""
        records = run_records(Path(run_dir))
        emas = [record for record in records if record.get("kind") == "test_ema"]  # only with session.ema_decay
        return ("ok", value(last_record(records, "test"), key, scale),
                value(emas[-1], key, scale) if emas else None, lr_scaling_text(Path(run_dir)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="digits", choices=list(RECIPES))
    parser.add_argument("--epoch-size", type=int, default=None,
                        help="session.epoch_size: shortens a recipe whose sizes count in epochs (the LM: 51200)")
    parser.add_argument("--only", nargs="*", default=None, help="rows whose setting contains one of these words")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--threads", type=int, default=None,
                        help="session.num_threads of every run (default: dtrain's choice from the machine's load)")
    parser.add_argument("--baseline", type=float, default=None,
                        help="the baseline row's figure from an earlier run of it: its row is not run again "
                             "(a full-length G2P run takes about 45 minutes on 2 cores)")
    args = parser.parse_args()
    name, _, _, decimals, goal, base_minibatch, warmup = RECIPES[args.recipe]
    if args.recipe == "shakespeare_char" and args.epoch_size:
        warmup = 2 * args.epoch_size  # two of the shortened epochs
    table = rows(args.recipe, base_minibatch, warmup, args.epoch_size)
    if args.only:
        table = [row for index, row in enumerate(table) if index == 0 or any(word in row[0] for word in args.only)]
    print(f"{args.recipe}: global minibatch {base_minibatch} vs {SCALE * base_minibatch}, the same samples; "
          f"{name}, median of seeds {args.seeds}, goal: gap within {goal}")
    print(f"{'setting':<50} {'minibatch':>9} {'lr':<28} {name + ' [seeds]':>30} {'gap':>7} {'EMA':>8} {'seconds':>7}")
    baselines: dict[str, float] = {}
    if args.baseline is not None:
        setting, _ = table.pop(0)
        baselines[""] = args.baseline
        print(f"{setting:<50} {base_minibatch:>9} {'(--baseline, an earlier run)':<28} {args.baseline:>30.{decimals}f}",
              flush=True)
    incomplete = False
    for setting, overrides in table:
        started = time.time()
        results = [run(args.recipe, overrides, args.epoch_size, seed, args.threads) for seed in args.seeds]
        seconds = (time.time() - started) / len(args.seeds)
        minibatch = next((int(o.split("=")[1]) for o in overrides if o.startswith("session.minibatch_size=")),
                         base_minibatch)
        family = "BN" if "model.batch_norm=true" in overrides else ""
        failed = next((status for status, *_ in results if status != "ok"), None)
        if failed is not None:
            print(f"{setting:<50} {minibatch:>9} {failed}", flush=True)
            incomplete = True
            continue
        figures = [figure for _, figure, _, _ in results]
        figure = statistics.median(figures)
        if minibatch == base_minibatch:
            baselines[family] = figure
        base = baselines.get(family)
        gap = f"{figure - base:+.{decimals}f}" if base is not None and minibatch != base_minibatch else ""
        met = "" if not gap else (" ok" if figure - base <= goal else " !")
        emas = [ema for _, _, ema, _ in results if ema is not None]
        ema_text = f"{statistics.median(emas):.{decimals}f}" if emas else ""
        cell = f"{figure:.{decimals}f} [{' '.join(f'{value:.{decimals}f}' for value in figures)}]"
        print(f"{setting:<50} {minibatch:>9} {results[0][3] or 'as configured':<28} {cell:>30} {gap:>7}{met:<3}"
              f"{ema_text:>6} {seconds:>7.0f}", flush=True)
    if incomplete:
        sys.exit("large_minibatch: some rows have no figure (failed or refused, above)")


if __name__ == "__main__":
    main()
