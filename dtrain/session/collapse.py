"""Notices a classifier whose training collapsed back to chance, so a run never ends "normally" there.

A model trained with cross-entropy on C classes that predicts nothing useful has a mean loss of
about ``ln C`` (the uniform prediction) and an accuracy of about ``1/C``. 1-bit SGD started
without a warm start is known to go there after first learning (``docs/semantics.md#collapse``);
a NaN check does not see it, because every number stays finite. :class:`CollapseWatch` follows
the training loss per minibatch ON the device (no synchronisation per step) and, at progress
points and after the test pass, answers whether the run collapsed: the loss had clearly fallen
below chance (an exponential average at most half of ``ln C``) and has come back to it (a whole
progress period's mean loss at 90% of ``ln C`` or more), or a test pass is at chance (loss at 90%
of ``ln C`` or more, accuracy at most ``2 / C``) after the loss had fallen.

Only classification is watched: a 2-D output of C >= 2 columns, integer class labels and a loss
that gives a uniform prediction ``ln C`` (cross-entropy), or a sequence of class ids per step
(``[n, T, C]`` logits, :class:`~dtrain.session.SequenceCrossEntropy`: a language model or a decoder);
a regression loss, one-hot labels or any other shape is never judged.
"""
from __future__ import annotations

import math

import torch

from dtrain.data.streams import Sequences
from dtrain.session.objectives import SequenceCrossEntropy

#: the loss has "clearly fallen" once its running average is at most this fraction of ln C
FALLEN_FRACTION = 0.5
#: a progress period's mean loss at or above this fraction of ln C is back at chance
CHANCE_FRACTION = 0.9
#: weight of the newest minibatch in the running average (about 20 minibatches)
AVERAGE_WEIGHT = 0.05


def training_advice(learner, precision: str = "32") -> str:
    """What to change when training diverged or collapsed, naming only what this run uses: the learning
    rate always; a lossy exchange (its warm start, its bits) only when several ranks exchange that way;
    local SGD's warm start only for a block learner on several ranks; fp16 only in fp16."""
    several = learner.comm.size > 1
    exchange = getattr(learner, "exchange", None)
    causes, changes = ["a learning rate too high for this learner"], ["lower optimizer.lr"]
    if several and exchange is not None and getattr(exchange, "needs_warm_start", False):
        bits = getattr(exchange, "num_bits", None)
        what = f"{bits}-bit gradients" if bits is not None else f"gradients compressed by {exchange.describe()}"
        causes.append(f"{what} started too early")
        changes.append("give a longer full-precision warm start (learner.distributed_after=SAMPLES, 'auto' by default)")
        if bits is not None and bits < 32:
            changes.append(f"use more bits ({bits + 1} or more: learner.num_quantization_bits, or learner.exchange.num_bits "
                           f"with learner/exchange=quantized)")
    elif several and exchange is not None and not getattr(exchange, "lossless", True):
        causes.append(f"gradients compressed by {exchange.describe()}")
        changes.append("exchange them in float32 (learner/exchange=allreduce)")
    elif several and learner.kind in ("block_momentum", "diloco", "local_sgd", "two_level_diloco",
                                                  "two_level_local_sgd"):
        causes.append("local steps started from an untrained model")
        changes.append("train longer on one model first (learner.distributed_after=SAMPLES)")
    if precision == "fp16":
        causes.append("float16 overflowing (its largest value is 65,504)")
        changes.append("train in bf16 (session.precision=bf16)")
    return (f"the likely cause is {_listed(causes)}; {_listed(changes)}")


