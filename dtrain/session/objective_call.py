"""Your own objective in place of ``loss(model(inputs), target)``: ``objective(model, minibatch)`` returning the
MEAN loss over the minibatch's samples as a scalar tensor, or ``(loss, {name: figure})`` with figures to log
(``docs/objectives.md``).

:class:`ObjectiveCall` wraps the user's objective: it checks before training that it is callable as
``objective(model, minibatch)``, checks what it returns at the first call (one line naming the objective
and what it returned) and hands the loop ``(loss, figures)`` with the figures in one order, the first
call's, so that every period's sums line up across minibatches and ranks.
"""
from __future__ import annotations

import functools
import inspect
from collections.abc import Mapping

import torch

from dtrain.session.evaluate import classification_errors
from dtrain.session.metrics import CSV_COLUMNS
from dtrain.session.objectives import metric_name

#: what a figure may not be called: a column of the metrics files, or a key the train records already hold
RESERVED_FIGURE_NAMES = frozenset(CSV_COLUMNS) | {"padding", "bytes_between_hosts_per_step"}

_EXPECTED = "expected the mean loss as a scalar tensor, or (loss, {name: figure}) with scalar figures"


def objective_name(objective) -> str:
    """How messages name an objective: its function's or class's qualified name."""
    function = objective.func if isinstance(objective, functools.partial) else objective
    if inspect.isfunction(function) or inspect.ismethod(function):
        return f"{function.__module__}.{function.__qualname__}"
    return f"{type(function).__module__}.{type(function).__qualname__}"


def check_takes_model_and_minibatch(objective) -> None:
    """Raises ValueError (one line naming the objective and what is expected) unless ``objective`` can be
    called as ``objective(model, minibatch)``: a function of two arguments, a module whose ``forward``
    takes them, or an object whose ``__call__`` does."""
    if not callable(objective):
        raise ValueError(f"objective {objective!r} is a {type(objective).__name__}, not callable; expected a function "
                         f"or module called as objective(model, minibatch)")
    target = objective.forward if isinstance(objective, torch.nn.Module) else objective
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):  # a builtin without a signature: it is tried at the first minibatch
        return
    try:
        signature.bind(object(), object())
    except TypeError:
        raise ValueError(f"objective {objective_name(objective)}{signature} cannot be called as "
                         f"objective(model, minibatch); expected a function or module taking the model and the "
                         f"minibatch (two positional arguments) and returning the loss") from None


def _is_scalar(value) -> bool:
    """A real number: an int or float (not a bool), or a one-element real tensor."""
    if isinstance(value, torch.Tensor):
        return value.numel() == 1 and not value.is_complex() and value.dtype != torch.bool
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _described(value) -> str:
    """What an objective returned, in a few words, for a message."""
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)} (" + ", ".join(_described(v) for v in value[:3]) + ")"
    if isinstance(value, Mapping):
        return f"a {type(value).__name__} with keys {list(value)[:5]}"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return f"the number {value!r} (a Python number has no gradient)"
    return f"a {type(value).__name__}"


