"""The config schema of the ``session`` section (schedules, checkpoints, cross-validation, test, profile) and its rules."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Optional

from omegaconf import DictConfig, ListConfig, OmegaConf

from dtrain import checks
from dtrain.data.settings import _stream_reference_problems
from dtrain.rules import (KeyChecks, StrictBool, key_problems as _check, plain as _plain, register_schema,
                          settings_problems)
from dtrain.session.configs import CROSS_VALIDATION, TEST, CheckpointConfig, checkpoint_problems
from dtrain.session.lr_scaling import lr_scaling_problems
from dtrain.session.profiling import PROFILE
from dtrain.session.weight_ema import check_ema_decay


# -- session --------------------------------------------------------------------------------------


@dataclass
class ScheduleConfig:
    """``dtrain.Schedule``: ``values`` are numbers or ``[count, value]`` pairs, each count lasting ``epoch_size`` samples
    (null: one sweep of the training data, as CNTK's schedules without an epoch_size). ``values`` null: no schedule.

    The session's schedules default to this node with ``values`` null rather than to null itself: OmegaConf
    cannot merge a command-line value into a null structured node, so ``session.minibatch_size_schedule.values=[...]``
    would not compose."""

    values: Optional[list[Any]] = None
    epoch_size: Optional[int] = None
    warmup_samples: int = 0             # linear ramp from ~0 to 1x over these samples (lr warm-up)


@dataclass
class CrossValidationSettings:
    frequency: Optional[int] = None     # samples; null = at the end only; 0 = never
    minibatch_size: int = 256
    max_samples: Optional[int] = None


@dataclass
class TestSettings:
    minibatch_size: int = 256
    max_samples: Optional[int] = None   # samples the test pass reads at most; null = the whole test source


@dataclass
class ProfileSettings:
    """``session.profile``: a ``torch.profiler`` trace of a few training minibatches in ``run_dir/profile/``."""

    enabled: StrictBool = False
    wait: int = 1                       # minibatches before the trace (start-up, the compile check)
    warmup: int = 1                     # minibatches traced and discarded (the profiler's own warm-up)
    active: int = 3                     # minibatches recorded
    ranks: str = "main"                 # main: rank 0 only; all: every rank writes its own trace


@register_schema("schema/session", "session")
@dataclass
class SessionConfig:
    """``training_session`` settings; every size and frequency counts global samples."""

    minibatch_size: int = 64
    minibatch_size_schedule: Optional[ScheduleConfig] = field(default_factory=ScheduleConfig)  # values: sizes
    max_samples: Optional[int] = None
    progress_frequency: Optional[int] = None
    lr_schedule: Optional[ScheduleConfig] = field(default_factory=ScheduleConfig)  # multipliers of optimizer.lr
    momentum_time_constant_schedule: Optional[ScheduleConfig] = field(default_factory=ScheduleConfig)  # samples;
    #                                                                          momentum = exp(-mb/tc)
    unit_gain_momentum: StrictBool = False
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)  # the Python API's class
    cv: CrossValidationSettings = field(default_factory=CrossValidationSettings)
    test: TestSettings = field(default_factory=TestSettings)
    tensorboard: Optional[StrictBool] = None  # null: when the tensorboard package (extra) is installed
    progress_bar: Optional[StrictBool] = None  # live bar; null = on a terminal in a single process
    num_threads: Optional[int] = None   # torch intra-op threads per process; null = chosen (dtrain/threads.py)
    keep_host_memory: StrictBool = True  # fix glibc malloc's thresholds so freed CPU memory serves the next step (dtrain/host_memory.py)
    micro_batch_size: Optional[int] = None  # samples per rank per forward/backward pass; null = no cap
    clip_grad_norm: Optional[float] = None  # max global L2 norm of the gradient before each optimizer step; null = off
    precision: Any = "32"               # 32 | bf16 | fp16 (autocast forward; fp16 with a loss scale)
    compile: StrictBool = False         # train through torch.compile(model) (inductor)
    # streams model.forward takes: one stream, a list (positional), {arg: stream} (keyword), or minibatch; the
    # default is one stream, not a list, so that a config or recipe may set a mapping over it (OmegaConf cannot
    # merge a mapping into a list)
    inputs: Any = "features"
    target: str = "labels"              # the stream the loss and the metric take (text[1:]: a step slice), or minibatch
    epoch_size: Optional[int] = None    # samples per epoch (CNTK's -e), for ${session.epoch_size} and ${epochs:N}
    device: str = "auto"                # auto (the local rank's GPU with CUDA, else the CPU) | cpu | cuda | cuda:N
    profile: ProfileSettings = field(default_factory=ProfileSettings)
    # BatchNorm (docs/batchnorm.md; rules in dtrain/session/batchnorm.py)
    sync_batchnorm: StrictBool = False  # BatchNorm statistics over the global minibatch (every rank's share)
    batchnorm_statistics: str = "running"  # running | recomputed (exactly, over the final model, before the test)
    batchnorm_recompute_samples: int = 4096  # global training samples the recomputed statistics average over
    # large minibatches (docs/large-minibatch.md): lr x minibatch/reference (linear) or its square root (sqrt),
    # warmed up from the unscaled lr over session.lr_schedule.warmup_samples; and a weight EMA
    lr_scaling: str = "none"            # none | linear | sqrt
    lr_reference_minibatch_size: Optional[int] = None  # samples: the global minibatch the lr was tuned at
    ema_decay: Optional[float] = None   # exponential moving average of the weights; null = off


def _session_streams_problems(session: DictConfig) -> list[str]:
    """``session.inputs`` (a list of references, a mapping argument -> reference, or minibatch) and ``session.target``."""
    from dtrain.data.streams import StreamReference

    problems = _stream_reference_problems(session, "session", "target")
    inputs = session.get("inputs")
    if inputs == "minibatch":
        return problems
    if isinstance(inputs, str):
        entries = {"inputs": inputs}
    elif isinstance(inputs, ListConfig) and len(inputs):
        entries = {f"inputs[{index}]": value for index, value in enumerate(inputs)}
    elif isinstance(inputs, DictConfig) and len(inputs):
        entries = {f"inputs.{key}": value for key, value in inputs.items()}
    else:
        return problems + [f"session.inputs={_plain(inputs)!r}: expected a non-empty list of streams, a mapping "
                           f"argument -> stream, or minibatch"]
    for key, value in entries.items():
        try:
            StreamReference.parse(value, f"session.{key}")
        except ValueError as error:
            problems.append(str(error))
    return problems


# -- the sections that are not components: session, comm, seed, run directory
def _schedule_problems(name: str, schedule: DictConfig, value_check: Callable[[str, Any], Any]) -> list[str]:
    problems = _check(schedule, name, ("epoch_size", checks.sample_count, {"allow_none": True}),
                      ("warmup_samples", checks.sample_count, {"allow_zero": True}))
    values_missing = OmegaConf.is_missing(schedule, "values")
    if values_missing or schedule["values"] is None:
        # a warm-up alone is the lr's (a ramp to 1x); anything else set without values would be ignored
        alone = {"epoch_size": None} if name.endswith(".lr_schedule") else {"epoch_size": None, "warmup_samples": 0}
        ignored = [key for key, default in alone.items() if schedule.get(key) != default]
        if ignored:
            return problems + [f"{name}.{ignored[0]}={schedule[ignored[0]]} is set but {name}.values is not: "
                               f"expected a list of values or [count, value] pairs"]
        if values_missing:
            return problems + [f"{name}.values is not set: expected a list of values or [count, value] pairs"]
        return problems
    values = schedule["values"]
    if not isinstance(values, ListConfig) or len(values) == 0:
        return problems + [f"{name}.values={_plain(values)!r}: expected a non-empty list of values "
                           f"or [count, value] pairs"]
    for index, entry in enumerate(values):
        key = f"{name}.values[{index}]"
        plain = _plain(entry)
        pair = isinstance(plain, list) and len(plain) == 2
        count, value = plain if pair else (1, plain)
        if not (pair or not isinstance(plain, list)):
            problems.append(f"{key}={plain!r}: expected a number or a [count, value] pair")
            continue
        problems += checks.collect([lambda: checks.whole_number(f"{key} count", count, low=1, unit="epochs"),
                                    lambda: value_check(f"{key} value", value)])
    return problems


#: the value rules of ``TrainingSession``'s own arguments, used by its constructor and by ``validate``
TRAINING_SESSION: KeyChecks = {
    "minibatch_size": checks.sample_count,
    "max_samples": partial(checks.sample_count, allow_none=True),
    "progress_frequency": partial(checks.sample_count, allow_none=True, allow_zero=True),
    "micro_batch_size": partial(checks.sample_count, allow_none=True),
    "clip_grad_norm": partial(checks.positive_number, allow_none=True),
    "precision": checks.precision,
    "compile": checks.boolean,
}
#: the command line's own ``session.*`` settings, which ``TrainingSession`` does not take or check
_COMMAND_LINE_SESSION: KeyChecks = {
    "num_threads": partial(checks.whole_number, low=1, allow_none=True, unit="threads"),
    "keep_host_memory": checks.boolean,
    "unit_gain_momentum": checks.boolean,
    "tensorboard": partial(checks.boolean, allow_none=True),
    "progress_bar": partial(checks.boolean, allow_none=True),
    "epoch_size": partial(checks.sample_count, allow_none=True),
}


def session_problems(session: DictConfig) -> list[str]:
    """One line per problem of the ``session`` section (its sizes, switches, checkpoint, cv, test, profile, schedules)."""
    problems = settings_problems({**TRAINING_SESSION, **_COMMAND_LINE_SESSION}, session, "session")
    problems += _device_problems(session.device)
    problems += settings_problems({"enabled": checks.boolean, **PROFILE}, session.profile, "session.profile")
    problems += checkpoint_problems(session.checkpoint, "session.checkpoint")
    problems += settings_problems(CROSS_VALIDATION, session.cv, "session.cv")
    problems += settings_problems(TEST, session.test, "session.test")
    problems += _session_streams_problems(session)
    problems += lr_scaling_problems(session) + checks.collect([lambda: check_ema_decay("session.ema_decay",
                                                                                       session.ema_decay)])
    value_checks = {
        "minibatch_size_schedule": checks.sample_count,
        "lr_schedule": lambda key, value: checks.positive_number(key, value, allow_zero=True),
        "momentum_time_constant_schedule": lambda key, value: checks.positive_number(key, value, allow_zero=True,
                                                                                     unit="samples"),
    }
    for key, value_check in value_checks.items():
        if session[key] is not None:
            problems += _schedule_problems(f"session.{key}", session[key], value_check)
    return problems


def _device_problems(device: Any) -> list[str]:
    """``session.device``: a device word this machine has (the communicator's needs are checked once it exists)."""
    from dtrain.session.device import machine_problem

    try:
        setting = checks.device("session.device", device)
    except ValueError as error:
        return [str(error)]
    problem = machine_problem("session.device", setting)
    return [problem] if problem else []
