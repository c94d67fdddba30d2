"""Typed schemas of every config group, registered in Hydra's ConfigStore.

Each YAML option in ``conf/<group>/`` extends one of these schemas (``/schema/<group>/<name>``),
so a misspelt key or a value of the wrong type fails when the config is composed, naming the
key. Value ranges (positive sizes, known choices) are checked by ``validate`` before anything
is built or written, and every problem is reported at once.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from dtrain.session.configs import signal_from_name

# -- learners -------------------------------------------------------------------------------------


@dataclass
class LocalLearnerConfig:
    """The torch optimizer alone, one process: ``dtrain.learners.Learner``."""

    _target_: str = "dtrain.learners.Learner"
    distributed_after: int = 0


@dataclass
class DataParallelLearnerConfig:
    """``data_parallel_distributed_learner``: gradients averaged over all workers every minibatch.

    ``num_quantization_bits`` below 32 sends k-bit gradients with error feedback (1-bit SGD).
    """

    _target_: str = "dtrain.learners.data_parallel_distributed_learner"
    distributed_after: Any = "auto"     # samples, or "auto": none at 32 bits, a warm start relative to the run below
    num_quantization_bits: int = 32
    bucket_size_mb: float = 25.0
    error_feedback: bool = True         # quantized only; false drops the quantization error (ablation)


@dataclass
class BlockMomentumLearnerConfig:
    """``block_momentum_distributed_learner`` (BMUF): local steps, a filtered model sync every block."""

    _target_: str = "dtrain.learners.block_momentum_distributed_learner"
    block_size: Any = "auto"            # samples, or "auto": within CNTK's bound from the data set's size and N
    block_momentum_as_time_constant: Optional[float] = None
    use_nesterov_momentum: bool = True
    reset_sgd_momentum_after_aggregation: bool = True
    block_learning_rate: float = 1.0
    distributed_after: Any = "auto"     # samples, or "auto": a warm start relative to the run (printed at start-up)


# -- optimizers (partial: the parameters are passed when the model exists) -------------------------


@dataclass
class SGDConfig:
    """``torch.optim.SGD``; ``lr`` is per minibatch of the mean loss (PyTorch's convention)."""

    _target_: str = "torch.optim.SGD"
    _partial_: bool = True
    lr: float = 0.1
    momentum: float = 0.0
    dampening: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False


@dataclass
class AdamConfig:
    """``torch.optim.Adam``."""

    _target_: str = "torch.optim.Adam"
    _partial_: bool = True
    lr: float = 1e-3
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    weight_decay: float = 0.0


# -- models ---------------------------------------------------------------------------------------


@dataclass
class DigitsCNNConfig:
    _target_: str = "dtrain.models.DigitsCNN"
    num_classes: int = 10
    hidden: int = 128
    dropout: float = 0.0


@dataclass
class ConvNetCIFAR10Config:
    _target_: str = "dtrain.models.ConvNetCIFAR10"
    num_classes: int = 10
    dropout: float = 0.5


@dataclass
class ResNet50Config:
    """``dtrain.models.ResNet50``; ``width`` 64 is the paper's network (smaller for quick tests)."""

    _target_: str = "dtrain.models.ResNet50"
    num_classes: int = 1000
    width: int = 64
    zero_init_residual: bool = False


# -- data sources ---------------------------------------------------------------------------------


@dataclass
class ImageTransformConfig:
    """``dtrain.data.ImageTransform``: CNTK's random side crop, flip and mean subtraction."""

    _target_: str = "dtrain.data.ImageTransform"
    crop_side_ratio: Optional[float] = None
    flip: bool = False
    mean: Optional[str] = None
    scale: float = 1.0


@dataclass
class MinibatchSourceConfig:
    """``dtrain.data.MinibatchSource`` over one deserializer."""

    _target_: str = "dtrain.data.MinibatchSource"
    deserializer: Any = MISSING
    randomize: bool = True
    randomization_seed: int = 0
    max_samples: Optional[int] = None
    max_sweeps: Optional[int] = None
    transform: Any = None


@dataclass
class SourceConfig:
    """The training source, and optional test and cross-validation sources."""

    train: MinibatchSourceConfig = MISSING
    test: Optional[MinibatchSourceConfig] = None
    cv: Optional[MinibatchSourceConfig] = None


@dataclass
class ImageSourceConfig(SourceConfig):
    """Map-file image sources; ``backend`` picks PIL decoding (``native``) or a DALI pipeline (``dali``)."""

    backend: str = "native"
    image_size: list[int] = field(default_factory=lambda: [256, 256])  # decode size [H, W], pixels
    crop_size: list[int] = field(default_factory=lambda: [224, 224])   # network input [H, W], pixels


# -- session --------------------------------------------------------------------------------------


@dataclass
class ScheduleConfig:
    """``dtrain.Schedule``: ``values`` are numbers or ``[count, value]`` pairs, each count lasting ``epoch_size`` samples."""

    values: list[Any] = MISSING
    epoch_size: int = 1
    warmup_samples: int = 0             # linear ramp from ~0 to 1x over these samples (lr warm-up)


@dataclass
class CheckpointSettings:
    filename: str = "checkpoint.pt"     # relative to the run directory
    frequency: Optional[int] = None     # samples; null = at the end only; 0 = never
    restore: bool = True
    preserve_all: bool = False          # keep every checkpoint, not only the newest keep_last
    keep_last: int = 2                  # >= 2: the newest and a fallback if it is damaged
    preemption_signal: Optional[str] = "SIGTERM"  # save at the next step and exit 75; null disables


@dataclass
class CrossValidationSettings:
    frequency: Optional[int] = None     # samples; null = at the end only; 0 = never
    minibatch_size: int = 256
    max_samples: Optional[int] = None


@dataclass
class TestSettings:
    minibatch_size: int = 256


@dataclass
class SessionConfig:
    """``training_session`` settings; every size and frequency counts global samples."""

    minibatch_size: int = 64
    minibatch_size_schedule: Optional[ScheduleConfig] = None
    max_samples: Optional[int] = None
    progress_frequency: Optional[int] = None
    lr_schedule: Optional[ScheduleConfig] = None                     # multipliers of optimizer.lr
    momentum_time_constant_schedule: Optional[ScheduleConfig] = None  # samples; momentum = exp(-mb/tc)
    unit_gain_momentum: bool = False
    checkpoint: CheckpointSettings = field(default_factory=CheckpointSettings)
    cv: CrossValidationSettings = field(default_factory=CrossValidationSettings)
    test: TestSettings = field(default_factory=TestSettings)
    tensorboard: bool = True
    progress_bar: Optional[bool] = None  # live bar; null = on a terminal in a single process
    num_threads: Optional[int] = None   # torch intra-op threads per process; null = cores / local ranks


@dataclass
class CommConfig:
    backend: str = "auto"               # auto | gloo | nccl | local
    timeout_s: float = 300.0            # a collective waiting longer than this ends the job


@dataclass
class DataConfig:
    root: str = "data"                  # where data sets are read from (and downloaded to)


@dataclass
class DTrainConfig:
    """The whole job. A recipe (``+recipe=NAME``) chooses model, source and values."""

    recipe_name: str = MISSING
    run_dir: str = MISSING
    seed: int = 0
    learner: Any = MISSING
    optimizer: Any = MISSING
    model: Any = MISSING
    source: SourceConfig = MISSING
    session: SessionConfig = field(default_factory=SessionConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    data: DataConfig = field(default_factory=DataConfig)
    recipe: Any = None


_SCHEMAS = {
    ("schema", "config"): DTrainConfig,
    ("schema/learner", "local"): LocalLearnerConfig,
    ("schema/learner", "data_parallel"): DataParallelLearnerConfig,
    ("schema/learner", "block_momentum"): BlockMomentumLearnerConfig,
    ("schema/optimizer", "sgd"): SGDConfig,
    ("schema/optimizer", "adam"): AdamConfig,
    ("schema/model", "digits_cnn"): DigitsCNNConfig,
    ("schema/model", "cifar10_convnet"): ConvNetCIFAR10Config,
    ("schema/model", "resnet50"): ResNet50Config,
    ("schema/source", "source"): SourceConfig,
    ("schema/source", "image_source"): ImageSourceConfig,
    ("schema/source", "minibatch_source"): MinibatchSourceConfig,
    ("schema/source", "image_transform"): ImageTransformConfig,
    ("schema/session", "session"): SessionConfig,
}


def register_schemas() -> None:
    """Registers every schema in Hydra's ConfigStore (idempotent)."""
    store = ConfigStore.instance()
    for (group, name), node in _SCHEMAS.items():
        store.store(group=group, name=name, node=node)


def register_schema(group: str, name: str, node: type) -> None:
    """Adds one more schema (used by learner modules that add their own options)."""
    _SCHEMAS[(group, name)] = node
    ConfigStore.instance().store(group=group, name=name, node=node)


# -- value checks ---------------------------------------------------------------------------------


def _sample_count_problem(key: str, value, allow_none: bool = False, allow_zero: bool = False) -> str | None:
    """The problem line when ``value`` is not a positive (or non-negative) integer number of samples."""
    if value is None and allow_none:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0 or (value == 0 and not allow_zero):
        expected = "a non-negative" if allow_zero else "a positive"
        return f"{key}={value!r}: expected {expected} integer number of samples" + (" or null" if allow_none else "")
    return None


def validate(cfg: DictConfig) -> list[str]:
    """Every range problem in a composed config, one line each (empty when the config is sound)."""
    problems: list[str] = []
    missing = [key for key in ("recipe_name", "model", "source") if OmegaConf.is_missing(cfg, key)]
    if missing:
        return ["no recipe chosen: add +recipe=NAME to the command line (for example +recipe=digits)"]

    def positive(key: str, value, allow_none: bool = False, allow_zero: bool = False) -> None:
        problem = _sample_count_problem(key, value, allow_none, allow_zero)
        if problem:
            problems.append(problem)

    session = cfg.session
    positive("session.minibatch_size", session.minibatch_size)
    positive("session.max_samples", session.max_samples, allow_none=True)
    positive("session.progress_frequency", session.progress_frequency, allow_none=True, allow_zero=True)
    positive("session.checkpoint.frequency", session.checkpoint.frequency, allow_none=True, allow_zero=True)
    positive("session.cv.frequency", session.cv.frequency, allow_none=True, allow_zero=True)
    positive("session.cv.minibatch_size", session.cv.minibatch_size)
    positive("session.cv.max_samples", session.cv.max_samples, allow_none=True)
    positive("session.test.minibatch_size", session.test.minibatch_size)
    positive("session.num_threads", session.num_threads, allow_none=True)
    if not session.checkpoint.filename:
        problems.append("session.checkpoint.filename='': expected a file name")
    if session.checkpoint.keep_last < 2:
        problems.append(f"session.checkpoint.keep_last={session.checkpoint.keep_last}: expected 2 or more "
                        f"(the newest checkpoint and a fallback)")
    signal_name = session.checkpoint.preemption_signal
    if signal_name is not None and not _names_a_signal(signal_name):
        problems.append(f"session.checkpoint.preemption_signal={signal_name!r}: expected a signal name such as "
                        f"SIGTERM or SIGUSR1, or null")
    for key in ("minibatch_size_schedule", "lr_schedule", "momentum_time_constant_schedule"):
        schedule = session[key]
        if schedule is not None:
            positive(f"session.{key}.epoch_size", schedule.epoch_size)
            positive(f"session.{key}.warmup_samples", schedule.warmup_samples, allow_zero=True)
            if not schedule["values"]:
                problems.append(f"session.{key}.values=[]: expected at least one value")
    problems += _learner_problems(cfg.learner)
    if cfg.optimizer.get("lr", 1.0) <= 0:
        problems.append(f"optimizer.lr={cfg.optimizer.lr}: expected a positive learning rate")
    if cfg.comm.backend not in ("auto", "gloo", "nccl", "local"):
        problems.append(f"comm.backend={cfg.comm.backend!r}: expected one of auto, gloo, nccl, local")
    if cfg.comm.timeout_s <= 0:
        problems.append(f"comm.timeout_s={cfg.comm.timeout_s}: expected a positive number of seconds")
    return problems


def _names_a_signal(name: str) -> bool:
    try:
        signal_from_name(name)
    except ValueError:
        return False
    return True


def _learner_problems(learner: DictConfig) -> list[str]:
    """Range checks and refused combinations of the learner options."""
    problems = []
    problem = _sample_count_problem("learner.distributed_after", learner.get("distributed_after", 0), allow_zero=True)
    if problem and learner.get("distributed_after") != "auto":
        problems.append(problem)
    if "num_quantization_bits" in learner:
        bits = learner.num_quantization_bits
        if not 1 <= bits <= 32:
            problems.append(f"learner.num_quantization_bits={bits}: expected 1 to 32 (32 = full precision)")
        if learner.get("bucket_size_mb", 1.0) <= 0:
            problems.append(f"learner.bucket_size_mb={learner.bucket_size_mb}: expected a positive size in MB")
    if "block_size" in learner:
        if OmegaConf.is_missing(learner, "block_size"):
            problems.append("learner.block_size is not set: give the block size in samples, e.g. learner.block_size=4096")
        elif learner.block_size != "auto" and (not isinstance(learner.block_size, int) or learner.block_size <= 0):
            problems.append(f"learner.block_size={learner.block_size!r}: expected a positive number of samples or auto")
        time_constant = learner.block_momentum_as_time_constant
        if time_constant is not None and time_constant <= 0:
            problems.append(f"learner.block_momentum_as_time_constant={time_constant}: expected a positive number "
                            f"of samples, or null for CNTK's default -block_size/ln(1-1/N)")
        if learner.block_learning_rate <= 0:
            problems.append(f"learner.block_learning_rate={learner.block_learning_rate}: expected a positive number")
        if learner.get("num_quantization_bits", 32) != 32:
            problems.append("block momentum cannot be combined with quantized gradients; "
                            "use learner=block_momentum or learner=quantized, not both")
    return problems
