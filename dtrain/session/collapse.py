"""Notices a classifier whose training collapsed back to chance, so a run never ends "normally" there.

A model trained with cross-entropy on C classes that predicts nothing useful has a mean loss of
about ``ln C`` (the uniform prediction) and an accuracy of about ``1/C``. 1-bit SGD started
without a warm start is known to go there after first learning (``docs/semantics.md#collapse``);
a NaN check does not see it, because every number stays finite. :class:`CollapseWatch` follows
the training loss per minibatch ON the device (no synchronisation per step) and, at progress
points and after the test pass, answers whether the run collapsed: the loss had clearly fallen
below chance (an exponential average at most half of ``ln C``) and has come back to it (a whole
progress period's mean loss at 90% of ``ln C`` or more); or the final test pass is at chance (loss
at 90% of ``ln C`` or more, accuracy at most ``2 / C``) after that fall, or, after 20 minibatches or
more and with the training loss back at chance too, after a smaller fall (to 85% of ``ln C``) or a
divergence (to 150% of it, half of ``ln C`` above where it started); or the final test loss is
at 90% of ``ln C`` or more at any accuracy after the training loss had fallen to 85% of ``ln C``
and then ended at twice its lowest or more. What is told in the summary
instead of refused: a test at chance after a loss that never left chance (a smoke run of a few
minibatches is one), a model that does not generalise, and a loss that ends at twice its best
with a test loss below 90% of ``ln C``.

At the end of training the running average alone decides too (:meth:`CollapseWatch.judge_training`),
for a run without a test pass or progress points: back at 90% of ``ln C`` or more after the fall or the
divergence above is a collapse; at chance without having left it is told as a warning.

Chance is ``ln C`` for classification: a 2-D output of C >= 2 columns, integer class labels and a loss
that gives a uniform prediction ``ln C`` (cross-entropy), or a sequence of class ids per step
(``[n, T, C]`` logits, :class:`~dtrain.session.SequenceCrossEntropy`: a language model or a decoder).
Any other scalar loss (a regression's, a classifier's of your own whose number of classes is not known)
has no such level: its chance is where it started, and only the end of training judges it, as a
collapse when the running average fell to half of the first minibatch's loss and ends at 90% of it or more.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch

from dtrain.advice import Advice
from dtrain.data.streams import Sequences
from dtrain.session.objectives import SequenceCrossEntropy

#: the loss has "clearly fallen" once its running average is at most this fraction of ln C
FALLEN_FRACTION = 0.5
#: a progress period's mean loss at or above this fraction of ln C is back at chance
CHANCE_FRACTION = 0.9
#: the running average ending at RISE_FACTOR times its lowest or more, and higher by RISE_FRACTION of ln C
#: or more: training became unstable (told as a warning at the end)
RISE_FACTOR = 2.0
RISE_FRACTION = 0.25
#: a final test pass at chance after the running average reached this fraction of ln C: it had learned
LEARNED_FRACTION = 0.85
#: a final test pass at chance after the running average reached this multiple of ln C, and rose by
#: DIVERGED_RISE of ln C above the first minibatch's loss: it had diverged (an initialisation whose
#: loss starts above ln C, e.g. a ResNet's, and falls from there has not)
DIVERGED_FRACTION = 1.5
DIVERGED_RISE = 0.5
#: a final test loss at this fraction of ln C or more (chance's loss), whatever the accuracy, after the training
#: loss had learned (LEARNED_FRACTION) and then rose at the end (RISE_FACTOR, RISE_FRACTION): training diverged
#: before it ended, and the run is refused rather than warned about
UNSTABLE_TEST_FRACTION = CHANCE_FRACTION
#: those end-of-run rules need this many minibatches (a smoke run of a few is judged only by the
#: fall to half of ln C)
END_RULES_MINIBATCHES = 20
#: weight of the newest minibatch in the running average (about 20 minibatches) when minibatches are small
AVERAGE_WEIGHT = 0.05
#: larger minibatches weigh ``1 - exp(-n / AVERAGE_SAMPLES)`` for n samples (sequences), so the average spans
#: about this many samples: 20 minibatches of 512 would be a third of a run, smoothing a fall or a divergence away
AVERAGE_SAMPLES = 640
#: any other loss (no ``ln C``): the running average at this fraction of the first minibatch's loss or more is
#: back at its start ...
START_FRACTION = CHANCE_FRACTION
#: ... after it had fallen to this fraction of it
START_FALLEN_FRACTION = FALLEN_FRACTION


def average_weight(samples: int) -> float:
    """The running average's weight of a minibatch of ``samples`` samples (on this rank): at least
    :data:`AVERAGE_WEIGHT`, and ``1 - exp(-samples / AVERAGE_SAMPLES)`` beyond (below 1)."""
    return min(max(AVERAGE_WEIGHT, -math.expm1(-samples / AVERAGE_SAMPLES)), 1.0 - 1e-9)


def training_advice(learner, precision: str = "32") -> str:
    """What to change when training diverged or collapsed, naming only what this run uses: what the learner
    declares (:meth:`~dtrain.learners.Learner.collapse_advice`: the learning rate, its exchange and its own
    steps on several ranks), and fp16 only in fp16."""
    advice = learner.collapse_advice()
    if precision == "fp16":
        advice += Advice(("float16 overflowing (its largest value is 65,504)",),
                         ("train in bf16 (session.precision=bf16)",))
    return advice.told()


class LossRecord(NamedTuple):
    """Where a run's training loss has been: its lowest and highest (running average or progress period),
    its first minibatch's, and the running average at the end."""

    lowest: float
    highest: float
    first: float
    final: float
    minibatches: int  # observed, the fewest of any rank


