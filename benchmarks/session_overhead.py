"""Samples/s of ``training_session`` against a hand-written PyTorch loop on the same model and data.

    python benchmarks/session_overhead.py                      # both models, 3 alternating rounds
    python benchmarks/session_overhead.py --model cifar --samples 20000 --rounds 5
    python benchmarks/session_overhead.py --model linear --threads 1 --rounds 9  # the fixed cost per step

Both sides train the same network from the same initial weights, with the same optimizer and
minibatch size, on the same in-memory data (random order each sweep). The hand-written loop is
what a user would write: index a tensor with a permutation, forward, backward, step, and keep
the loss for logging. The session runs as the CLI does (progress lines, metrics JSONL and
TensorBoard); only checkpoints are off. Rounds alternate between the two so machine noise hits
both; the table gives the median of each and their ratio ("per round": the median of each round's
ratio, the two runs of a round being back to back), for the training loop (the session's
own clock, ``TrainingResult.seconds``) and for the whole ``train()`` call including its one-off
set-up (TensorBoard writer, metrics file, restore check) and end (``model.safetensors``,
``report.png``).
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
from dtrain.data import ArrayDeserializer
from dtrain.models import ConvNetCIFAR10, DigitsCNN

MODELS = {
    # name: (network factory, feature shape, minibatch size)
    "digits": (lambda: DigitsCNN(), (1, 8, 8), 32),
    "cifar": (lambda: ConvNetCIFAR10(dropout=0.0), (3, 32, 32), 64),
    # a step of almost no compute: the session's own cost per minibatch shows as "µs/step over hand"
    "linear": (lambda: torch.nn.Linear(64, 10), (64,), 32),
}


def make_data(shape: tuple[int, ...], num_samples: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = np.random.default_rng(0)
    features = generator.normal(size=(num_samples, *shape)).astype(np.float32)
    labels = generator.integers(0, 10, size=num_samples)
    return torch.from_numpy(features), torch.from_numpy(labels)


def hand_written_loop(name: str, features: torch.Tensor, labels: torch.Tensor, samples: int) -> float:
    factory, _, minibatch = MODELS[name]
    torch.manual_seed(0)
    model = factory()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    generator = torch.Generator().manual_seed(0)
    losses = []
    start = time.perf_counter()
    seen = 0
    while seen < samples:
        order = torch.randperm(len(features), generator=generator)
        for begin in range(0, len(order), minibatch):
            if seen >= samples:
                break
            index = order[begin:begin + minibatch]
            output = model(features[index])
            loss = torch.nn.functional.cross_entropy(output, labels[index])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            seen += len(index)
    return seen / (time.perf_counter() - start)


def dtrain_session(name: str, features: torch.Tensor, labels: torch.Tensor, samples: int) -> tuple[float, float]:
    """(samples/s of the training loop, samples/s of the whole ``train()`` call with its set-up)."""
    factory, _, minibatch = MODELS[name]
    torch.manual_seed(0)
    model = factory()
    learner = LocalLearner(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
    source = MinibatchSource(ArrayDeserializer(features, labels, num_classes=10), randomize=True)
    with tempfile.TemporaryDirectory() as run_dir:
        session = training_session(model, torch.nn.functional.cross_entropy, learner, source, minibatch,
                                   max_samples=samples, progress_frequency=len(features), run_dir=run_dir,
                                   tensorboard=True, stream=io.StringIO())
        start = time.perf_counter()
        result = session.train()
        whole = time.perf_counter() - start
        return result.samples_seen / result.seconds, result.samples_seen / whole


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=[*MODELS, "all"], default="all")
    parser.add_argument("--samples", type=int, default=None, help="samples per measurement (default: per model)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating measurements of each side")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    names = list(MODELS) if args.model == "all" else [args.model]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.rounds} alternating rounds")
    print(f"{'model':<8} {'samples':>8} {'hand loop /s':>13} {'session /s':>11} {'session/hand':>13} "
          f"{'per round':>10} {'with set-up':>12} {'µs/step over hand':>18}")
    for name in names:
        samples = args.samples or {"digits": 60000, "cifar": 12800, "linear": 320000}[name]
        features, labels = make_data(MODELS[name][1], 10000)
        hand_written_loop(name, features, labels, MODELS[name][2] * 5)  # warm-up: allocator, kernels
        hand, session, whole = [], [], []
        for _ in range(args.rounds):
            hand.append(hand_written_loop(name, features, labels, samples))
            loop_rate, whole_rate = dtrain_session(name, features, labels, samples)
            session.append(loop_rate)
            whole.append(whole_rate)
        hand_rate, session_rate = statistics.median(hand), statistics.median(session)
        paired = statistics.median(ours / theirs for ours, theirs in zip(session, hand))
        minibatch = MODELS[name][2]
        extra_us = 1e6 * minibatch * (1 / session_rate - 1 / hand_rate)  # the session's own time per step
        print(f"{name:<8} {samples:>8} {hand_rate:>13,.0f} {session_rate:>11,.0f} {session_rate / hand_rate:>13.3f} "
              f"{paired:>10.3f} {statistics.median(whole) / hand_rate:>12.3f} {extra_us:>18.1f}")


if __name__ == "__main__":
    main()
