"""Knowledge distillation as an objective (``docs/objectives.md``): the student learns from a frozen teacher's
softened outputs and from the labels.

The loss of a minibatch is ``alpha * KL(teacher/T || student/T) * T^2 + (1 - alpha) * CE(student, labels)``
(Hinton et al., 2015): the ``T^2`` keeps the soft term's gradients on the scale of the hard term's as ``T``
changes. Both terms are means over the minibatch's samples (the real steps of a sequence target), so the loss
is weighted across ranks and micro-batches exactly as a loss's.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from dtrain.data.streams import Sequences
from dtrain.session.binding import StreamBinding
from dtrain.session.weights import load_weights

__all__ = ["Distillation"]


class Distillation:
    """``objective(model, minibatch)`` distilling ``teacher`` into the model being trained.

    The teacher is frozen: in eval mode, its parameters without gradients, run under ``no_grad``, moved to the
    training model's device at the first call; it is no part of the model, so it is never in the optimizer,
    a checkpoint's model weights or ``model.safetensors``.

    Args:
        teacher: the teacher model (a ``torch.nn.Module``; from the config, a ``_target_`` block).
        weights: its weights, a ``model.safetensors`` a finished run wrote (``None``: the teacher as given).
        temperature: ``T`` > 0, the softening of both models' outputs in the KL term.
        alpha: in [0, 1], the KL term's share of the loss (the labels' cross-entropy has the rest).
        inputs: the streams both models take (as ``session.inputs``: a list, a mapping or one stream).
        target: the labels' stream (as ``session.target``: class ids, per sample or per step).

    Raises:
        ValueError: a setting out of range, a ``teacher`` that is not a module, or ``weights`` missing or not
            the teacher's (one line naming the file).
    """

    def __init__(self, teacher: torch.nn.Module, weights: str | Path | None = None, temperature: float = 2.0,
                 alpha: float = 0.5, inputs=("features",), target: str = "labels"):
        if not isinstance(teacher, torch.nn.Module):
            raise ValueError(f"Distillation teacher: got a {type(teacher).__name__}; expected a torch.nn.Module "
                             f"(a _target_ block in the config)")
        if not (isinstance(temperature, (int, float)) and temperature > 0):
            raise ValueError(f"Distillation temperature={temperature!r}: expected a number above 0")
        if not (isinstance(alpha, (int, float)) and 0.0 <= alpha <= 1.0):
            raise ValueError(f"Distillation alpha={alpha!r}: expected a number in [0, 1] (the KL term's share)")
        if weights is not None:
            path = Path(weights)
            if not path.is_file():
                raise ValueError(f"Distillation weights={str(weights)!r}: no such file; expected the model.safetensors "
                                 f"a finished run of the teacher wrote")
            load_weights(teacher, path, f"the teacher ({type(teacher).__name__})")
        teacher.eval()
        teacher.requires_grad_(False)
        self.teacher = teacher
        self.temperature = float(temperature)
        self.alpha = float(alpha)
        self.binding = StreamBinding(inputs, target)
        self._teacher_on: torch.device | None = None

    def __repr__(self) -> str:
        return (f"Distillation(teacher={type(self.teacher).__name__}, temperature={self.temperature:g}, "
                f"alpha={self.alpha:g})")

    def __call__(self, model, minibatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The blended mean loss over ``minibatch``'s samples, with ``kl`` and ``cross_entropy`` as figures."""
        student = self.binding.forward(model, minibatch)
        self._move_teacher_to(student.device)
        with torch.no_grad():
            teacher = self.binding.forward(self.teacher, minibatch)
        labels = self.binding.target_of(minibatch)
        if isinstance(labels, Sequences):  # per-step logits [n, T, C]: the real steps only
            mask = labels.mask
            student, teacher = student[:, :mask.shape[1]][mask], teacher[:, :mask.shape[1]][mask]
            labels = labels.data[mask]
        student, teacher = student.float(), teacher.float()  # softmax of autocast outputs in float32
        temperature = self.temperature
        kl = F.kl_div(F.log_softmax(student / temperature, dim=-1), F.log_softmax(teacher / temperature, dim=-1),
                      log_target=True, reduction="batchmean") * temperature ** 2
        cross_entropy = F.cross_entropy(student, labels)
        loss = self.alpha * kl + (1.0 - self.alpha) * cross_entropy
        return loss, {"kl": kl.detach(), "cross_entropy": cross_entropy.detach()}

    def _move_teacher_to(self, device: torch.device) -> None:
        """Moves the teacher to where the student computes, once (and again if the student moves)."""
        if self._teacher_on != device:
            self.teacher.to(device)
            self._teacher_on = device
