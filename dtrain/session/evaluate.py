"""Loss and error over a whole source, aggregated over every worker and weighted by samples."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


def classification_errors(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Number of samples whose arg-max logit is not the label (CNTK's classification_error, summed)."""
    return (logits.argmax(dim=1) != labels).sum()


classification_errors.additive = True  # a sum over samples: the training loop may run it over many minibatches at once


@dataclass
class Evaluation:
    """Sample-weighted averages over an evaluated source."""

    loss: float
    error: float          # fraction of samples misclassified (or the metric's average)
    num_samples: int
    num_minibatches: int

    @property
    def accuracy(self) -> float:
        return 1.0 - self.error


def evaluate(
    model: torch.nn.Module,
    source,
    minibatch_size: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    metric_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    comm,
    device: torch.device,
    max_samples: int | None = None,
) -> Evaluation:
    """Reads ``source`` to its end (or ``max_samples``), partitioned over the workers of ``comm``.

    Each worker evaluates its share; sums of loss, metric and samples are all-reduced once, so
    every sample counts exactly once and the result is the same on every rank. The source's
    position is restored afterwards, so the next evaluation reads the same samples again.
    ``loss_fn`` returns a mean over the minibatch, ``metric_fn`` a sum.
    """
    position = source.get_checkpoint_state()
    was_training = model.training
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64)  # loss sum, metric sum, samples
    minibatches = 0
    read = 0
    try:
        with torch.no_grad():
            while max_samples is None or read < max_samples:
                size = minibatch_size if max_samples is None else min(minibatch_size, max_samples - read)
                batch = source.next_minibatch(size, comm.size, comm.rank)
                if batch is None:
                    break
                read += batch.global_num_samples
                minibatches += 1
                if batch.num_samples == 0:
                    continue
                features, labels = batch.features.to(device), batch.labels.to(device)
                output = model(features)
                totals[0] += float(loss_fn(output, labels)) * batch.num_samples
                totals[1] += float(metric_fn(output, labels))
                totals[2] += batch.num_samples
    finally:
        source.restore_from_checkpoint(position)
        model.train(was_training)
    totals = comm.allreduce(totals.to(comm.device), op="sum").cpu()
    samples = int(totals[2])
    if samples == 0:
        return Evaluation(float("nan"), float("nan"), 0, minibatches)
    return Evaluation(float(totals[0]) / samples, float(totals[1]) / samples, samples, minibatches)
