"""The config schemas of the exchange strategies (``conf/learner/exchange``) and their value rules."""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Optional


from dtrain import checks
from dtrain.rules import KeyChecks, StrictBool, register_rule, register_schema, settings_rule


# -- exchange strategies (conf/learner/exchange: ``learner/exchange=NAME``) --------------------------


@register_schema("schema/learner/exchange", "allreduce")
@dataclass
class AllReduceExchangeConfig:
    """``dtrain.exchange.AllReduce``: a full-precision SUM all-reduce."""

    _target_: str = "dtrain.exchange.AllReduce"


@register_schema("schema/learner/exchange", "quantized")
@dataclass
class QuantizedExchangeConfig:
    """``dtrain.exchange.Quantized``: k-bit codes with two-sided error feedback."""

    _target_: str = "dtrain.exchange.Quantized"
    num_bits: int = 1
    error_feedback: StrictBool = True
    requantize_sum: Any = "auto"        # true: CNTK's two phases; false: every worker sums every worker's codes;
    #                                     auto: false at 2 workers and at 1 bit up to 8 (docs/semantics.md#two-phase-exchange)


@register_schema("schema/learner/exchange", "compressed")
@dataclass
class CompressedExchangeConfig:
    """``dtrain.exchange.CompressedAllReduce``: the pre-divided gradients all-reduced as bf16 or fp16."""

    _target_: str = "dtrain.exchange.CompressedAllReduce"
    dtype: str = "bf16"                 # bf16 or fp16


@register_schema("schema/learner/exchange", "powersgd")
@dataclass
class PowerSGDExchangeConfig:
    """``dtrain.exchange.PowerSGD``: rank-r low-rank compression with error feedback and warm start
    (PyTorch's ``powerSGD_hook``, same defaults)."""

    _target_: str = "dtrain.exchange.PowerSGD"
    matrix_approximation_rank: Any = 1  # or "auto": from the gradient at the switch (learner=powersgd's default)
    start_powersgd_iter: Any = None     # exchange steps (minibatches; syncs of block learners) of plain all-reduce
    #                                     first, or "auto": 10% of the run's; null: torch's 1000 minibatches, auto for syncs
    min_compression_rate: float = 2.0
    use_error_feedback: Optional[StrictBool] = None  # null: on for minibatch steps (torch's), off for block learners' syncs
    warm_start: StrictBool = True
    orthogonalization_epsilon: float = 0.0
    random_seed: int = 0


@register_schema("schema/learner/exchange", "sparse")
@dataclass
class SparseExchangeConfig:
    """``dtrain.exchange.Sparse``: SparseLoCo's chunked top-k in k-bit values with decaying error feedback."""

    _target_: str = "dtrain.exchange.Sparse"
    chunk_size: int = 4096              # values per chunk
    top_k: int = 64                     # values each chunk keeps (64 of 4096: 1.6%)
    num_bits: int = 2                   # bits per kept value
    decay: float = 0.95                 # the error-feedback buffer's factor per step (1: plain error feedback)


#: each strategy's value rules, used by its constructor (``check_settings``) and by ``validate``
QUANTIZED: KeyChecks = {
    "num_bits": partial(checks.whole_number, low=1, high=32, unit="bits"),
    "error_feedback": checks.boolean,
    "requantize_sum": checks.boolean_or_auto,
}


register_rule("dtrain.exchange.Quantized", settings_rule(QUANTIZED))

SPARSE: KeyChecks = {
    "chunk_size": partial(checks.whole_number, low=2, unit="values"),
    "top_k": partial(checks.whole_number, low=1, unit="values"),
    "num_bits": partial(checks.whole_number, low=1, high=32, unit="bits"),
    "decay": lambda name, value: checks.number_in_range(name, checks.positive_number(name, value), 0.0, 1.0),
}


register_rule("dtrain.exchange.Sparse", settings_rule(SPARSE))


def _wire_dtype(name: str, value: Any) -> str:
    """The type compressed gradients travel as: bf16 or fp16."""
    if not isinstance(value, str) or value not in ("bf16", "fp16"):
        raise ValueError(f"{name}={value!r}: expected bf16 or fp16")
    return value


COMPRESSED: KeyChecks = {"dtype": _wire_dtype}


register_rule("dtrain.exchange.CompressedAllReduce", settings_rule(COMPRESSED))


def _steps_or_auto(name: str, value):
    """A whole number of steps (>= 0), ``"auto"``, or null (the learner's default)."""
    if value == "auto" or value is None:
        return value
    try:
        return checks.whole_number(name, value, low=0, unit="steps")
    except ValueError as error:
        raise ValueError(f"{error}, auto or null") from None


def _rank_or_auto(name: str, value):
    """A whole number >= 1, or ``"auto"`` (chosen from the gradient when compression starts)."""
    if value == "auto":
        return value
    try:
        return checks.whole_number(name, value, low=1)
    except ValueError as error:
        raise ValueError(f"{error} or auto") from None


POWERSGD: KeyChecks = {
    "matrix_approximation_rank": _rank_or_auto,
    "start_powersgd_iter": _steps_or_auto,
    "min_compression_rate": checks.positive_number,
    "use_error_feedback": partial(checks.boolean, allow_none=True),
    "warm_start": checks.boolean,
    "orthogonalization_epsilon": partial(checks.positive_number, allow_zero=True),
    "random_seed": partial(checks.whole_number, low=0),
}


register_rule("dtrain.exchange.PowerSGD", settings_rule(POWERSGD))
