"""The config schemas of the losses and metrics (``conf/loss``, ``conf/metric``) and their value rules."""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Optional

from omegaconf import MISSING

from dtrain import checks
from dtrain.rules import KeyChecks, fraction as _fraction, register_rule, register_schema, settings_rule


# -- losses and metrics (conf/loss, conf/metric) ----------------------------------------------------
# Each option builds a callable with ``_target_``; your own goes in ``loss/NAME.yaml`` (or
# ``metric/NAME.yaml``) of a ``--config-dir`` and needs no schema.


@register_schema("schema/loss", "cross_entropy")
@dataclass
class CrossEntropyLossConfig:
    """``torch.nn.CrossEntropyLoss``: integer class labels, mean over the minibatch."""

    _target_: str = "torch.nn.CrossEntropyLoss"
    label_smoothing: float = 0.0


@register_schema("schema/loss", "mse")
@dataclass
class MSELossConfig:
    """``dtrain.session.MSELoss``: float regression targets, outputs ``[n, 1]`` meet labels ``[n]``."""

    _target_: str = "dtrain.session.MSELoss"


@register_schema("schema/loss", "sequence_cross_entropy")
@dataclass
class SequenceCrossEntropyConfig:
    """``dtrain.session.SequenceCrossEntropy``: cross-entropy over the real steps of a sequence target (token mean)."""

    _target_: str = "dtrain.session.SequenceCrossEntropy"
    label_smoothing: float = 0.0


@register_schema("schema/metric", "sequence_error")
@dataclass
class SequenceErrorConfig:
    """``dtrain.session.SequenceError``: sequences with any wrong step, averaged over sequences."""

    _target_: str = "dtrain.session.SequenceError"


@register_schema("schema/metric", "classification_error")
@dataclass
class ClassificationErrorConfig:
    """``dtrain.session.ClassificationError``: the fraction misclassified, reported as ``error``."""

    _target_: str = "dtrain.session.ClassificationError"


@register_schema("schema/metric", "perplexity")
@dataclass
class PerplexityConfig:
    """``dtrain.session.Perplexity``: exp of the mean cross-entropy per step (nats), reported as ``perplexity``."""

    _target_: str = "dtrain.session.Perplexity"


@register_schema("schema/metric", "wer")
@dataclass
class DecodingErrorsConfig:
    """``dtrain.session.DecodingErrors``: word and token error rates of decoded outputs (``wer``, ``per``),
    greedy or by a beam search of ``beam_size`` hypotheses."""

    _target_: str = "dtrain.session.DecodingErrors"
    source: str = MISSING
    references: Any = None
    name: str = "wer"
    token_name: str = "per"
    max_steps: Optional[int] = None
    end: Optional[int] = None
    beam_size: int = 1


@register_schema("schema/metric", "top5_error")
@dataclass
class TopKErrorConfig:
    """``dtrain.session.TopKError``: label not among the ``k`` largest outputs, reported as ``top<k>_error``."""

    _target_: str = "dtrain.session.TopKError"
    k: int = 5


@register_schema("schema/metric", "mean_abs_error")
@dataclass
class MeanAbsoluteErrorConfig:
    """``dtrain.session.MeanAbsoluteError``: for regression, reported as ``mean_abs_error``."""

    _target_: str = "dtrain.session.MeanAbsoluteError"


# -- losses and metrics
#: the value rules of dtrain's own losses and metrics, used by their constructors and by ``validate``
SEQUENCE_CROSS_ENTROPY: KeyChecks = {"label_smoothing": _fraction()}  # [0, 1)
TOP_K_ERROR: KeyChecks = {"k": partial(checks.whole_number, low=1, unit="classes")}

# torch's own constructor checks its label_smoothing; the config's rule allows torch's range, [0.0, 1.0]
register_rule("torch.nn.CrossEntropyLoss", settings_rule({"label_smoothing": _fraction(high_inclusive=True)}))
register_rule("dtrain.session.SequenceCrossEntropy", settings_rule(SEQUENCE_CROSS_ENTROPY))
register_rule("dtrain.session.TopKError", settings_rule(TOP_K_ERROR))
