"""Training loss by sequence length at each checkpoint of a sequence run: does the model follow its length buckets?

    python benchmarks/loss_by_length.py RUN_DIR [--minibatches 150] [--edges 4 6 8 10] [--threads 2]

Length bucketing (``source.train.length_bucketing``) reads a pool's sequences bucket by bucket, each
bucket one range of lengths, so consecutive minibatches come from one range. If the model follows
the range it has just seen, its weights at any moment fit some lengths better than others. For every
checkpoint of the run (``session.checkpoint.preserve_all=true`` keeps them all), this script reads
``--minibatches`` training minibatches of the run's size, each from a bucket of about one minibatch
(so each holds one length), the same ones at every checkpoint, and prints the mean loss per target
step of the minibatches whose mean target length falls in each range (``--edges``: the upper ends of
all ranges but the last), weighted by steps, in training mode without updating anything. A model
that does not swing has similar losses across a row; the last column is the loss over all of them.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from dtrain.noise_scale import load_run_setup, run_checkpoints

BUCKET_SEQUENCES = 64
"""Sequences per bucket for the measurement: about one minibatch, so every minibatch holds one length."""


def length_ranges(edges: list[int]) -> list[tuple[int, int | None]]:
    """``[(low, high)]`` inclusive ranges of mean target length: up to each edge, then above the last."""
    lows = [0, *(edge + 1 for edge in edges)]
    return list(zip(lows, [*edges, None]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", help="a run directory of a sequence recipe (config.yaml, checkpoint-<samples>.pt)")
    parser.add_argument("--minibatches", type=int, default=150, help="minibatches read at each checkpoint (default 150)")
    parser.add_argument("--edges", type=int, nargs="+", default=[4, 6, 8, 10], metavar="STEPS",
                        help="upper ends of the length ranges but the last, increasing (default 4 6 8 10)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args(argv)
    if args.minibatches < 1:
        parser.error(f"--minibatches {args.minibatches}: expected at least 1")
    if any(low >= high for low, high in zip(args.edges, args.edges[1:])) or args.edges[0] < 1:
        parser.error(f"--edges {' '.join(map(str, args.edges))}: expected increasing positive numbers of steps")
    if args.threads:
        torch.set_num_threads(args.threads)
    from dtrain.failures import UserError
    from dtrain.session.checkpoint import load

    run_dir = Path(args.run_dir)
    try:
        config, model, loss_fn, source, binding, _ = load_run_setup(run_dir, length_bucketing=BUCKET_SEQUENCES)
        checkpoints = run_checkpoints(run_dir, str(config.session.checkpoint.filename))
    except (OSError, ValueError, UserError) as error:
        print(f"loss_by_length.py: error: {error}", file=sys.stderr)
        return 2
    ranges = length_ranges(args.edges)
    size, start = int(config.session.minibatch_size), source.get_checkpoint_state()
    print(f"{run_dir}: loss per target step, {args.minibatches} training minibatches of {size} samples, each of "
          f"one length (buckets of {BUCKET_SEQUENCES} sequences), by the minibatch's mean target length")
    print("| samples trained | " + " | ".join(f"length {low}-{high}" if high else f"length {low}+"
                                              for low, high in ranges) + " | all |")
    print("|---:|" + "---:|" * (len(ranges) + 1))
    for samples_seen, path in checkpoints:
        model.load_state_dict(load(path)["model"])
        model.train()
        source.restore_from_checkpoint(start)
        sums = [[0.0, 0] for _ in ranges]
        with torch.no_grad():
            for _ in range(args.minibatches):
                batch = source.next_minibatch(size, 1, 0)
                if batch is None:
                    break
                target, steps, sequences = binding.target_and_counts(batch)
                loss = float(loss_fn(binding.forward(model, batch), target))
                mean_length = steps / max(sequences, 1)
                index = next(i for i, (_, high) in enumerate(ranges) if high is None or mean_length <= high + 0.5)
                sums[index][0] += loss * steps
                sums[index][1] += steps
        total = sum(loss for loss, _ in sums) / max(sum(steps for _, steps in sums), 1)
        print(f"| {samples_seen:,} | " + " | ".join(f"{loss / steps:.3f}" if steps else "-" for loss, steps in sums)
              + f" | {total:.3f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
