"""Losses and metrics the config can name (``loss: {_target_: ...}``, ``metric: {_target_: ...}``).

A loss is ``loss(output, labels)`` returning the MEAN over the minibatch (any ``torch.nn`` loss
module qualifies). A metric is ``metric(output, labels)`` returning the SUM over the minibatch
(so the loop can average it over samples and ranks exactly); its optional attributes ``name``
(the key in progress lines, ``metrics.jsonl``/``metrics.csv`` and the summary) and ``percent``
(shown as a percentage) say how it is reported. ``additive = True`` says that its value over
several minibatches' outputs together (concatenated along the first dimension) is the sum of its
values over each; the training loop then runs it once for up to 64 minibatches instead of after
every one (``dtrain.session.minibatch_step.PeriodSums``).
"""
from __future__ import annotations

import math

import torch

from dtrain.data.streams import Sequences
from dtrain.rules import check_settings
from dtrain.session.evaluate import classification_errors, wrong_steps
from dtrain.session.objective_settings import SEQUENCE_CROSS_ENTROPY, TOP_K_ERROR

__all__ = ["ClassificationError", "MSELoss", "MeanAbsoluteError", "Perplexity", "SequenceCrossEntropy", "SequenceError",
           "TopKError",
           "metric_name", "metric_in_percent"]


