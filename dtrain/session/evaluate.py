"""Loss and error over a whole source, aggregated over every worker and weighted by samples."""
from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from dtrain.data.errors import DataError
from dtrain.data.streams import Sequences
from dtrain.session.binding import StreamBinding, count_steps
from dtrain.session.stream_checks import ids_past_the_model


def wrong_steps(logits: torch.Tensor, target: Sequences) -> torch.Tensor:
    """bool ``[n, T]``: the real steps of a sequence target whose arg-max logit is not the target's id
    (``logits`` ``[n, T', C]`` with ``T' >= T``); padding is never wrong."""
    mask = target.mask
    return (logits[:, :mask.shape[1]].argmax(dim=-1) != target.data) & mask


def classification_errors(logits: torch.Tensor, labels) -> torch.Tensor:
    """Number of samples whose arg-max logit is not the label (CNTK's classification_error, summed).

    With a sequence target (:class:`~dtrain.data.Sequences` of class ids), ``logits`` are
    ``[n, T, C]`` (at least the target's ``T`` steps) and every real step is a sample."""
    if isinstance(labels, Sequences):
        return wrong_steps(logits, labels).sum()
    return (logits.argmax(dim=1) != labels).sum()


classification_errors.takes_class_ids = True  # its target is class ids (stream_checks refuses a regression target)


classification_errors.additive = True  # a sum over samples: the training loop may run it over many minibatches at once


def metric_counts_sequences(metric) -> bool:
    """Whether ``metric`` is averaged over sequences (``metric.per == "sequence"``, e.g. a sequence error
    rate) rather than over samples (steps of a sequence target: the default)."""
    per = getattr(metric, "per", "step")
    if per not in ("step", "sample", "sequence"):
        raise ValueError(f"metric.per={per!r}: expected 'step' (averaged over samples, steps of a sequence target) "
                         f"or 'sequence'")
    return per == "sequence"


@dataclass
class Evaluation:
    """Sample-weighted averages over an evaluated source."""

    loss: float
    error: float          # fraction of samples misclassified (or the metric's average; NaN without a metric)
    num_samples: int
    num_minibatches: int
    # a decoding metric's other rates (e.g. ``per``), or an objective's figures (averaged like the loss)
    details: dict[str, float] = field(default_factory=dict)

    @property
    def accuracy(self) -> float:
        return 1.0 - self.error


def evaluate(
    model: torch.nn.Module,
    source,
    minibatch_size: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None,
    metric_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None,
    comm,
    device: torch.device,
    max_samples: int | None = None,
    binding=None,
    progress: Callable[[int], None] | None = None,
    objective=None,
    collective: bool = False,
) -> Evaluation:
    """Reads ``source`` to its end (or ``max_samples``), partitioned over the workers of ``comm``.

    Each worker evaluates its share; sums of loss, metric and samples are all-reduced once, so
    every sample counts exactly once and the result is the same on every rank. The source's
    position is restored afterwards, so the next evaluation reads the same samples again.
    ``loss_fn`` returns a mean over the minibatch's samples (steps of a sequence target), weighted
    here by them; ``metric_fn`` a sum, averaged over samples, or over sequences when
    ``metric_fn.per == "sequence"``. ``binding`` (a ``StreamBinding``) says which streams feed the
    model and which is the target (default: features -> labels). ``progress(samples_read)`` is called
    after each minibatch (global samples read so far; e.g. an
    :class:`~dtrain.session.progress.EvaluationProgress`). ``objective`` (an
    :class:`~dtrain.session.objective_call.ObjectiveCall`, in place of ``loss_fn`` and ``metric_fn``) gives each
    minibatch's mean loss and figures, weighted alike; the figures are the result's ``details`` and its
    ``error`` is NaN. ``collective``: the model's forward is a collective (a sharded model, ``learner=fsdp``), so
    every rank runs it on every share, an empty one too (its output is not counted).
    """
    if objective is not None:
        return _evaluate_objective(model, source, minibatch_size, objective, comm, device, max_samples, binding,
                                   progress, collective)
    per_sequence = metric_counts_sequences(metric_fn)
    decoded_counts = getattr(metric_fn, "decoded_counts", None)
    names = tuple(getattr(metric_fn, "names", ())) if decoded_counts is not None else ()
    decoded = torch.zeros(len(names), 2, dtype=torch.float64)
    totals = torch.zeros(4, dtype=torch.float64)  # loss sum, metric sum, samples, what the metric averages over
    shares = _Shares(source, minibatch_size, comm, device, max_samples, binding, progress, collective)
    with _evaluating(model, source):
        for batch, target, samples, sequences in shares:
            if samples == 0:  # an empty share of a collective forward: this rank takes part, nothing to count
                shares.binding.forward(model, batch)
                continue
            output = None
            try:
                output = shares.binding.forward(model, batch)
                totals[0] += float(loss_fn(output, target)) * samples
            except IndexError as error:  # an id the model has no room for (see ids_past_the_model)
                problem = ids_past_the_model(model, shares.binding, batch, output)
                if problem is None:
                    raise
                raise DataError(problem) from error
            if decoded_counts is None:
                totals[1] += float(metric_fn(output, target))
            else:
                decoded += decoded_counts(model, batch, target)
            totals[2] += samples
            totals[3] += sequences if per_sequence else samples
    totals = comm.allreduce(torch.cat([totals, decoded.flatten()]).to(comm.device), op="sum").cpu()
    decoded = totals[4:].reshape(-1, 2)
    samples = int(totals[2])
    if samples == 0:
        return Evaluation(float("nan"), float("nan"), 0, shares.minibatches)
    rates = {name: float(errors) / float(count) if float(count) else float("nan") for name, (errors, count)
             in zip(names, decoded)}
    if names:
        return Evaluation(float(totals[0]) / samples, rates.pop(names[0]), samples, shares.minibatches, rates)
    return Evaluation(float(totals[0]) / samples, metric_average(metric_fn, float(totals[1]) / float(totals[3])),
                      samples, shares.minibatches)


