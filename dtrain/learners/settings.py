"""The config schemas of the learners (``conf/learner``) and their value rules, registered per ``_target_``."""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

from dtrain import checks
from dtrain.rules import (KeyChecks, StrictBool, fraction as _fraction, plain, register_rule, register_schema,
                          settings_problems, settings_rule)


# -- learners -------------------------------------------------------------------------------------


@register_schema("schema/learner", "local")
@dataclass
class LocalLearnerConfig:
    """The torch optimizer alone, one process: ``dtrain.learners.Learner``."""

    _target_: str = "dtrain.learners.Learner"
    distributed_after: int = 0


@register_schema("schema/learner", "data_parallel")
@dataclass
class DataParallelLearnerConfig:
    """``data_parallel_distributed_learner``: gradients averaged over all workers every minibatch.

    ``exchange`` is the strategy that sums each gradient bucket (``learner/exchange=NAME``, one
    of the schemas below; float32 all-reduce when unset). ``learner=quantized`` is this learner with
    the k-bit exchange (1-bit SGD: ``learner.exchange.num_bits``).
    """

    _target_: str = "dtrain.learners.data_parallel_distributed_learner"
    distributed_after: Any = "auto"     # samples, or "auto": a warm start relative to the run for k-bit, else none
    bucket_size_mb: float = 25.0
    exchange: Any = None                # learner/exchange=allreduce|bf16|fp16|quantized|powersgd
    warm_start_mode: Optional[str] = None  # a compressing exchange's warm start: allreduce (null: this) or local (CNTK's)
    freeze_variance: Any = "auto"       # Adam's variance held from the warm start's end (1-bit Adam); auto: 1-bit sums only


@register_schema("schema/learner", "fsdp")
@dataclass
class FSDPLearnerConfig:
    """``dtrain.learners.fsdp_learner``: parameters, gradients and optimizer state sharded over the ranks (FSDP2),
    the update of ``data_parallel``."""

    _target_: str = "dtrain.learners.fsdp_learner"
    wrap: Any = "blocks"                # the units: blocks (ModuleList elements), children, or [ClassName, ...]
    reshard_after_forward: StrictBool = True  # free gathered parameters after forward (gathered again for backward)
    param_dtype: str = "float32"        # the dtype units compute in: float32 or bfloat16 (shards stay float32)
    reduce_dtype: str = "float32"       # the dtype gradients are reduce-scattered in: float32 or bfloat16
    cpu_offload: StrictBool = False     # shards, gradients and the optimizer step on the CPU (GPU runs only)
    activation_checkpointing: StrictBool = False  # each unit's activations recomputed in backward
    shard_over: str = "job"             # job: every rank holds 1/N; host: HSDP, 1/R inside each host, hosts replicate


@register_schema("schema/learner", "block_momentum")
@dataclass
class BlockMomentumLearnerConfig:
    """``block_momentum_distributed_learner`` (BMUF): local steps, a filtered model sync every block."""

    _target_: str = "dtrain.learners.block_momentum_distributed_learner"
    block_size: Any = "auto"            # samples, or "auto": within CNTK's bound from the data set's size and N
    block_momentum_as_time_constant: Optional[float] = None
    use_nesterov_momentum: StrictBool = True
    reset_sgd_momentum_after_aggregation: StrictBool = True
    block_learning_rate: float = 1.0
    distributed_after: Any = "auto"     # samples, or "auto": a warm start relative to the run (printed at start-up)
    exchange: Any = None                # learner/exchange=NAME: the strategy that sums the block deltas (fp32: allreduce)
    local_learning_rate: str = "full"   # local steps at optimizer.lr, or "share": lr x the worker's share (CNTK's)
    momentum_correction: StrictBool = True  # sg x (this block's lr / the last's) when the schedule changes the lr
    outer_optimizer: Any = None         # learner/outer_optimizer=NAME: another outer step in place of BMUF's filter
    overlap: StrictBool = False         # each block's exchange runs while the next block trains (one block late)