class CollapseWatch:
    """The running loss of a classifier, kept on the device, and the chance level it is judged against.

    ``chance_loss`` is ``ln C`` once a classification minibatch was seen (``None`` before or when
    the task is not classification). Each minibatch's loss is only kept; every ``fold_every``
    minibatches (and before a judgement) the kept losses advance the running average in one
    matrix product, which costs a training step far less than a few tensor operations each.
    """

    def __init__(self, device: torch.device, fold_every: int = 64):
        self.device = device
        self.fold_every = fold_every
        self.chance_loss: float | None = None
        self.num_classes = 0
        self.from_start = False  # any other scalar loss: judged against its start, at the end of training only
        self._judged = False  # the task was inspected (first non-empty minibatch)
        self._average: torch.Tensor | None = None
        self._lowest = torch.tensor(math.inf, dtype=torch.float64, device=device)
        self._highest = torch.tensor(-math.inf, dtype=torch.float64, device=device)
        self._first = torch.tensor(-math.inf, dtype=torch.float64, device=device)  # the first minibatch's loss
        self._minibatches = 0  # observed on this rank (one without samples in a minibatch observes none)
        # progress periods' mean losses (all ranks'), lowest and highest: with large minibatches the running
        # average spans a good part of the run and smooths a short fall or a divergence away
        self._period_extremes = (math.inf, -math.inf)
        self._watched = False  # the first minibatch showed a task to judge (chance_loss, or from_start)
        self._pending: list[torch.Tensor] = []  # detached losses not yet in the average
        self._pending_sizes: list[int] = []  # and their minibatches' sizes (their weights, from the sizes, at the fold)
        self._weights_by_size: dict[int, float] = {}  # average_weight by minibatch size, computed once each
        self._operators: tuple[tuple[float, ...], torch.Tensor, torch.Tensor] | None = None  # the last weights' operators

    def observe(self, output: torch.Tensor, labels: torch.Tensor, loss: torch.Tensor, loss_function,
                size: int | None = None) -> None:
        """Adds one minibatch's mean loss (a detached tensor, kept as it is; nothing is read back to the
        host after the first); ``size``: its sequences (samples without sequences), its weight in the
        running average (``None``: the labels' first dimension, else the output's, else 1).

        The first minibatch decides whether the task is watched: only a cross-entropy loss
        (``torch.nn.functional.cross_entropy`` or a ``torch.nn.CrossEntropyLoss``), whose uniform
        prediction costs ``ln C``, over integer class labels. The user's loss is never called
        here (a loss may count its calls or keep state); any other loss is never judged.
        """
        if not self._judged:
            self._judge_task(output, labels, loss, loss_function)
        if not self._watched:
            return
        self._pending.append(loss)
        self._pending_sizes.append(_minibatch_size(output, labels) if size is None else size)
        if len(self._pending) >= self.fold_every:
            self._fold()

    def _judge_task(self, output, labels, loss: torch.Tensor, loss_function) -> None:
        """Once, on the first minibatch: classification (``chance_loss``), another scalar loss (``from_start``), or
        nothing to watch."""
        self._judged = True
        if (_is_cross_entropy(loss_function) and isinstance(output, torch.Tensor) and isinstance(labels, torch.Tensor)
                and output.dim() == 2 and output.shape[1] >= 2
                and labels.dim() == 1 and not labels.is_floating_point() and not labels.is_complex()):
            self.num_classes = int(output.shape[1])
            self.chance_loss = math.log(self.num_classes)
        elif (isinstance(loss_function, SequenceCrossEntropy) and isinstance(labels, Sequences)
              and isinstance(output, torch.Tensor) and output.dim() == 3 and output.shape[-1] >= 2
              and labels.data.dim() == 2 and not labels.data.is_floating_point()):
            # a sequence of class ids (next character, next phoneme): chance is ln C per step as well
            self.num_classes = int(output.shape[-1])
            self.chance_loss = math.log(self.num_classes)
        else:  # regression, or a loss of your own: its own start is the level it must not return to
            self.from_start = (isinstance(loss, torch.Tensor) and loss.numel() == 1
                               and loss.is_floating_point())
        self._watched = self.chance_loss is not None or self.from_start

    def _fold(self) -> None:
        """Advances the running average ``a <- (1 - w) a + w x`` over the kept losses, all at once, and the
        lowest and highest average with every intermediate value (the first loss starts the average)."""
        if not self._pending:
            return
        pending = self._pending
        try:
            values = torch.stack(pending)
        except RuntimeError:  # losses of several shapes, each of one element (``[]``, ``[1]``)
            values = torch.stack([value.reshape(()) for value in pending])
        values = values.reshape(-1).to(torch.float64)
        weights_by_size = self._weights_by_size
        for size in set(self._pending_sizes).difference(weights_by_size):
            weights_by_size[size] = average_weight(size)
        weights = tuple(weights_by_size[size] for size in self._pending_sizes)
        self._minibatches += len(pending)
        self._pending, self._pending_sizes = [], []
        if self._average is None:
            self._average = values[0].clone()
            self._first = values[0].clone()
            torch.minimum(self._lowest, self._average, out=self._lowest)
            torch.maximum(self._highest, self._average, out=self._highest)
            values, weights = values[1:], weights[1:]
        if values.numel() == 0:
            return
        decay, mixing = self._ema_operators(weights)
        averages = decay * self._average + mixing @ values  # averages[t]: after values[0..t]
        self._average = averages[-1].clone()
        torch.minimum(self._lowest, averages.min(), out=self._lowest)
        torch.maximum(self._highest, averages.max(), out=self._highest)

    def _ema_operators(self, weights: tuple[float, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """``decay[t] = prod_{s <= t} (1 - w_s)`` and ``mixing[t, s] = w_s prod_{s < r <= t} (1 - w_r)`` for
        ``s <= t``, from the kept losses' weights (made on the host; kept for the next fold with the same ones)."""
        if self._operators is None or self._operators[0] != weights:
            w = torch.tensor(weights, dtype=torch.float64)
            kept = torch.cumsum(torch.log1p(-w), 0)  # log prod_{r <= t} (1 - w_r)
            lag = kept[:, None] - kept[None, :]  # log prod_{s < r <= t} (1 - w_r)
            steps = torch.arange(len(weights))
            mixing = torch.where(steps[:, None] >= steps[None, :], w[None, :] * lag.clamp(max=0).exp(), 0.0)
            self._operators = (weights, kept.exp().to(self.device), mixing.to(self.device))
        return self._operators[1], self._operators[2]

    def lowest_average(self, comm) -> float:
        """The lowest running loss so far, the largest over ranks (a collective when several run)."""
        return self.record(comm).lowest

    def record(self, comm) -> LossRecord:
        """Where the training loss has been (:class:`LossRecord`): of the running average, the largest
        lowest, the smallest highest, the largest first and the smallest final over ranks, and the fewest
        minibatches observed (so every rank judges alike, on what all saw), with the progress periods'
        means (the same on every rank) in the lowest and highest. One collective when several ranks run."""
        self._fold()
        final = self._average if self._average is not None else torch.tensor(-math.inf, dtype=torch.float64)
        count = torch.tensor(float(self._minibatches), dtype=torch.float64, device=self._lowest.device)
        values = torch.stack([self._lowest, -self._highest, self._first, -final.to(self._lowest.device), -count])
        if comm.size > 1:
            values = comm.allreduce(values.to(comm.device), op="max")
        lowest, highest, first, final, count = (float(value) for value in values)
        return LossRecord(min(lowest, self._period_extremes[0]), max(-highest, self._period_extremes[1]), first, -final,
                          int(-count))

    def judge_training(self, comm) -> tuple[str, LossRecord] | None:
        """Where the training loss ended, from its running average alone (what a run without a test pass or
        progress points has), with the record it was judged on. Classification, after 20 minibatches or more
        (or after a fall to half of ``ln C``), ending at 90% of ``ln C`` or more: ``"fallen"`` when it had fallen
        to 85% of ``ln C`` (or half of it), ``"diverged"`` when it had risen to 150% of ``ln C`` and half of
        ``ln C`` above its first minibatch's loss (both collapses), else ``"never_learned"`` (a warning). Any
        other loss, after 20 minibatches or more: ``"back_at_start"`` when it had fallen to half of the first
        minibatch's loss (positive) and ends at 90% of it or more. ``None`` otherwise. A collective when several
        ranks run (on every rank alike). ``"not_finite"``: the running average is NaN or infinite (a minibatch's
        loss was), for any task."""
        flags = torch.tensor([0.0 if self.chance_loss is None else 1.0, 1.0 if self.from_start else 0.0],
                             dtype=torch.float64)
        if comm.size > 1:
            flags = comm.allreduce(flags.to(comm.device), op="min").cpu()
        classes, from_start = (bool(flag) for flag in flags.tolist())
        if not (classes or from_start):
            return None
        record = self.record(comm)
        if record.minibatches == 0:
            return None
        if not math.isfinite(record.final):  # a NaN or infinite loss that no progress point saw
            return "not_finite", record
        enough = record.minibatches >= END_RULES_MINIBATCHES
        if classes:
            chance = self.chance_loss
            if not record.final >= CHANCE_FRACTION * chance:
                return None
            if record.lowest <= FALLEN_FRACTION * chance or (enough and record.lowest <= LEARNED_FRACTION * chance):
                return "fallen", record
            if not enough:
                return None
            if record.highest >= DIVERGED_FRACTION * chance and record.highest >= record.first + DIVERGED_RISE * chance:
                return "diverged", record
            return "never_learned", record
        start = record.first
        if (enough and math.isfinite(start) and start > 0 and record.lowest <= START_FALLEN_FRACTION * start
                and record.final >= START_FRACTION * start):
            return "back_at_start", record
        return None

    def how_far_it_fell(self, lowest: float, subject: str = "the training loss") -> str:
        """The training loss's lowest against chance, for a warning: "never left chance" only when it stayed at
        90% of ``ln C`` or more (what "at chance" means here), else how far it fell."""
        share = f"{lowest / self.chance_loss:.0%} of ln {self.num_classes}"
        if lowest >= CHANCE_FRACTION * self.chance_loss:
            return f"{subject} never left chance ({lowest:.4f} at its lowest, {share}), so the model learned nothing"
        return f"{subject} fell only to {lowest:.4f} at its lowest ({share}), so the model learned almost nothing"

    def chance(self) -> str:
        """``chance for 10 classes (ln 10 = 2.3026)``, the level a classifier is judged against."""
        return f"chance for {self.num_classes} classes (ln {self.num_classes} = {self.chance_loss:.4f})"

    def against_chance(self, loss: float) -> str:
        """Where a loss at 90% of ``ln C`` or more stands: ``back at chance for ...``, or, from 150% of ``ln C`` on,
        ``above chance for ...: worse than a uniform guess``."""
        if loss >= DIVERGED_FRACTION * self.chance_loss:
            return f"above {self.chance()}: worse than a uniform guess"
        return f"back at {self.chance()}"

    def watching(self, comm) -> bool:
        """Whether a collapse can be judged (classification on every rank; a collective when several run)."""
        flag = torch.tensor([0.0 if self.chance_loss is None else 1.0], dtype=torch.float64)
        if comm.size > 1:
            flag = comm.allreduce(flag.to(comm.device), op="min").cpu()
        return bool(flag.item())

    def loss_collapsed(self, period_loss: float, comm) -> bool:
        """Whether a progress period's mean loss (the same on every rank) is back at chance after
        having clearly fallen. A collective when several ranks run, at progress points only."""
        if math.isfinite(period_loss):
            low, high = self._period_extremes
            self._period_extremes = (min(low, period_loss), max(high, period_loss))
        if not self.watching(comm):
            return False
        fell = self.lowest_average(comm) <= FALLEN_FRACTION * self.chance_loss
        return fell and period_loss >= CHANCE_FRACTION * self.chance_loss

    def rise_at_the_end(self, comm) -> tuple[float, float] | None:
        """``(final, lowest)`` running average when training ended well above its best (at least twice the
        lowest and higher by a quarter of ``ln C``): the run became unstable and its model is worse than it
        was. ``None`` otherwise, when the task is not judged, or after fewer than 20 minibatches. A collective
        when several ranks run."""
        if not self.watching(comm):
            return None
        record = self.record(comm)  # on every rank alike (a collective), before any rank may decline
        return (record.final, record.lowest) if self._rose_at_the_end(record) else None

    def _rose_at_the_end(self, record: LossRecord) -> bool:
        """Whether the running average ended at twice its lowest (or progress period's mean) or more, and a
        quarter of ``ln C`` above it, after 20 minibatches or more."""
        lowest, final = record.lowest, record.final
        return (record.minibatches >= END_RULES_MINIBATCHES and final >= RISE_FACTOR * lowest
                and final >= lowest + RISE_FRACTION * self.chance_loss)

    def judge_evaluation(self, loss: float, accuracy: float | None, comm) -> str | None:
        """How a final evaluation (the test pass) stands against chance: ``None`` when it is neither at chance
        nor unstable (or the task is not judged); else ``"fallen"`` or ``"diverged"`` when the running training loss
        had left chance (at most half of ``ln C``; or, after 20 minibatches or more and with the running
        average back at 90% of ``ln C`` at the end, at most 85% of it, or at least 150% of it and half of it
        above the first minibatch's loss: the run is refused); else ``"unstable"`` when its loss is at 90% of
        ``ln C`` or more (at any accuracy) after the training loss had fallen to 85% of ``ln C`` and
        then rose at the end (:meth:`rise_at_the_end`; refused too); ``"only_training"`` when the training loss fell
        that far but does not end at chance (the model does not generalise), or ``"never_learned"`` (both
        told as a warning). At chance: a mean loss of 90% of ``ln C`` or more and
        an accuracy of at most ``2 / C`` (a collapsed model predicts one class, whose share of an
        unbalanced set can exceed ``1 / C``). ``accuracy`` ``None`` (a sequence model reported by
        another metric): the loss alone decides. A collective when several ranks run."""
        if not self.watching(comm) or not (math.isfinite(loss) and (accuracy is None or math.isfinite(accuracy))):
            return None
        record = self.record(comm)
        # chance's loss after the training loss learned and then rose: refused at any accuracy
        unstable = (loss >= UNSTABLE_TEST_FRACTION * self.chance_loss
                    and record.lowest <= LEARNED_FRACTION * self.chance_loss and self._rose_at_the_end(record))
        at_chance = loss >= CHANCE_FRACTION * self.chance_loss and (accuracy is None
                                                                      or accuracy <= 2.0 / self.num_classes)
        if at_chance:
            if record.lowest <= FALLEN_FRACTION * self.chance_loss:
                return "fallen"
            # the rules for a smaller fall or a divergence ask more: enough minibatches, and the training loss
            # itself back at chance at the end (a hard task that overfits ends low on training data)
            if record.minibatches >= END_RULES_MINIBATCHES and record.final >= CHANCE_FRACTION * self.chance_loss:
                if record.lowest <= LEARNED_FRACTION * self.chance_loss:
                    return "fallen"
                if (record.highest >= DIVERGED_FRACTION * self.chance_loss
                        and record.highest >= record.first + DIVERGED_RISE * self.chance_loss):
                    return "diverged"
        if unstable:
            return "unstable"
        if not at_chance:
            return None
        return "only_training" if record.lowest <= LEARNED_FRACTION * self.chance_loss else "never_learned"

    def evaluation_collapsed(self, loss: float, accuracy: float | None, comm) -> bool:
        """Whether a final evaluation is at chance after the training loss had left it (see
        :meth:`judge_evaluation`). A collective when several ranks run."""
        return self.judge_evaluation(loss, accuracy, comm) in ("fallen", "diverged", "unstable")


__all__ = ["CollapseWatch", "LossRecord", "average_weight", "training_advice"]


def _minibatch_size(output, labels) -> int:
    """The samples (sequences) of one minibatch on this rank, for its weight in the running average: the
    labels' first dimension, else the output's, else 1 (a target the loss reads from the minibatch itself)."""
    for tensor in (labels.data if isinstance(labels, Sequences) else labels, output):
        if isinstance(tensor, torch.Tensor) and tensor.dim() > 0:
            return int(tensor.shape[0])
    return 1


def _is_cross_entropy(loss_function) -> bool:
    """Whether ``loss_function`` is torch's cross-entropy (the function, or the module with its defaults' meaning)."""
    return loss_function is torch.nn.functional.cross_entropy or (
        isinstance(loss_function, torch.nn.CrossEntropyLoss) and loss_function.reduction == "mean")
