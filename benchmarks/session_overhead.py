"""Samples/s of ``training_session`` against a hand-written PyTorch loop on the same model and data.

    python benchmarks/session_overhead.py                      # both models, 3 alternating rounds
    python benchmarks/session_overhead.py --model cifar --samples 20000 --rounds 5
    python benchmarks/session_overhead.py --model linear --threads 1 --rounds 9  # the fixed cost per step
    python benchmarks/session_overhead.py --model digits --threads 1 --metric-deferral --rounds 21 --samples 6400

Both sides train the same network from the same initial weights, with the same optimizer and
minibatch size, on the same in-memory data (random order each sweep). The hand-written loop is
what a user would write: index a tensor with a permutation, forward, backward, step, and keep
the loss for logging. The session runs as the CLI does (progress lines, metrics JSONL and
TensorBoard); only checkpoints are off. Rounds alternate between the two so machine noise hits
both; the table gives the median of each and their ratio ("per round": the median of each round's
ratio, the two runs of a round being back to back), for the training loop (the session's
own clock, ``TrainingResult.seconds``) and for the whole ``train()`` call including its one-off
set-up (TensorBoard writer, metrics file, restore check) and end (``model.safetensors``,
``report.png``). glibc malloc's thresholds are fixed for the whole process first, as ``python -m
dtrain`` does (``--glibc-malloc`` leaves them; ``benchmarks/host_memory.py`` compares the two).

``--metric-deferral`` compares two sessions instead: the classification error as dtrain runs it
(marked ``additive``: once over 64 minibatches' kept outputs) against the same count in a function
without the mark (computed after every minibatch), alternating, with the paired ratio.
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
from dtrain.host_memory import keep_freed_host_memory
from dtrain.models import ConvNetCIFAR10, DigitsCNN
from dtrain.session import classification_errors

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


def errors_every_minibatch(output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``classification_errors`` without the ``additive`` mark: the session computes it after every minibatch."""
    return classification_errors(output, labels)


def dtrain_session(name: str, features: torch.Tensor, labels: torch.Tensor, samples: int,
                   metric=classification_errors) -> tuple[float, float]:
    """(samples/s of the training loop, samples/s of the whole ``train()`` call with its set-up)."""
    factory, _, minibatch = MODELS[name]
    torch.manual_seed(0)
    model = factory()
    learner = LocalLearner(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
    source = MinibatchSource(ArrayDeserializer(features, labels, num_classes=10), randomize=True)
    with tempfile.TemporaryDirectory() as run_dir:
        session = training_session(model, torch.nn.functional.cross_entropy, learner, source, minibatch,
                                   max_samples=samples, progress_frequency=len(features), run_dir=run_dir,
                                   tensorboard=True, stream=io.StringIO(), metric=metric)
        start = time.perf_counter()
        result = session.train()
        whole = time.perf_counter() - start
        return result.samples_seen / result.seconds, result.samples_seen / whole


def measurement(name: str, args: argparse.Namespace) -> tuple[int, torch.Tensor, torch.Tensor]:
    """Samples per measurement (``--samples`` or the model's default) and the in-memory data set."""
    features, labels = make_data(MODELS[name][1], 10000)
    return args.samples or {"digits": 60000, "cifar": 12800, "linear": 320000}[name], features, labels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=[*MODELS, "all"], default="all")
    parser.add_argument("--samples", type=int, default=None, help="samples per measurement (default: per model)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating measurements of each side")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--glibc-malloc", action="store_true",
                        help="leave glibc malloc's adaptive thresholds (default: fixed, as python -m dtrain does)")
    parser.add_argument("--metric-deferral", action="store_true",
                        help="the error once per 64 minibatches (dtrain's) against after every minibatch, in sessions")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    host_memory = keep_freed_host_memory(not args.glibc_malloc)  # for both sides: they share the process
    names = list(MODELS) if args.model == "all" else [args.model]
    if args.metric_deferral:
        compare_metric_deferral(names, args)
        return
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.rounds} alternating rounds; "
          f"{host_memory.describe()}")
    print(f"{'model':<8} {'samples':>8} {'hand loop /s':>13} {'session /s':>11} {'session/hand':>13} "
          f"{'per round':>10} {'with set-up':>12} {'µs/step over hand':>18}")
    for name in names:
        samples, features, labels = measurement(name, args)
        hand_written_loop(name, features, labels, MODELS[name][2] * 5)  # warm-up: allocator, kernels
        hand, session, whole = [], [], []
        for index in range(args.rounds):
            if index % 2:  # which side runs first alternates too, so neither always follows the other
                hand.append(hand_written_loop(name, features, labels, samples))
            loop_rate, whole_rate = dtrain_session(name, features, labels, samples)
            session.append(loop_rate)
            whole.append(whole_rate)
            if not index % 2:
                hand.append(hand_written_loop(name, features, labels, samples))
        hand_rate, session_rate = statistics.median(hand), statistics.median(session)
        paired = statistics.median(ours / theirs for ours, theirs in zip(session, hand))
        minibatch = MODELS[name][2]
        extra_us = 1e6 * minibatch * (1 / session_rate - 1 / hand_rate)  # the session's own time per step
        print(f"{name:<8} {samples:>8} {hand_rate:>13,.0f} {session_rate:>11,.0f} {session_rate / hand_rate:>13.3f} "
              f"{paired:>10.3f} {statistics.median(whole) / hand_rate:>12.3f} {extra_us:>18.1f}")


def compare_metric_deferral(names: list[str], args: argparse.Namespace) -> None:
    """Sessions with the error deferred and computed every minibatch, alternating; medians and paired ratio."""
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.rounds} alternating rounds")
    print(f"{'model':<8} {'samples':>8} {'every minibatch /s':>19} {'deferred /s':>12} {'deferred/every':>15} "
          f"{'per round':>10} {'µs/step saved':>14}")
    for name in names:
        samples, features, labels = measurement(name, args)
        dtrain_session(name, features, labels, MODELS[name][2] * 5)  # warm-up
        deferred, every = [], []
        for index in range(args.rounds):
            order = [(deferred, classification_errors), (every, errors_every_minibatch)]
            for rates, metric in order if index % 2 else reversed(order):
                rates.append(dtrain_session(name, features, labels, samples, metric)[0])
        deferred_rate, every_rate = statistics.median(deferred), statistics.median(every)
        paired = statistics.median(ours / theirs for ours, theirs in zip(deferred, every))
        saved_us = 1e6 * MODELS[name][2] * (1 / every_rate - 1 / deferred_rate)
        print(f"{name:<8} {samples:>8} {every_rate:>19,.0f} {deferred_rate:>12,.0f} {deferred_rate / every_rate:>15.3f} "
              f"{paired:>10.3f} {saved_us:>14.1f}")


if __name__ == "__main__":
    main()