@register_schema("schema/learner", "diloco")
@dataclass
class DiLoCoLearnerConfig:
    """``dtrain.learners.DiLoCoLearner``: block momentum's blocks with DiLoCo's outer Nesterov SGD step."""

    _target_: str = "dtrain.learners.DiLoCoLearner"
    block_size: Any = "auto"            # samples per block (H inner steps x global minibatch), or "auto"
    outer_learning_rate: float = 0.7    # DiLoCo's outer SGD learning rate
    outer_momentum: float = 0.9         # DiLoCo's outer Nesterov momentum
    outer_nesterov: StrictBool = True
    distributed_after: Any = "auto"     # samples, or "auto": a warm start relative to the run (printed at start-up)
    exchange: Any = None                # learner/exchange=NAME: the strategy that sums the block deltas
    momentum_correction: StrictBool = True  # velocity x (this block's lr / the last's) when the schedule changes it
    outer_optimizer: Any = None         # learner/outer_optimizer=NAME: another outer step in place of DiLoCo's SGD
    overlap: StrictBool = False         # each block's exchange runs while the next block trains (one block late)


@register_schema("schema/learner", "local_sgd")
@dataclass
class LocalSGDLearnerConfig:
    """``dtrain.learners.LocalSGDLearner``: local steps, the workers' models averaged every block."""

    _target_: str = "dtrain.learners.LocalSGDLearner"
    block_size: Any = "auto"            # samples per block, or "auto" (block momentum's rule)
    distributed_after: Any = "auto"     # samples, or "auto": a warm start relative to the run (printed at start-up)
    exchange: Any = None                # learner/exchange=NAME: the strategy that sums the block deltas
    outer_optimizer: Any = None         # learner/outer_optimizer=NAME: an outer step in place of the average
    overlap: StrictBool = False         # each block's exchange runs while the next block trains (one block late)


@register_schema("schema/learner", "two_level_diloco")
@dataclass
class TwoLevelDiLoCoLearnerConfig(DiLoCoLearnerConfig):
    """``dtrain.learners.TwoLevelDiLoCoLearner``: exact data parallel inside each host (``comm.ranks_per_host``
    or the launcher's), DiLoCo between the hosts."""

    _target_: str = "dtrain.learners.TwoLevelDiLoCoLearner"
    shard: StrictBool = False           # each host's model sharded over its ranks (FSDP2), the outer scheme on the slices
    wrap: Any = "blocks"                # with shard: the FSDP units (blocks, children, or [ClassName, ...])


@register_schema("schema/learner", "two_level_block_momentum")
@dataclass
class TwoLevelBlockMomentumLearnerConfig(BlockMomentumLearnerConfig):
    """``dtrain.learners.TwoLevelBlockMomentumLearner``: exact data parallel inside each host, BMUF between hosts."""

    _target_: str = "dtrain.learners.TwoLevelBlockMomentumLearner"
    shard: StrictBool = False           # each host's model sharded over its ranks (FSDP2), the outer scheme on the slices
    wrap: Any = "blocks"                # with shard: the FSDP units (blocks, children, or [ClassName, ...])


@register_schema("schema/learner", "two_level_local_sgd")
@dataclass
class TwoLevelLocalSGDLearnerConfig(LocalSGDLearnerConfig):
    """``dtrain.learners.TwoLevelLocalSGDLearner``: exact data parallel inside each host, local SGD between hosts."""

    _target_: str = "dtrain.learners.TwoLevelLocalSGDLearner"
    shard: StrictBool = False           # each host's model sharded over its ranks (FSDP2), the outer scheme on the slices
    wrap: Any = "blocks"                # with shard: the FSDP units (blocks, children, or [ClassName, ...])


@register_schema("schema/learner", "two_level_data_parallel")
@dataclass
class TwoLevelDataParallelLearnerConfig:
    """``dtrain.learners.TwoLevelDataParallelLearner``: every step, gradients summed exactly inside each host
    and by the exchange strategy between the host leaders (``learner=two_level_quantized``, ``two_level_powersgd``)."""

    _target_: str = "dtrain.learners.TwoLevelDataParallelLearner"
    distributed_after: Any = "auto"     # samples, or "auto": a float32 warm start relative to the run for k-bit, else none
    bucket_size_mb: float = 25.0
    exchange: Any = None                # learner/exchange=NAME: the strategy between the host leaders (float32 when unset)
    warm_start_mode: Optional[str] = None  # a compressing exchange's warm start: allreduce (null: this) or local
    freeze_variance: Any = "auto"       # Adam's variance held from the warm start's end (1-bit Adam); auto: 1-bit sums only