def _listed(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + f", or {items[-1]}"


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
        self._judged = False  # the task was inspected (first non-empty minibatch)
        self._average: torch.Tensor | None = None
        self._lowest = torch.tensor(math.inf, dtype=torch.float64, device=device)
        self._pending: list[torch.Tensor] = []  # detached losses not yet in the average
        self._operators: tuple[torch.Tensor, torch.Tensor] | None = None  # for fold_every losses; fewer take a slice

    def observe(self, output: torch.Tensor, labels: torch.Tensor, loss: torch.Tensor, loss_function) -> None:
        """Adds one minibatch's mean loss (a detached tensor, kept as it is; nothing is read back to the
        host after the first).

        The first minibatch decides whether the task is watched: only a cross-entropy loss
        (``torch.nn.functional.cross_entropy`` or a ``torch.nn.CrossEntropyLoss``), whose uniform
        prediction costs ``ln C``, over integer class labels. The user's loss is never called
        here (a loss may count its calls or keep state); any other loss is never judged.
        """
        if not self._judged:
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
        if self.chance_loss is None:
            return
        self._pending.append(loss)
        if len(self._pending) >= self.fold_every:
            self._fold()

    def _fold(self) -> None:
        """Advances the running average ``a <- (1 - w) a + w x`` over the kept losses, all at once,
        and the lowest average with every intermediate value (the first loss starts the average)."""
        if not self._pending:
            return
        values = torch.stack(self._pending).reshape(-1).to(torch.float64)
        self._pending = []
        if self._average is None:
            self._average = values[0].clone()
            torch.minimum(self._lowest, self._average, out=self._lowest)
            values = values[1:]
        if values.numel() == 0:
            return
        decay, weights = self._ema_operators(values.numel())
        averages = decay * self._average + weights @ values  # averages[t]: after values[0..t]
        self._average = averages[-1].clone()
        torch.minimum(self._lowest, averages.min(), out=self._lowest)

    def _ema_operators(self, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``decay[t] = (1 - w)^(t + 1)`` and ``weights[t, s] = w (1 - w)^(t - s)`` for ``s <= t < count``
        (``count`` at most ``fold_every``): the leading part of the operators made once for ``fold_every``."""
        if self._operators is None:
            steps = torch.arange(self.fold_every, dtype=torch.float64, device=self.device)
            keep = 1.0 - AVERAGE_WEIGHT
            lag = steps[:, None] - steps[None, :]
            self._operators = (keep ** (steps + 1), AVERAGE_WEIGHT * keep ** lag.clamp(min=0) * (lag >= 0))
        decay, weights = self._operators
        return decay[:count], weights[:count, :count]

    def lowest_average(self, comm) -> float:
        """The lowest running loss so far, the largest over ranks (a collective when several run)."""
        self._fold()
        lowest = self._lowest.clone()
        if comm.size > 1:
            lowest = comm.allreduce(lowest.to(comm.device), op="max")
        return float(lowest)

    def watching(self, comm) -> bool:
        """Whether a collapse can be judged (classification on every rank; a collective when several run)."""
        flag = torch.tensor([0.0 if self.chance_loss is None else 1.0], dtype=torch.float64)
        if comm.size > 1:
            flag = comm.allreduce(flag.to(comm.device), op="min").cpu()
        return bool(flag.item())

    def loss_collapsed(self, period_loss: float, comm) -> bool:
        """Whether a progress period's mean loss (the same on every rank) is back at chance after
        having clearly fallen. A collective when several ranks run, at progress points only."""
        if not self.watching(comm):
            return False
        fell = self.lowest_average(comm) <= FALLEN_FRACTION * self.chance_loss
        return fell and period_loss >= CHANCE_FRACTION * self.chance_loss

    def evaluation_collapsed(self, loss: float, accuracy: float | None, comm) -> bool:
        """Whether an evaluation (test or CV pass) is at chance after the training loss had clearly
        fallen: its mean loss at 90% of ``ln C`` or more and its accuracy at most ``2 / C`` (a
        collapsed model predicts one class, whose share of an unbalanced set can exceed ``1 / C``).
        ``accuracy`` ``None`` (a sequence model reported by another metric): the loss alone decides.
        A collective when several ranks run."""
        if not self.watching(comm) or not (math.isfinite(loss) and (accuracy is None or math.isfinite(accuracy))):
            return False
        fell = self.lowest_average(comm) <= FALLEN_FRACTION * self.chance_loss
        return fell and loss >= CHANCE_FRACTION * self.chance_loss and (accuracy is None
                                                                          or accuracy <= 2.0 / self.num_classes)


__all__ = ["CollapseWatch", "training_advice"]


def _is_cross_entropy(loss_function) -> bool:
    """Whether ``loss_function`` is torch's cross-entropy (the function, or the module with its defaults' meaning)."""
    return loss_function is torch.nn.functional.cross_entropy or (
        isinstance(loss_function, torch.nn.CrossEntropyLoss) and loss_function.reduction == "mean")
