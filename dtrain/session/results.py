"""What a training run ends with: the result ``train()`` returns, or the error it raises when training
diverged or collapsed."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dtrain.session.evaluate import Evaluation


class TrainingDiverged(RuntimeError):
    """The training loss became NaN or infinite (raised on every rank at a progress point)."""


class TrainingCollapsed(TrainingDiverged):
    """A classifier's training loss (or test accuracy) returned to chance after it had learned
    (``docs/semantics.md#collapse``); raised on every rank."""


@dataclass
class TrainingResult:
    """What a finished ``train()`` reports."""

    samples_seen: int
    minibatches: int
    seconds: float  # wall time of training and evaluation (without writing model.safetensors and report.png)
    stopped_early: bool
    test: Evaluation | None
    last_cross_validation: Evaluation | None
    last_checkpoint: Path | None
    metrics_path: Path | None
    restored_from: Path | None
    preempted: bool = False   # stopped by the preemption signal after saving a checkpoint
    last_training_error: float | None = None  # mean metric of the last progress period (all ranks)
    test_ema: Evaluation | None = None  # the test pass of the weight EMA (``ema_decay``), beside ``test``
    stop_reason: str | None = None  # why a callback stopped training (``stopped_early`` is then True)
    by_loss: bool = False  # an objective's run: no metric, its evaluations are judged by their loss

    @property
    def objective(self) -> float | None:
        """The run's final figure of merit, for sweeps: the test error, else the last
        cross-validation error, else the last training error (``None`` when nothing was measured); an
        objective's run (``by_loss``), which has no error rate: the test loss, else the last cross-validation's."""
        for evaluation in (self.test, self.last_cross_validation):
            if evaluation is not None:
                return evaluation.loss if self.by_loss else evaluation.error
        return self.last_training_error