# -- learners
def _samples_or_auto(name: str, value, **options):
    """A sample count, or ``"auto"`` (the learner derives it from the run and prints it at start-up)."""
    if value == "auto":
        return value
    try:
        return checks.sample_count(name, value, **options)
    except ValueError as error:
        raise ValueError(f"{error} or auto") from None


#: each learner's value rules, used by its constructor (``check_settings``) and by ``validate``
DISTRIBUTED_AFTER: KeyChecks = {"distributed_after": partial(_samples_or_auto, allow_zero=True)}
QUANTIZATION_BITS: KeyChecks = {"num_quantization_bits": partial(checks.whole_number, low=1, high=32, unit="bits")}
BUCKETS: KeyChecks = {"bucket_size_mb": partial(checks.positive_number, unit="MiB")}
FREEZE_VARIANCE: KeyChecks = {"freeze_variance": checks.boolean_or_auto}
DATA_PARALLEL: KeyChecks = {**DISTRIBUTED_AFTER, **BUCKETS, **FREEZE_VARIANCE}
BLOCK_SIZE: KeyChecks = {"block_size": _samples_or_auto}
BLOCK_SYNC: KeyChecks = {"reset_sgd_momentum_after_aggregation": checks.boolean,
                         "local_learning_rate": partial(checks.choice, choices=checks.LOCAL_LEARNING_RATES)}
MOMENTUM_CORRECTION: KeyChecks = {"momentum_correction": checks.boolean}
OVERLAP: KeyChecks = {"overlap": checks.boolean}
BLOCK_MOMENTUM: KeyChecks = {
    "block_momentum_as_time_constant": partial(checks.positive_number, allow_none=True, allow_zero=True,
                                               unit="samples"),
    "block_learning_rate": checks.positive_number,
    "use_nesterov_momentum": checks.boolean,
}
def _wrap_policy(name: str, value) -> Any:
    """``learner.wrap``: ``blocks``, ``children`` or a non-empty list of module class names."""
    value = plain(value)
    if isinstance(value, str) and value in ("blocks", "children"):
        return value
    if isinstance(value, (list, tuple)) and value and all(isinstance(item, str) and item.isidentifier()
                                                          for item in value):
        return list(value)
    raise ValueError(f"{name}={value!r}: expected blocks, children or a list of module class names "
                     f"(e.g. [Block])")


FSDP: KeyChecks = {
    "wrap": _wrap_policy,
    "reshard_after_forward": checks.boolean, "cpu_offload": checks.boolean,
    "activation_checkpointing": checks.boolean,
    "param_dtype": partial(checks.choice, choices=("float32", "bfloat16")),
    "reduce_dtype": partial(checks.choice, choices=("float32", "bfloat16")),
    "shard_over": partial(checks.choice, choices=("job", "host")),
}
HOST_SHARDS: KeyChecks = {"shard": checks.boolean, "wrap": _wrap_policy}
DILOCO: KeyChecks = {"outer_learning_rate": checks.positive_number, "outer_momentum": _fraction(),
                     "outer_nesterov": checks.boolean}


register_rule("dtrain.learners.fsdp_learner", settings_rule(FSDP))
register_rule("dtrain.learners.FSDPLearner", settings_rule(FSDP))
_distributed_after = settings_rule(DISTRIBUTED_AFTER)
register_rule("dtrain.learners.Learner", _distributed_after)
register_rule("dtrain.learners.LocalLearner", _distributed_after)


@register_rule("dtrain.learners.TwoLevelDataParallelLearner")
@register_rule("dtrain.learners.data_parallel_distributed_learner")
def _data_parallel_rules(node: DictConfig, name: str) -> list[str]:
    return settings_problems(DATA_PARALLEL, node, name) + checks.collect([
        lambda: checks.warm_start_mode(node.get("warm_start_mode"), prefix=f"{name}.")])


