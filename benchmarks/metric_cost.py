"""What a training error computed after every backward costs a small model's step, against the
same error computed once per 64 minibatches over kept copies (what the session does for an
``additive`` metric).

    python benchmarks/metric_cost.py                  # digits CNN, 3,000 steps of each variant
    python benchmarks/metric_cost.py --steps 6000 --model cifar

Whole runs on a shared 2-CPU machine spread by several percent, more than this effect. Here three
identical models train side by side and their steps alternate (the order flips every step), so
every variant sees the same machine; each step is timed alone and the table gives the median step
and its difference from the plain one:

* ``plain``: forward, backward, SGD step, ``loss.item()`` (a hand-written loop);
* ``every step``: the same, then the error's three tensor calls (``argmax``, ``!=``, ``sum``) and
  the detached loss kept, as the session did for every minibatch;
* ``deferred``: the detached loss and copies of the output and labels kept, the error computed once
  per 64 steps over their concatenation.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from dtrain.models import ConvNetCIFAR10, DigitsCNN
from dtrain.session import classification_errors

MODELS = {"digits": (DigitsCNN, (1, 8, 8), 32), "cifar": (lambda: ConvNetCIFAR10(dropout=0.0), (3, 32, 32), 64)}
FOLD_EVERY = 64


class Trainer:
    """One model, its optimizer and data, and one way of keeping the training error."""

    def __init__(self, model_name: str, variant: str):
        factory, shape, self.minibatch = MODELS[model_name]
        torch.manual_seed(0)
        self.model = factory()
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
        generator = torch.Generator().manual_seed(0)
        self.features = torch.randn(4096, *shape, generator=generator)
        self.labels = torch.randint(0, 10, (4096,), generator=generator)
        self.order = torch.randperm(4096, generator=generator)
        self.position = 0
        self.variant = variant
        self.kept: list = []
        self.errors = torch.zeros((), dtype=torch.int64)

    def step(self) -> None:
        if self.position + self.minibatch > len(self.order):
            self.position = 0
        index = self.order[self.position:self.position + self.minibatch]
        self.position += self.minibatch
        features, labels = self.features[index], self.labels[index]
        output = self.model(features)
        loss = torch.nn.functional.cross_entropy(output, labels)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        if self.variant == "plain":
            self.kept.append(loss.item())
        elif self.variant == "every step":
            with torch.no_grad():
                self.kept.append((loss.detach(), classification_errors(output.detach(), labels)))
        else:  # deferred
            self.kept.append((loss.detach(), output.detach().clone(), labels.clone()))
            if len(self.kept) >= FOLD_EVERY:
                with torch.no_grad():
                    outputs = torch.cat([kept[1] for kept in self.kept])
                    self.errors += classification_errors(outputs, torch.cat([kept[2] for kept in self.kept]))
                self.kept = []
        if len(self.kept) >= FOLD_EVERY:
            self.kept = []


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=list(MODELS), default="digits")
    parser.add_argument("--steps", type=int, default=3000, help="timed steps of each variant")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    variants = ["plain", "every step", "deferred"]
    trainers = {name: Trainer(args.model, name) for name in variants}
    times: dict[str, list[int]] = {name: [] for name in variants}
    for index in range(args.steps + 200):  # the first 200 warm up
        for name in variants if index % 2 else reversed(variants):
            started = time.perf_counter_ns()
            trainers[name].step()
            if index >= 200:
                times[name].append(time.perf_counter_ns() - started)
    plain = statistics.median(times["plain"])
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.model}, {args.steps} alternated steps each")
    print(f"{'variant':<11} {'median µs/step':>15} {'µs over plain':>14}")
    for name in variants:
        median = statistics.median(times[name])
        print(f"{name:<11} {median / 1e3:>15.1f} {(median - plain) / 1e3:>+14.1f}")


if __name__ == "__main__":
    main()