class ClassificationError:
    """Samples whose arg-max output is not the label, summed (CNTK's ``classification_error``)."""

    name = "error"
    percent = True
    additive = True
    takes_class_ids = True  # its target is class ids (stream_checks refuses a regression target for it)

    def __call__(self, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return classification_errors(output, labels)

    def __repr__(self) -> str:
        return "ClassificationError()"


class SequenceCrossEntropy:
    """Cross-entropy over the real steps of a sequence target: the mean over every step of every
    sequence (token-weighted), so a long sequence counts by its length, as the data-parallel learner
    weights ranks by their steps.

    ``output`` is ``[n, T', C]`` logits with ``T' >= T`` (the target's padded length; a training session
    refuses ``T' > T``, output steps without a target: ``stream_checks.check_target_steps``); a tensor target
    ``[n]`` (one class per sample) with ``[n, C]`` logits is plain cross-entropy. A share with no real
    step gives 0 (its weight in the global mean is 0 too).

    Args:
        label_smoothing: as ``torch.nn.functional.cross_entropy`` (in [0, 1)).

    Raises:
        ValueError: ``label_smoothing`` outside [0, 1); when called, logits shorter than the target.
    """

    def __init__(self, label_smoothing: float = 0.0) -> None:
        check_settings(SEQUENCE_CROSS_ENTROPY, label_smoothing=label_smoothing)
        self.label_smoothing = float(label_smoothing)

    def __call__(self, output: torch.Tensor, target) -> torch.Tensor:
        if not isinstance(target, Sequences):
            return torch.nn.functional.cross_entropy(output, target, label_smoothing=self.label_smoothing)
        steps = target.data.shape[1]
        if output.dim() < 3 or output.shape[1] < steps:
            raise ValueError(f"loss sequence_cross_entropy: the model outputs shape {tuple(output.shape)} for a target "
                             f"of {steps} steps; expected logits [n, >= {steps}, classes]")
        mask = target.mask
        logits = output[:, :steps][mask]
        if logits.shape[0] == 0:
            return output.sum() * 0.0
        return torch.nn.functional.cross_entropy(logits, target.data[mask], label_smoothing=self.label_smoothing)

    def __repr__(self) -> str:
        return f"SequenceCrossEntropy(label_smoothing={self.label_smoothing})"


class SequenceError:
    """Sequences with at least one wrong step (arg-max logit against the target), summed; averaged over
    sequences (``per = "sequence"``) and reported as ``sequence_error``: a word error rate for
    one-word sequences, an exact-match error for any other."""

    name = "sequence_error"
    percent = True
    per = "sequence"

    def __call__(self, output: torch.Tensor, target) -> torch.Tensor:
        if not isinstance(target, Sequences):
            return classification_errors(output, target)
        return wrong_steps(output, target).any(dim=1).sum()

    def __repr__(self) -> str:
        return "SequenceError()"


class Perplexity:
    """``exp`` of the mean cross-entropy (nats per step) of the real steps of a sequence target, or per
    sample of class labels: a language model's perplexity. Its sums are log-losses, so it averages over
    steps and ranks exactly and is reported as ``exp`` of that mean (``from_mean``)."""

    name = "perplexity"
    percent = False
    additive = True

    def __call__(self, output: torch.Tensor, target) -> torch.Tensor:
        if not isinstance(target, Sequences):
            return torch.nn.functional.cross_entropy(output.float(), target, reduction="sum")
        mask = target.mask
        logits = output[:, :mask.shape[1]][mask]
        return torch.nn.functional.cross_entropy(logits.float(), target.data[mask], reduction="sum")

    @staticmethod
    def from_mean(mean_log_loss: float) -> float:
        return math.exp(mean_log_loss) if mean_log_loss < 700 else float("inf")

    def __repr__(self) -> str:
        return "Perplexity()"


class TopKError:
    """Samples whose label is not among the ``k`` largest outputs, summed (``name``: ``top<k>_error``).

    Raises:
        ValueError: ``k`` is not a positive integer; when called, fewer than ``k`` classes.
    """

    percent = True
    additive = True
    takes_class_ids = True  # its target is class ids (stream_checks refuses a regression target for it)

    def __init__(self, k: int = 5) -> None:
        check_settings(TOP_K_ERROR, k=k)
        self.k = k
        self.name = f"top{k}_error"

    def __call__(self, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if output.shape[1] < self.k:
            raise ValueError(f"metric {self.name} needs at least {self.k} classes, the model outputs {output.shape[1]}")
        top = output.topk(self.k, dim=1).indices
        return (top != labels.unsqueeze(1)).all(dim=1).sum()

    def __repr__(self) -> str:
        return f"TopKError(k={self.k})"


def _regression_pair(output: torch.Tensor, labels: torch.Tensor, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``output`` and ``labels`` with one shape: ``[n, 1]`` outputs meet ``[n]`` labels; anything
    else that differs is refused (broadcasting would silently compare every pair of samples)."""
    if output.shape != labels.shape and output.shape == (*labels.shape, 1):
        output = output.squeeze(-1)
    if output.shape != labels.shape:
        raise ValueError(f"{what}: the model outputs shape {tuple(output.shape)} but the labels have shape "
                         f"{tuple(labels.shape)}; they must match (or outputs [n, 1] for labels [n])")
    return output, labels.to(output.dtype)


class MSELoss:
    """Mean squared error over samples and outputs, for regression targets (float labels)."""

    def __call__(self, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        output, labels = _regression_pair(output, labels, "loss mse")
        return torch.nn.functional.mse_loss(output, labels)

    def __repr__(self) -> str:
        return "MSELoss()"


class MeanAbsoluteError:
    """Absolute error per sample (averaged over its outputs), summed; for regression targets."""

    name = "mean_abs_error"
    percent = False
    additive = True

    def __call__(self, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        output, labels = _regression_pair(output, labels, "metric mean_abs_error")
        difference = (output - labels).abs()
        return difference.reshape(difference.shape[0], -1).mean(dim=1).sum()

    def __repr__(self) -> str:
        return "MeanAbsoluteError()"


def metric_name(metric) -> str:
    """The name a metric is reported under: its ``name``, ``error`` for ``classification_errors``,
    else its function or class name."""
    name = getattr(metric, "name", None)
    if isinstance(name, str) and name:
        return name
    if metric is classification_errors:
        return "error"
    name = getattr(metric, "__name__", None) or type(metric).__name__
    return "metric" if name.startswith("<") else name  # a lambda has no name worth a column


def metric_in_percent(metric) -> bool:
    """Whether a metric reads as a fraction shown in percent (error rates)."""
    percent = getattr(metric, "percent", None)
    if isinstance(percent, bool):
        return percent
    return metric is classification_errors