#: learner settings retired when the quantized learner became the data-parallel learner with the k-bit
#: exchange: each old name and what to write now, in a config and in Python (``{value}``: the value given)
RETIRED: dict[str, tuple[str, str]] = {
    "num_quantization_bits": ("learner/exchange=quantized learner.exchange.num_bits={value} "
                              "(learner=quantized chooses that exchange)", "exchange=Quantized({value})"),
    "error_feedback": ("learner/exchange=quantized learner.exchange.error_feedback={value}",
                       "exchange=Quantized(num_bits, error_feedback={value})"),
    "requantize_sum": ("learner/exchange=quantized learner.exchange.requantize_sum={value}",
                       "exchange=Quantized(num_bits, requantize_sum={value})"),
    "warm_start": ("learner.warm_start_mode={value}", "warm_start_mode={value!r}"),
}


def _as_written(value: Any) -> str:
    """``value`` as a config writes it (``false``, not ``False``)."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def retired_setting(key: str, value: Any, prefix: str = "learner.") -> str | None:
    """One line saying that the learner setting ``key`` (given ``value``; None: no value, a deletion) was retired
    and what to write now, in a config's terms (``prefix`` not empty: the key's place in the config) or Python's;
    None for another key."""
    if key not in RETIRED:
        return None
    config, python = RETIRED[key]
    if prefix:
        given = f"{prefix}{key}" if value is None else f"{prefix}{key}={_as_written(value)}"
        written = config.format(value="VALUE" if value is None else _as_written(value))
        return f"{given}: no longer a learner setting; write {written}"
    return f"{key}={value!r}: no longer a learner keyword; pass {python.format(value=value)}"


def refuse_retired(function: str, keywords: dict[str, Any]) -> None:
    """Refuses the keywords a learner's constructor caught beyond its own, as Python refuses an unknown one, and
    a retired setting (:data:`RETIRED`) with what to pass now.

    Raises:
        TypeError: one line naming the first keyword.
    """
    if keywords:
        key, value = next(iter(keywords.items()))
        raise TypeError(retired_setting(key, value, prefix="") or
                        f"{function}() got an unexpected keyword argument {key!r}")


@register_rule("dtrain.learners.TwoLevelBlockMomentumLearner")
def _two_level_block_momentum_rules(node: DictConfig, name: str) -> list[str]:
    return _block_momentum_rules(node, name) + settings_problems(HOST_SHARDS, node, name)


@register_rule("dtrain.learners.block_momentum_distributed_learner")
def _block_momentum_rules(node: DictConfig, name: str) -> list[str]:
    problems = settings_problems(DISTRIBUTED_AFTER, node, name)
    if OmegaConf.is_missing(node, "block_size"):
        problems.append(f"{name}.block_size is not set: expected the block size in samples, "
                        f"e.g. {name}.block_size=4096")
    return problems + settings_problems({**BLOCK_SIZE, **BLOCK_MOMENTUM, **BLOCK_SYNC, **MOMENTUM_CORRECTION,
                                         **OVERLAP}, node, name)


_diloco_rules = settings_rule({**DISTRIBUTED_AFTER, **BLOCK_SIZE, **DILOCO, **MOMENTUM_CORRECTION, **OVERLAP})
register_rule("dtrain.learners.TwoLevelDiLoCoLearner",
              settings_rule({**DISTRIBUTED_AFTER, **BLOCK_SIZE, **DILOCO, **MOMENTUM_CORRECTION, **OVERLAP, **HOST_SHARDS}))
register_rule("dtrain.learners.DiLoCoLearner", _diloco_rules)
_local_sgd_rules = settings_rule({**DISTRIBUTED_AFTER, **BLOCK_SIZE, **OVERLAP})
register_rule("dtrain.learners.TwoLevelLocalSGDLearner",
              settings_rule({**DISTRIBUTED_AFTER, **BLOCK_SIZE, **OVERLAP, **HOST_SHARDS}))
register_rule("dtrain.learners.LocalSGDLearner", _local_sgd_rules)