class ObjectiveCall:
    """``objective(model, minibatch) -> (loss, figures)``, checked.

    Args:
        objective: the user's objective (checked here: it must take ``(model, minibatch)``).

    Raises:
        ValueError: ``objective`` is not callable as ``objective(model, minibatch)``.
    """

    def __init__(self, objective):
        check_takes_model_and_minibatch(objective)
        self.function = objective
        self.name = objective_name(objective)
        self.figure_names: tuple[str, ...] | None = None  # the first call's, in its order

    def __repr__(self) -> str:
        return f"ObjectiveCall({self.name})"

    def __call__(self, model, minibatch, training: bool = True) -> tuple[torch.Tensor, dict]:
        """The loss (a scalar tensor) and the figures (name -> number or scalar tensor, in the first call's order).

        Raises:
            ValueError: the first call returned something else than a scalar tensor or ``(scalar, dict)`` of
                scalars (one line naming the objective and what it returned), a figure named like a metrics
                column, or a later call returned other figures than the first.
        """
        result = self.function(model, minibatch)
        if self.figure_names is None:
            self._check_first(result, training)
        if isinstance(result, tuple):
            loss, figures = result
            if tuple(figures) != self.figure_names:
                raise ValueError(f"objective {self.name} returned the figures {list(figures)} after "
                                 f"{list(self.figure_names)} at the first minibatch; expected the same names every "
                                 f"time")
            return loss.reshape(()), figures
        if self.figure_names:
            raise ValueError(f"objective {self.name} returned no figures after {list(self.figure_names)} at the "
                             f"first minibatch; expected the same names every time")
        return result.reshape(()), {}

    def _check_first(self, result, training: bool) -> None:
        """The first call's result: a scalar float tensor (with a gradient when training), or that and a
        mapping of string names to scalars none of which is named like a metrics column."""
        loss, figures = (result if isinstance(result, tuple) and len(result) == 2 else (result, {}))
        if not (isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.is_floating_point()) \
                or not isinstance(figures, Mapping) or not all(isinstance(key, str) for key in figures) \
                or not all(_is_scalar(value) for value in figures.values()):
            raise ValueError(f"objective {self.name} returned {_described(result)} at the first minibatch; {_EXPECTED}")
        if training and not loss.requires_grad:
            raise ValueError(f"objective {self.name} returned a loss that does not depend on the model's parameters "
                             f"(requires_grad is False) at the first minibatch; expected the loss computed from "
                             f"model(...) on the minibatch")
        for name in figures:
            if name in RESERVED_FIGURE_NAMES or not name:
                raise ValueError(f"objective {self.name} returned a figure named {name!r}, a column of the metrics "
                                 f"files of its own; give the figure another name")
        self.figure_names = tuple(figures)

    def figure_vector(self, figures: Mapping, device: torch.device) -> torch.Tensor:
        """The figures as one float64 vector (detached) on ``device``, in ``figure_names``' order."""
        values = [value.detach().reshape(()).to(device=device, dtype=torch.float64) if isinstance(value, torch.Tensor)
                  else torch.tensor(float(value), dtype=torch.float64, device=device) for value in figures.values()]
        return torch.stack(values) if values else torch.zeros(0, dtype=torch.float64, device=device)


__all__ = ["ObjectiveCall", "RESERVED_FIGURE_NAMES", "check_takes_model_and_minibatch", "objective_name"]


def loss_or_objective(loss, objective, metric, inputs, sync_batchnorm: bool) -> tuple[ObjectiveCall | None, object]:
    """The one rule for ``loss`` and ``objective``: exactly one of them. Returns the checked objective (``None``
    with a loss) and the metric (with a loss: classification errors by default; with an objective: none).

    Raises:
        ValueError: both or neither given; an objective with a ``metric``, non-default ``inputs`` or
            ``sync_batchnorm``; an objective that cannot be called as ``objective(model, minibatch)``.
    """
    if loss is not None and objective is not None:
        raise ValueError("training_session got both loss and objective; give one: loss(output, target), or "
                         "objective(model, minibatch) computing the loss itself")
    if objective is None:
        if loss is None:
            raise ValueError("training_session needs a loss, loss(output, target), or an objective, "
                             "objective(model, minibatch)")
        return None, classification_errors if metric is None else metric
    call = ObjectiveCall(objective)
    if metric is not None:
        raise ValueError(f"metric {metric_name(metric)} with objective {call.name}: a metric measures the model's "
                         f"output, which an objective does not hand out; return the figure from the objective "
                         f"instead (loss, {{name: figure}})")
    if inputs not in (("features",), ["features"], "features"):
        raise ValueError(f"session.inputs={inputs!r} with objective {call.name}: an objective receives the whole "
                         f"minibatch and calls the model itself; leave session.inputs at its default and read the "
                         f"streams in the objective")
    if sync_batchnorm:
        raise ValueError(f"sync_batchnorm with objective {call.name}: a rank without samples cannot take part in "
                         f"the objective's BatchNorm reductions; train it with a loss, or without sync_batchnorm")
    return call, None