def _evaluate_objective(model: torch.nn.Module, source, minibatch_size: int, objective, comm, device: torch.device,
                        max_samples: int | None, binding, progress, collective: bool = False) -> Evaluation:
    """:func:`evaluate` with an objective: ``objective(model, minibatch)`` in eval mode without gradients, its
    loss and figures weighted by the target's samples, summed over the ranks once."""
    totals = torch.zeros(2, dtype=torch.float64)  # loss sum, samples
    figure_sums = None  # in the order of the objective's first call (training's, or this pass's)
    shares = _Shares(source, minibatch_size, comm, device, max_samples, binding, progress, collective)
    with _evaluating(model, source):
        for batch, _, samples, _ in shares:
            if samples == 0:  # an empty share of a collective forward (see evaluate)
                objective(model, batch, training=False)
                continue
            loss, figures = objective(model, batch, training=False)
            totals[0] += float(loss) * samples
            totals[1] += samples
            weighted = objective.figure_vector(figures, torch.device("cpu")) * samples
            figure_sums = weighted if figure_sums is None else figure_sums + weighted
    names = objective.figure_names or ()
    figure_sums = figure_sums if figure_sums is not None else torch.zeros(len(names), dtype=torch.float64)
    totals = comm.allreduce(torch.cat([totals, figure_sums]).to(comm.device), op="sum").cpu()
    samples = int(totals[1])
    if samples == 0:
        return Evaluation(float("nan"), float("nan"), 0, shares.minibatches)
    return Evaluation(float(totals[0]) / samples, float("nan"), samples, shares.minibatches,
                      {name: float(value) / samples for name, value in zip(names, totals[2:].tolist())})


@contextlib.contextmanager
def _evaluating(model: torch.nn.Module, source):
    """Eval mode and no gradients while an evaluation reads ``source``; after it (also on an error), the model's
    mode and the source's position as they were, so the next evaluation reads the same samples again."""
    position = source.get_checkpoint_state()
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        source.restore_from_checkpoint(position)
        model.train(was_training)


class _Shares:
    """This rank's shares of an evaluation's global minibatches, on ``device``, with their target and its counts
    (``(batch, target, samples, sequences)``; shares without target samples are skipped, but counted in
    ``minibatches``, unless ``collective``: then they come with 0 samples, for a forward every rank must make);
    ``progress(samples_read)`` after each share's work."""

    def __init__(self, source, minibatch_size: int, comm, device: torch.device, max_samples: int | None, binding,
                 progress: Callable[[int], None] | None, collective: bool = False):
        self.collective = collective
        self.source, self.minibatch_size, self.comm, self.device = source, minibatch_size, comm, device
        self.max_samples = max_samples
        self.binding = binding if binding is not None else StreamBinding()
        self.progress = progress
        self.minibatches = 0

    def __iter__(self):
        read = 0
        while self.max_samples is None or read < self.max_samples:
            size = self.minibatch_size if self.max_samples is None else min(self.minibatch_size, self.max_samples - read)
            batch = self.source.next_minibatch(size, self.comm.size, self.comm.rank)
            if batch is None:
                return
            read += batch.global_num_samples
            self.minibatches += 1
            if batch.num_sequences == 0 and not self.collective:
                continue
            batch = batch.to(self.device)
            if batch.num_sequences == 0:
                yield batch, None, 0, 0
                continue
            target = self.binding.target_of(batch)
            samples, sequences = count_steps(target)
            if samples == 0 and not self.collective:
                continue
            yield batch, target, samples, sequences
            if self.progress is not None:
                self.progress(read)


def metric_average(metric, mean: float) -> float:
    """The reported value of a metric whose sums averaged to ``mean``: ``metric.from_mean(mean)`` where it
    has one (a perplexity is ``exp`` of the mean log-loss), else ``mean``."""
    from_mean = getattr(metric, "from_mean", None)
    return float(from_mean(mean)) if from_mean is not None else mean
