"""Typed schemas of every config group, registered in Hydra's ConfigStore.

Each YAML option in ``conf/<group>/`` extends one of these schemas (``/schema/<group>/<name>``),
so a misspelt key or a value of the wrong type fails when the config is composed, naming the
key. ``validate`` then checks everything else before anything is built or written and reports
every problem at once: keys added with ``+`` that a schema does not have, the value rules each
component registers under its ``_target_`` (:data:`RULES`, :func:`register_rule`), switches written
as true or false (:data:`StrictBool`), the session and comm sections (a ``session.epoch_size`` that
nothing refers to included), NaN or infinity in any number, and whether ``run_dir`` can be written.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Dict, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from dtrain import checks

from dtrain.session.batchnorm import batchnorm_setting_problems
from dtrain.optim import settings as optim_settings
from dtrain.session.configs import signal_from_name
from dtrain.session.lr_scaling import lr_scaling_problems
from dtrain.session.weight_ema import check_ema_decay

#: the type of every switch in the schemas: a boolean kept as written. OmegaConf's ``bool`` would turn
#: ``2`` or ``"yes"`` into true without a word; ``validate`` asks for ``true`` or ``false`` instead
#: (``checks.boolean``), and refuses ``0`` and ``1`` too, as the Python API does.
StrictBool = Any

# -- learners -------------------------------------------------------------------------------------


@dataclass
class LocalLearnerConfig:
    """The torch optimizer alone, one process: ``dtrain.learners.Learner``."""

    _target_: str = "dtrain.learners.Learner"
    distributed_after: int = 0


@dataclass
class DataParallelLearnerConfig:
    """``data_parallel_distributed_learner``: gradients averaged over all workers every minibatch.

    ``exchange`` is the strategy that sums each gradient bucket (``learner/exchange=NAME``, one
    of the schemas below; float32 all-reduce when unset). ``num_quantization_bits`` below 32 is
    CNTK's shortcut for k-bit gradients with error feedback (1-bit SGD, ``learner=quantized``).
    """

    _target_: str = "dtrain.learners.data_parallel_distributed_learner"
    distributed_after: Any = "auto"     # samples, or "auto": a warm start relative to the run for k-bit, else none
    num_quantization_bits: int = 32
    bucket_size_mb: float = 25.0
    error_feedback: StrictBool = True   # quantized only; false drops the quantization error (ablation)
    exchange: Any = None                # learner/exchange=allreduce|bf16|fp16|quantized|powersgd
    warm_start_mode: Optional[str] = None  # a compressing exchange's warm start: allreduce (null: this) or local (CNTK's)
    warm_start: Optional[str] = None    # the old spelling of warm_start_mode (an alias), not PowerSGD's warm_start


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


@dataclass
class LocalSGDLearnerConfig:
    """``dtrain.learners.LocalSGDLearner``: local steps, the workers' models averaged every block."""

    _target_: str = "dtrain.learners.LocalSGDLearner"
    block_size: Any = "auto"            # samples per block, or "auto" (block momentum's rule)
    distributed_after: Any = "auto"     # samples, or "auto": a warm start relative to the run (printed at start-up)
    exchange: Any = None                # learner/exchange=NAME: the strategy that sums the block deltas


@dataclass
class TwoLevelDiLoCoLearnerConfig(DiLoCoLearnerConfig):
    """``dtrain.learners.TwoLevelDiLoCoLearner``: exact data parallel inside each host (``comm.ranks_per_host``
    or the launcher's), DiLoCo between the hosts."""

    _target_: str = "dtrain.learners.TwoLevelDiLoCoLearner"


@dataclass
class TwoLevelBlockMomentumLearnerConfig(BlockMomentumLearnerConfig):
    """``dtrain.learners.TwoLevelBlockMomentumLearner``: exact data parallel inside each host, BMUF between hosts."""

    _target_: str = "dtrain.learners.TwoLevelBlockMomentumLearner"


@dataclass
class TwoLevelLocalSGDLearnerConfig(LocalSGDLearnerConfig):
    """``dtrain.learners.TwoLevelLocalSGDLearner``: exact data parallel inside each host, local SGD between hosts."""

    _target_: str = "dtrain.learners.TwoLevelLocalSGDLearner"


# -- exchange strategies (conf/learner/exchange: ``learner/exchange=NAME``) --------------------------


@dataclass
class AllReduceExchangeConfig:
    """``dtrain.exchange.AllReduce``: a full-precision SUM all-reduce."""

    _target_: str = "dtrain.exchange.AllReduce"


@dataclass
class QuantizedExchangeConfig:
    """``dtrain.exchange.Quantized``: k-bit codes with two-sided error feedback."""

    _target_: str = "dtrain.exchange.Quantized"
    num_bits: int = 1
    error_feedback: StrictBool = True


@dataclass
class CompressedExchangeConfig:
    """``dtrain.exchange.CompressedAllReduce``: the pre-divided gradients all-reduced as bf16 or fp16."""

    _target_: str = "dtrain.exchange.CompressedAllReduce"
    dtype: str = "bf16"                 # bf16 or fp16


@dataclass
class PowerSGDExchangeConfig:
    """``dtrain.exchange.PowerSGD``: rank-r low-rank compression with error feedback and warm start
    (PyTorch's ``powerSGD_hook``, same defaults)."""

    _target_: str = "dtrain.exchange.PowerSGD"
    matrix_approximation_rank: int = 1
    start_powersgd_iter: Any = None     # exchange steps (minibatches; syncs of block learners) of plain all-reduce
    #                                     first, or "auto": 10% of the run's; null: torch's 1000 minibatches, auto for syncs
    min_compression_rate: float = 2.0
    use_error_feedback: Optional[StrictBool] = None  # null: on for minibatch steps (torch's), off for block learners' syncs
    warm_start: StrictBool = True
    orthogonalization_epsilon: float = 0.0
    random_seed: int = 0


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
    nesterov: StrictBool = False


@dataclass
class AdamConfig:
    """``dtrain.optimizers.Adam`` (``torch.optim.Adam`` with CNTK's names for its two averages).

    ``momentum`` is Adam's beta1 and ``variance_momentum`` its beta2, so a recipe's
    ``optimizer.momentum`` and ``session.momentum_time_constant_schedule`` mean the same for
    SGD and Adam, and every optimizer combines with every recipe.
    """

    _target_: str = "dtrain.optimizers.Adam"
    _partial_: bool = True
    lr: float = 1e-3
    momentum: float = 0.9
    variance_momentum: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0


@dataclass
class AdamWConfig(AdamConfig):
    """``dtrain.optimizers.AdamW`` (``torch.optim.AdamW``, decoupled weight decay, with CNTK's names
    for its two averages as :class:`AdamConfig`); DiLoCo's inner optimizer."""

    _target_: str = "dtrain.optimizers.AdamW"
    weight_decay: float = 0.01


# -- models ---------------------------------------------------------------------------------------


@dataclass
class DigitsCNNConfig:
    _target_: str = "dtrain.models.DigitsCNN"
    num_classes: int = 10
    hidden: int = 128
    dropout: float = 0.0
    batch_norm: StrictBool = False      # Conv-BatchNorm-ReLU (docs/batchnorm.md)


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
    zero_init_residual: StrictBool = False


@dataclass
class CharTransformerConfig:
    """``dtrain.models.CharTransformer``: a GPT-style character language model."""

    _target_: str = "dtrain.models.CharTransformer"
    vocab_size: int = MISSING
    context_length: int = 128
    layers: int = 4
    heads: int = 4
    width: int = 128
    dropout: float = 0.0


@dataclass
class Seq2SeqTransformerConfig:
    """``dtrain.models.Seq2SeqTransformer``: a transformer encoder-decoder (grapheme-to-phoneme)."""

    _target_: str = "dtrain.models.Seq2SeqTransformer"
    source_vocab_size: int = MISSING
    target_vocab_size: int = MISSING
    width: int = 256
    heads: int = 4
    encoder_layers: int = 3
    decoder_layers: int = 3
    feedforward: int = 1024
    dropout: float = 0.1
    context_length: int = 64
    begin: int = 1
    end: int = 2


# -- data sources ---------------------------------------------------------------------------------


@dataclass
class ImageTransformConfig:
    """``dtrain.data.ImageTransform``: CNTK's random side crop, flip and mean subtraction."""

    _target_: str = "dtrain.data.ImageTransform"
    crop_side_ratio: Optional[float] = None
    flip: StrictBool = False
    mean: Optional[str] = None
    scale: float = 1.0


@dataclass
class MinibatchSourceConfig:
    """``dtrain.data.MinibatchSource`` over one deserializer."""

    _target_: str = "dtrain.data.MinibatchSource"
    deserializer: Any = MISSING
    randomize: StrictBool = True
    randomization_seed: int = 0
    max_samples: Optional[int] = None
    max_sweeps: Optional[int] = None
    transform: Any = None
    read_ahead: Optional[StrictBool] = None  # read the next minibatch in the background; null = when reads are slow (images)
    defining_stream: Optional[str] = None  # whose steps count samples (sequences); null = the loss's target
    length_bucketing: int = 0           # sequences per length bucket (less padding); 0 = off


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
    """``dtrain.Schedule``: ``values`` are numbers or ``[count, value]`` pairs, each count lasting ``epoch_size`` samples
    (null: one sweep of the training data, as CNTK's schedules without an epoch_size)."""

    values: list[Any] = MISSING
    epoch_size: Optional[int] = None
    warmup_samples: int = 0             # linear ramp from ~0 to 1x over these samples (lr warm-up)


@dataclass
class CheckpointSettings:
    filename: str = "checkpoint.pt"     # relative to the run directory
    frequency: Optional[int] = None     # samples; null = at the end only; 0 = never
    restore: StrictBool = True
    preserve_all: StrictBool = False    # keep every checkpoint, not only the newest keep_last
    keep_last: int = 2                  # >= 2: the newest and a fallback if it is damaged
    preemption_signal: Optional[str] = "SIGTERM"  # save at the next step and exit 75; null disables
    restore_from: Optional[str] = None  # a checkpoint file to start from while run_dir has none of its own


@dataclass
class CrossValidationSettings:
    frequency: Optional[int] = None     # samples; null = at the end only; 0 = never
    minibatch_size: int = 256
    max_samples: Optional[int] = None


@dataclass
class TestSettings:
    minibatch_size: int = 256


@dataclass
class ProfileSettings:
    """``session.profile``: a ``torch.profiler`` trace of a few training minibatches in ``run_dir/profile/``."""

    enabled: StrictBool = False
    wait: int = 1                       # minibatches before the trace (start-up, the compile check)
    warmup: int = 1                     # minibatches traced and discarded (the profiler's own warm-up)
    active: int = 3                     # minibatches recorded
    ranks: str = "main"                 # main: rank 0 only; all: every rank writes its own trace


@dataclass
class SessionConfig:
    """``training_session`` settings; every size and frequency counts global samples."""

    minibatch_size: int = 64
    minibatch_size_schedule: Optional[ScheduleConfig] = None
    max_samples: Optional[int] = None
    progress_frequency: Optional[int] = None
    lr_schedule: Optional[ScheduleConfig] = None                     # multipliers of optimizer.lr
    momentum_time_constant_schedule: Optional[ScheduleConfig] = None  # samples; momentum = exp(-mb/tc)
    unit_gain_momentum: StrictBool = False
    checkpoint: CheckpointSettings = field(default_factory=CheckpointSettings)
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
    inputs: Any = field(default_factory=lambda: ["features"])  # streams model.forward takes: a list, {arg: stream}, or minibatch
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


@dataclass
class CommConfig:
    backend: str = "auto"               # auto | gloo | mpi | nccl | local
    timeout_s: float = 300.0            # a collective waiting longer than this ends the job
    heartbeat_timeout_s: float = 60.0   # a rank silent this long (stopped, host unreachable) ends the job
    hierarchical: Any = "auto"          # auto | true | false: sum within each host first (docs/multi-host.md)
    ranks_per_host: Optional[int] = None  # null: hosts from the launcher; N: blocks of N consecutive ranks


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
    # a recipe's learning rate per optimizer preset (sgd, adam, adamw); each preset's lr reads its
    # entry, so a learner preset that chooses another optimizer (learner=diloco: adamw) gets a
    # learning rate tuned for it; optimizer.lr=... on the command line still wins
    optimizer_lr: Dict[str, float] = field(default_factory=dict)
    # the same for other settings that only suit one optimizer (optimizer_settings.adamw.weight_decay:
    # AdamW's decoupled decay would be a heavy L2 penalty under SGD); each preset reads its own entries
    optimizer_settings: Dict[str, Dict[str, float]] = field(default_factory=dict)
    model: Any = MISSING
    source: SourceConfig = MISSING
    session: SessionConfig = field(default_factory=SessionConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    data: DataConfig = field(default_factory=DataConfig)
    recipe: Any = None
    loss: Any = MISSING                 # conf/loss: loss(output, labels) -> mean over the minibatch
    metric: Any = MISSING               # conf/metric: metric(output, labels) -> sum over the minibatch


# -- losses and metrics (conf/loss, conf/metric) ----------------------------------------------------
# Each option builds a callable with ``_target_``; your own goes in ``loss/NAME.yaml`` (or
# ``metric/NAME.yaml``) of a ``--config-dir`` and needs no schema.


@dataclass
class CrossEntropyLossConfig:
    """``torch.nn.CrossEntropyLoss``: integer class labels, mean over the minibatch."""

    _target_: str = "torch.nn.CrossEntropyLoss"
    label_smoothing: float = 0.0


@dataclass
class MSELossConfig:
    """``dtrain.session.MSELoss``: float regression targets, outputs ``[n, 1]`` meet labels ``[n]``."""

    _target_: str = "dtrain.session.MSELoss"


@dataclass
class SequenceCrossEntropyConfig:
    """``dtrain.session.SequenceCrossEntropy``: cross-entropy over the real steps of a sequence target (token mean)."""

    _target_: str = "dtrain.session.SequenceCrossEntropy"
    label_smoothing: float = 0.0


@dataclass
class SequenceErrorConfig:
    """``dtrain.session.SequenceError``: sequences with any wrong step, averaged over sequences."""

    _target_: str = "dtrain.session.SequenceError"


@dataclass
class ClassificationErrorConfig:
    """``dtrain.session.ClassificationError``: the fraction misclassified, reported as ``error``."""

    _target_: str = "dtrain.session.ClassificationError"


@dataclass
class PerplexityConfig:
    """``dtrain.session.Perplexity``: exp of the mean cross-entropy per step (nats), reported as ``perplexity``."""

    _target_: str = "dtrain.session.Perplexity"


@dataclass
class GreedyDecodingErrorsConfig:
    """``dtrain.session.GreedyDecodingErrors``: word and token error rates of greedy decoding (``wer``, ``per``)."""

    _target_: str = "dtrain.session.GreedyDecodingErrors"
    source: str = MISSING
    references: Any = None
    name: str = "wer"
    token_name: str = "per"
    max_steps: Optional[int] = None
    end: Optional[int] = None


@dataclass
class TopKErrorConfig:
    """``dtrain.session.TopKError``: label not among the ``k`` largest outputs, reported as ``top<k>_error``."""

    _target_: str = "dtrain.session.TopKError"
    k: int = 5


@dataclass
class MeanAbsoluteErrorConfig:
    """``dtrain.session.MeanAbsoluteError``: for regression, reported as ``mean_abs_error``."""

    _target_: str = "dtrain.session.MeanAbsoluteError"


_SCHEMAS = {
    ("schema", "config"): DTrainConfig,
    ("schema/learner", "local"): LocalLearnerConfig,
    ("schema/learner", "data_parallel"): DataParallelLearnerConfig,
    ("schema/learner", "block_momentum"): BlockMomentumLearnerConfig,
    ("schema/learner", "diloco"): DiLoCoLearnerConfig,
    ("schema/learner", "local_sgd"): LocalSGDLearnerConfig,
    ("schema/learner", "two_level_diloco"): TwoLevelDiLoCoLearnerConfig,
    ("schema/learner", "two_level_local_sgd"): TwoLevelLocalSGDLearnerConfig,
    ("schema/learner", "two_level_block_momentum"): TwoLevelBlockMomentumLearnerConfig,
    ("schema/learner/exchange", "allreduce"): AllReduceExchangeConfig,
    ("schema/learner/exchange", "quantized"): QuantizedExchangeConfig,
    ("schema/learner/exchange", "compressed"): CompressedExchangeConfig,
    ("schema/learner/exchange", "powersgd"): PowerSGDExchangeConfig,
    ("schema/optimizer", "sgd"): SGDConfig,
    ("schema/optimizer", "adam"): AdamConfig,
    ("schema/optimizer", "adamw"): AdamWConfig,
    **{("schema/optimizer", name): schema for name, schema in optim_settings.OPTIONS.items()},
    ("schema/model", "digits_cnn"): DigitsCNNConfig,
    ("schema/model", "cifar10_convnet"): ConvNetCIFAR10Config,
    ("schema/model", "resnet50"): ResNet50Config,
    ("schema/model", "char_transformer"): CharTransformerConfig,
    ("schema/model", "seq2seq_transformer"): Seq2SeqTransformerConfig,
    ("schema/source", "source"): SourceConfig,
    ("schema/source", "image_source"): ImageSourceConfig,
    ("schema/source", "minibatch_source"): MinibatchSourceConfig,
    ("schema/source", "image_transform"): ImageTransformConfig,
    ("schema/session", "session"): SessionConfig,
    ("schema/loss", "cross_entropy"): CrossEntropyLossConfig,
    ("schema/loss", "mse"): MSELossConfig,
    ("schema/loss", "sequence_cross_entropy"): SequenceCrossEntropyConfig,
    ("schema/metric", "sequence_error"): SequenceErrorConfig,
    ("schema/metric", "classification_error"): ClassificationErrorConfig,
    ("schema/metric", "top5_error"): TopKErrorConfig,
    ("schema/metric", "mean_abs_error"): MeanAbsoluteErrorConfig,
    ("schema/metric", "perplexity"): PerplexityConfig,
    ("schema/metric", "wer"): GreedyDecodingErrorsConfig,
}


def register_schemas() -> None:
    """Registers every schema in Hydra's ConfigStore, and the ``epochs`` resolver (idempotent)."""
    store = ConfigStore.instance()
    for (group, name), node in _SCHEMAS.items():
        store.store(group=group, name=name, node=node)
    if not OmegaConf.has_resolver("epochs"):
        OmegaConf.register_new_resolver("epochs", epochs_in_samples)


def epochs_in_samples(count: Any, *, _root_: DictConfig) -> int:
    """``${epochs:N}``: N epochs of ``session.epoch_size`` samples, for a recipe's ``max_samples``,
    frequencies and schedules (CNTK's ``-n`` and ``-e``: ``docs/porting-from-cntk.md``)."""
    epoch_size = _root_.session.epoch_size
    if epoch_size is None:
        raise ValueError(f"${{epochs:{count}}} needs session.epoch_size; expected session.epoch_size=SAMPLES")
    checks.sample_count("session.epoch_size", epoch_size)
    samples = checks.positive_number(f"${{epochs:{count}}}", count, unit="epochs") * epoch_size
    if samples != int(samples):
        raise ValueError(f"${{epochs:{count}}} is {samples:g} samples of session.epoch_size={epoch_size}; expected "
                         f"a whole number of samples")
    return int(samples)


def register_schema(group: str, name: str, node: type) -> None:
    """Adds one more schema (used by learner modules that add their own options)."""
    _SCHEMAS[(group, name)] = node
    ConfigStore.instance().store(group=group, name=name, node=node)


# -- validation: every rule of every component, all problems at once --------------------------------
#
# A rule takes the config node and the dotted name the user knows it by (``"optimizer"``,
# ``"source.train"``) and returns one line per problem. Rules for a component live in
# ``RULES`` under its ``_target_``, so a config is checked wherever the component appears and
# a new component (a user's learner, model or source) brings its own rules with
# ``register_rule``. Value rules come from ``dtrain.checks``.

Rule = Callable[[DictConfig, str], list[str]]

RULES: dict[str, Rule] = {}
"""``_target_`` -> rule; see :func:`register_rule`."""


def register_rule(target: str, rule: Rule | None = None):
    """Registers ``rule(node, name) -> [problem lines]`` for config nodes with ``_target_ == target``.

    Usable as a decorator (``@register_rule("my.Model")``). ``name`` is the node's dotted key
    (e.g. ``"model"``), to be used in the lines: ``model.hidden=-5: expected ...``.
    """
    def add(function: Rule) -> Rule:
        RULES[target] = function
        return function
    return add(rule) if rule is not None else add


def _check(node: DictConfig, name: str, *key_checks: tuple[str, Callable[..., Any], dict]) -> list[str]:
    """Runs ``check(f"{name}.{key}", node[key], **options)`` for each ``(key, check, options)``."""
    def bind(key, check, options):
        return lambda: check(f"{name}.{key}", node[key], **options)
    return checks.collect(bind(key, check, options) for key, check, options in key_checks
                          if key in node and not OmegaConf.is_missing(node, key))


def _fraction(high_inclusive: bool = False):
    """A check for a number in [0, 1) (or [0, 1] with ``high_inclusive``)."""
    def check(name, value):
        return checks.number_in_range(name, value, 0.0, 1.0, include_high=high_inclusive)
    return check


# -- learners
def _samples_or_auto(name: str, value, **options):
    """A sample count, or ``"auto"`` (the learner derives it from the run and prints it at start-up)."""
    if value == "auto":
        return value
    try:
        return checks.sample_count(name, value, **options)
    except ValueError as error:
        raise ValueError(f"{error} or auto") from None


def _distributed_after(node: DictConfig, name: str) -> list[str]:
    return _check(node, name, ("distributed_after", _samples_or_auto, {"allow_zero": True}))


register_rule("dtrain.learners.Learner", _distributed_after)
register_rule("dtrain.learners.LocalLearner", _distributed_after)


@register_rule("dtrain.learners.data_parallel_distributed_learner")
def _data_parallel_rules(node: DictConfig, name: str) -> list[str]:
    return _distributed_after(node, name) + _check(
        node, name,
        ("num_quantization_bits", checks.whole_number, {"low": 1, "high": 32, "unit": "bits"}),
        ("bucket_size_mb", checks.positive_number, {"unit": "MB"}),
        ("error_feedback", checks.boolean, {}),
    ) + checks.collect([lambda: checks.warm_start_mode(node.get("warm_start_mode"), node.get("warm_start"),
                                                       prefix=f"{name}.")]) + _exchange_choice_problems(node, name)


def _exchange_choice_problems(node: DictConfig, name: str) -> list[str]:
    """``num_quantization_bits`` below 32 and an exchange other than float32 both choose how gradients travel."""
    exchange = node.get("exchange") if "exchange" in node else None
    bits = node.get("num_quantization_bits", 32)
    if isinstance(exchange, DictConfig) and exchange.get("_target_") not in (None, "dtrain.exchange.AllReduce") \
            and isinstance(bits, int) and bits < 32:
        return [f"{name}.num_quantization_bits={bits} and {name}/exchange={exchange.get('_target_')}: both choose the "
                f"gradient exchange; use {name}/exchange=quantized with {name}.exchange.num_bits, or leave "
                f"{name}.num_quantization_bits at 32"]
    return []


@register_rule("dtrain.exchange.Quantized")
def _quantized_exchange_rules(node: DictConfig, name: str) -> list[str]:
    return _check(
        node, name,
        ("num_bits", checks.whole_number, {"low": 1, "high": 32, "unit": "bits"}),
        ("error_feedback", checks.boolean, {}),
    )


@register_rule("dtrain.exchange.CompressedAllReduce")
def _compressed_exchange_rules(node: DictConfig, name: str) -> list[str]:
    if "dtype" in node and node.dtype not in ("bf16", "fp16"):
        return [f"{name}.dtype={node.dtype!r}: expected bf16 or fp16"]
    return []


def _steps_or_auto(name: str, value):
    """A whole number of steps (>= 0), ``"auto"``, or null (the learner's default)."""
    if value == "auto" or value is None:
        return value
    try:
        return checks.whole_number(name, value, low=0, unit="steps")
    except ValueError as error:
        raise ValueError(f"{error}, auto or null") from None


@register_rule("dtrain.exchange.PowerSGD")
def _powersgd_exchange_rules(node: DictConfig, name: str) -> list[str]:
    return _check(
        node, name,
        ("matrix_approximation_rank", checks.whole_number, {"low": 1}),
        ("start_powersgd_iter", _steps_or_auto, {}),
        ("min_compression_rate", checks.positive_number, {}),
        ("use_error_feedback", checks.boolean, {"allow_none": True}),
        ("warm_start", checks.boolean, {}),
        ("orthogonalization_epsilon", checks.positive_number, {"allow_zero": True}),
        ("random_seed", checks.whole_number, {"low": 0}),
    )


@register_rule("dtrain.learners.TwoLevelBlockMomentumLearner")
@register_rule("dtrain.learners.block_momentum_distributed_learner")
def _block_momentum_rules(node: DictConfig, name: str) -> list[str]:
    problems = _distributed_after(node, name)
    if OmegaConf.is_missing(node, "block_size"):
        problems.append(f"{name}.block_size is not set: expected the block size in samples, "
                        f"e.g. {name}.block_size=4096")
    return problems + _check(
        node, name,
        ("block_size", _samples_or_auto, {}),
        ("block_momentum_as_time_constant", checks.positive_number,
         {"allow_none": True, "allow_zero": True, "unit": "samples"}),
        ("block_learning_rate", checks.positive_number, {}),
        ("use_nesterov_momentum", checks.boolean, {}),
        ("reset_sgd_momentum_after_aggregation", checks.boolean, {}),
        ("local_learning_rate", checks.choice, {"choices": checks.LOCAL_LEARNING_RATES}),
    )


@register_rule("dtrain.learners.TwoLevelDiLoCoLearner")
@register_rule("dtrain.learners.DiLoCoLearner")
def _diloco_rules(node: DictConfig, name: str) -> list[str]:
    return _distributed_after(node, name) + _check(
        node, name,
        ("block_size", _samples_or_auto, {}),
        ("outer_learning_rate", checks.positive_number, {}),
        ("outer_momentum", _fraction(), {}),
        ("outer_nesterov", checks.boolean, {}),
    )


@register_rule("dtrain.learners.TwoLevelLocalSGDLearner")
@register_rule("dtrain.learners.LocalSGDLearner")
def _local_sgd_rules(node: DictConfig, name: str) -> list[str]:
    return _distributed_after(node, name) + _check(node, name, ("block_size", _samples_or_auto, {}))


# -- optimizers
@register_rule("torch.optim.SGD")
def _sgd_rules(node: DictConfig, name: str) -> list[str]:
    problems = _check(
        node, name,
        ("lr", checks.positive_number, {}),
        ("momentum", _fraction(), {}),
        ("dampening", _fraction(high_inclusive=True), {}),
        ("weight_decay", checks.positive_number, {"allow_zero": True}),
        ("nesterov", checks.boolean, {}),
    )
    if not problems and node.get("nesterov") and (node.get("momentum", 0) == 0 or node.get("dampening", 0) != 0):
        problems.append(f"{name}.nesterov=true: expected {name}.momentum above 0 and {name}.dampening=0 "
                        f"(Nesterov momentum needs both)")
    return problems


@register_rule("dtrain.optimizers.AdamW")
@register_rule("dtrain.optimizers.Adam")
def _adam_rules(node: DictConfig, name: str) -> list[str]:
    return _check(
        node, name,
        ("lr", checks.positive_number, {}),
        ("momentum", _fraction(), {}),
        ("variance_momentum", _fraction(), {}),
        ("eps", checks.positive_number, {}),
        ("weight_decay", checks.positive_number, {"allow_zero": True}),
    )


for _schema in optim_settings.OPTIONS.values():  # optimizer=lars, lamb, rmsprop_warmup_sgd
    register_rule(_schema._target_, optim_settings.problems)


# -- losses and metrics
@register_rule("torch.nn.CrossEntropyLoss")
def _cross_entropy_rules(node: DictConfig, name: str) -> list[str]:
    return _check(node, name, ("label_smoothing", _fraction(high_inclusive=True), {}))  # torch: [0.0, 1.0]


@register_rule("dtrain.session.SequenceCrossEntropy")
def _sequence_cross_entropy_rules(node: DictConfig, name: str) -> list[str]:
    return _check(node, name, ("label_smoothing", _fraction(), {}))  # as its constructor: [0, 1)


@register_rule("dtrain.session.TopKError")
def _top_k_error_rules(node: DictConfig, name: str) -> list[str]:
    return _check(node, name, ("k", checks.whole_number, {"low": 1, "unit": "classes"}))


# -- models
def _num_classes(node: DictConfig, name: str) -> list[str]:
    return _check(node, name, ("num_classes", checks.whole_number, {"low": 2, "unit": "classes"}))


@register_rule("dtrain.models.DigitsCNN")
def _digits_cnn_rules(node: DictConfig, name: str) -> list[str]:
    return _num_classes(node, name) + _check(
        node, name,
        ("hidden", checks.whole_number, {"low": 1, "unit": "units"}),
        ("dropout", _fraction(), {}),
        ("batch_norm", checks.boolean, {}),
    )


@register_rule("dtrain.models.ConvNetCIFAR10")
def _cifar10_convnet_rules(node: DictConfig, name: str) -> list[str]:
    return _num_classes(node, name) + _check(node, name, ("dropout", _fraction(), {}))


@register_rule("dtrain.models.ResNet50")
def _resnet50_rules(node: DictConfig, name: str) -> list[str]:
    return _num_classes(node, name) + _check(
        node, name,
        ("width", checks.whole_number, {"low": 1, "unit": "channels"}),
        ("zero_init_residual", checks.boolean, {}),
    )


# -- data
@register_rule("dtrain.data.MinibatchSource")
def _minibatch_source_rules(node: DictConfig, name: str) -> list[str]:
    return _check(
        node, name,
        ("randomize", checks.boolean, {}),
        ("read_ahead", checks.boolean, {"allow_none": True}),
        ("randomization_seed", checks.whole_number, {"low": 0}),
        ("max_samples", checks.sample_count, {"allow_none": True}),
        ("max_sweeps", checks.whole_number, {"low": 1, "allow_none": True, "unit": "sweeps"}),
        ("length_bucketing", checks.whole_number, {"low": 0, "unit": "sequences"}),
    ) + _stream_reference_problems(node, name, "defining_stream", allow_none=True)



@register_rule("dtrain.data.ImageTransform")
@register_rule("dtrain.data.image_transform")
def _image_transform_rules(node: DictConfig, name: str) -> list[str]:
    return _check(node, name, ("flip", checks.boolean, {}))


def _stream_reference_problems(node: DictConfig, name: str, key: str, allow_none: bool = False) -> list[str]:
    """A stream reference (``text``, ``text[1:]``, ``src.mask``) that parses, or ``minibatch``."""
    from dtrain.data.streams import StreamReference

    if key not in node or OmegaConf.is_missing(node, key):
        return []
    value = node[key]
    if value is None and allow_none:
        return []
    if value == "minibatch" and not allow_none:
        return []
    try:
        StreamReference.parse(value, f"{name}.{key}")
    except ValueError as error:
        return [str(error)]
    return []


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
    if OmegaConf.is_missing(schedule, "values"):
        return problems + [f"{name}.values is not set: expected a list of values or [count, value] pairs"]
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


def _session_problems(session: DictConfig) -> list[str]:
    problems = _check(
        session, "session",
        ("minibatch_size", checks.sample_count, {}),
        ("max_samples", checks.sample_count, {"allow_none": True}),
        ("progress_frequency", checks.sample_count, {"allow_none": True, "allow_zero": True}),
        ("num_threads", checks.whole_number, {"low": 1, "allow_none": True, "unit": "threads"}),
        ("keep_host_memory", checks.boolean, {}),
        ("unit_gain_momentum", checks.boolean, {}),
        ("tensorboard", checks.boolean, {"allow_none": True}),
        ("progress_bar", checks.boolean, {"allow_none": True}),
        ("micro_batch_size", checks.sample_count, {"allow_none": True}),
        ("clip_grad_norm", checks.positive_number, {"allow_none": True}),
        ("precision", checks.precision, {}),
        ("compile", checks.boolean, {}),
        ("epoch_size", checks.sample_count, {"allow_none": True}),
    )
    problems += _device_problems(session.device)
    problems += _check(
        session.profile, "session.profile",
        ("enabled", checks.boolean, {}),
        ("wait", checks.whole_number, {"low": 0, "unit": "minibatches"}),
        ("warmup", checks.whole_number, {"low": 0, "unit": "minibatches"}),
        ("active", checks.whole_number, {"low": 1, "unit": "minibatches"}),
        ("ranks", checks.choice, {"choices": checks.PROFILE_RANKS}),
    )
    problems += _check(
        session.checkpoint, "session.checkpoint",
        ("frequency", checks.sample_count, {"allow_none": True, "allow_zero": True}),
        ("keep_last", checks.whole_number, {"low": 2, "unit": "checkpoints (the newest and a fallback)"}),
        ("restore", checks.boolean, {}),
        ("preserve_all", checks.boolean, {}),
    )
    filename = session.checkpoint.filename
    if not filename or str(filename).endswith(("/", os.sep)):
        problems.append(f"session.checkpoint.filename={filename!r}: expected a file name (e.g. checkpoint.pt)")
    signal_name = session.checkpoint.preemption_signal
    if signal_name is not None and not _names_a_signal(signal_name):
        problems.append(f"session.checkpoint.preemption_signal={signal_name!r}: expected a signal name such as "
                        f"SIGTERM or SIGUSR1, or null")
    problems += _check(
        session.cv, "session.cv",
        ("frequency", checks.sample_count, {"allow_none": True, "allow_zero": True}),
        ("minibatch_size", checks.sample_count, {}),
        ("max_samples", checks.sample_count, {"allow_none": True}),
    )
    problems += _check(session.test, "session.test", ("minibatch_size", checks.sample_count, {}))
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


def _epoch_size_problems(cfg: DictConfig) -> list[str]:
    """``session.epoch_size`` set while no value refers to it would change nothing: refused, not ignored."""
    epoch_size = cfg.session.epoch_size
    if epoch_size is None:
        return []
    written = OmegaConf.to_container(cfg, resolve=False)

    def refers(value: Any) -> bool:
        if isinstance(value, dict):
            return any(refers(item) for item in value.values())
        if isinstance(value, list):
            return any(refers(item) for item in value)
        return isinstance(value, str) and ("session.epoch_size" in value or "${epochs:" in value)
    if refers(written):
        return []
    return [f"session.epoch_size={epoch_size!r}: no setting of this config refers to it, so it would change nothing; "
            f"expected max_samples, frequencies or schedules written as ${{epochs:N}} or ${{session.epoch_size}} "
            f"(docs/porting-from-cntk.md)"]


def _comm_problems(comm: DictConfig) -> list[str]:
    def at_least_a_second(name, value):
        if checks.positive_number(name, value, unit="seconds") < 1:
            raise ValueError(f"{name}={value!r}: expected at least 1 second")
    problems = _check(comm, "comm", ("timeout_s", checks.positive_number, {"unit": "seconds"}),
                      ("heartbeat_timeout_s", at_least_a_second, {}))
    problems += _hierarchy_problems(comm)
    if comm.backend not in checks.COMM_BACKENDS:
        problems.append(f"comm.backend={comm.backend!r}: expected one of {', '.join(checks.COMM_BACKENDS)}")
    elif comm.backend == "nccl":
        import torch

        if not torch.cuda.is_available():
            problems.append("comm.backend='nccl': expected a machine with CUDA (torch.cuda.is_available() is "
                            "False here); use comm.backend=gloo or auto")
    return problems


def _hierarchy_problems(comm: DictConfig) -> list[str]:
    """``comm.hierarchical`` and ``comm.ranks_per_host`` against the launch this process is part of."""
    import os

    from dtrain.comm import detect_launcher
    from dtrain.comm.hierarchical import hierarchical_setting
    from dtrain.comm.hosts import ranks_by_block

    problems = checks.collect([lambda: hierarchical_setting(comm.hierarchical)])
    try:
        size = detect_launcher(os.environ).size
    except ValueError:  # the launcher's own variables are reported when the communicator starts
        return problems
    if comm.ranks_per_host is not None:
        problems += checks.collect([lambda: ranks_by_block(size, comm.ranks_per_host)])
    if comm.hierarchical is True and size == 1:
        problems.append("comm.hierarchical=true needs a job of several processes on several hosts; this one has "
                        "1 process: use comm.hierarchical=auto or false")
    return problems


def restore_from_problems(checkpoint: DictConfig, *, look: bool = True) -> list[str]:
    """``session.checkpoint.restore_from``: null, or (with restore on) a file that exists when ``look``.

    Reads the file system only; whether the file is a checkpoint of this run is checked when it is restored.
    """
    value = checkpoint.restore_from
    if value is None:
        return []
    key = f"session.checkpoint.restore_from={value!r}"
    if not isinstance(value, str) or not value.strip():
        return [f"{key}: expected the path of a dtrain checkpoint file, or null"]
    if checkpoint.restore is False:
        return [f"{key}: expected session.checkpoint.restore=true (restore_from names the checkpoint to restore)"]
    if look and not os.path.isfile(value):
        where = "is a directory" if os.path.isdir(value) else "no such file"
        return [f"{key}: {where}; expected a dtrain checkpoint file (a relative path is from the working "
                f"directory, {os.getcwd()})"]
    return []


def run_dir_problems(run_dir: Any) -> list[str]:
    """Whether ``run_dir`` can be the run directory: a writable directory, or creatable in one.

    Reads the file system only (nothing is created), so it runs before anything is written.
    """
    key = "run_dir"
    if not isinstance(run_dir, str) or not run_dir.strip():
        return [f"{key}={run_dir!r}: expected the path of a directory (e.g. run_dir=outputs/my_run)"]
    path = os.path.abspath(run_dir)
    if os.path.lexists(path) and not os.path.isdir(path):
        kind = "an empty file" if os.path.isfile(path) and os.path.getsize(path) == 0 else "a file"
        return [f"{key}={run_dir}: is {kind}, not a directory; expected a directory (or a path that does not exist yet)"]
    existing = path
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        return [f"{key}={run_dir}: {existing} is a file, so no directory can be made below it; "
                f"expected a path below a directory"]
    if not os.access(existing, os.W_OK | os.X_OK):
        what = "the run directory" if existing == path else f"{existing}, where it would be created,"
        return [f"{key}={run_dir}: {what} is not writable (read-only or no permission); "
                f"expected a writable directory"]
    return []


def _names_a_signal(name: str) -> bool:
    try:
        signal_from_name(name)
    except ValueError:
        return False
    return True


# -- generic walks: unknown keys and non-finite numbers anywhere ----------------------------------


def _plain(value: Any) -> Any:
    if isinstance(value, (DictConfig, ListConfig)):
        return OmegaConf.to_container(value, resolve=True)
    return value


def _walk(node: DictConfig | ListConfig, name: str) -> Iterator[tuple[str, DictConfig | ListConfig, Any, Any]]:
    """Yields ``(dotted key, parent node, key, value)`` for every set value below ``node`` (resolved)."""
    keys = range(len(node)) if isinstance(node, ListConfig) else list(node.keys())
    for key in keys:
        path = f"{name}[{key}]" if isinstance(node, ListConfig) else (f"{name}.{key}" if name else str(key))
        if isinstance(node, DictConfig) and OmegaConf.is_missing(node, key):
            continue
        value = node[key]
        yield path, node, key, value
        if isinstance(value, (DictConfig, ListConfig)):
            yield from _walk(value, path)


def _unknown_key_problems(node: DictConfig, name: str) -> list[str]:
    """Keys added to a typed section that its schema does not have (``+session.max_sample=640``)."""
    schema = node._metadata.object_type
    if not (isinstance(schema, type) and dataclasses.is_dataclass(schema)):
        return []
    known = [item.name for item in dataclasses.fields(schema)]
    problems = []
    for key in node.keys():
        if key not in known:
            full = f"{name}.{key}" if name else str(key)
            close = difflib.get_close_matches(str(key), [k for k in known if not k.startswith("_")], n=1)
            hint = f"did you mean {(name + '.') if name else ''}{close[0]}?" if close else \
                f"expected one of {', '.join(k for k in known if not k.startswith('_'))}"
            problems.append(f"{full}: unknown key ({schema.__name__} has no such setting); {hint}")
    return problems


def validate(cfg: DictConfig, *, check_run_dir: bool = True) -> list[str]:
    """Every problem in a composed config, one line each (empty when the config is sound).

    Checks, all at once: unknown keys in typed sections (with or without ``+``), the rules
    registered for each ``_target_`` (learner, optimizer, model, sources, transforms, ...), the
    session and comm sections, NaN or infinity in any number, and (with ``check_run_dir``)
    whether ``run_dir`` can be written. Nothing is built or written.
    """
    if any(OmegaConf.is_missing(cfg, key) for key in ("recipe_name", "model", "source")):
        return ["no recipe chosen: add +recipe=NAME to the command line (for example +recipe=digits)"]
    problems: list[str] = []

    def run(rule: Callable[[], list[str] | None], where: str) -> None:
        try:
            problems.extend(rule() or [])
        except OmegaConfBaseException as error:  # e.g. an interpolation that does not resolve
            problems.append(f"{where}: {str(error).strip().splitlines()[0]}")

    run(lambda: _unknown_key_problems(cfg, ""), "config")
    nodes: list[tuple[str, DictConfig]] = []
    run(lambda: nodes.extend((path, value) for path, _, _, value in _walk(cfg, "")
                             if isinstance(value, DictConfig)), "config")
    for path, node in nodes:
        run(lambda: _unknown_key_problems(node, path), path)
        target = node.get("_target_") if "_target_" in node else None
        if target in RULES:
            run(lambda: RULES[target](node, path), path)
    run(lambda: _session_problems(cfg.session), "session")
    run(lambda: batchnorm_setting_problems(cfg.session), "session")
    run(lambda: _epoch_size_problems(cfg), "session.epoch_size")
    run(lambda: _comm_problems(cfg.comm), "comm")
    run(lambda: _check(cfg, "", ("seed", checks.whole_number, {"low": 0})), "seed")
    if check_run_dir:
        run(lambda: run_dir_problems(cfg.run_dir), "run_dir")
    run(lambda: restore_from_problems(cfg.session.checkpoint, look=check_run_dir), "session.checkpoint.restore_from")
    # NaN or infinity in any number no rule above has already refused
    mentioned = {problem.split("=", 1)[0].split(":", 1)[0].lstrip(".") for problem in problems}

    def non_finite() -> list[str]:
        return [f"{path}={value!r}: expected a finite number" for path, _, _, value in _walk(cfg, "")
                if isinstance(value, float) and not math.isfinite(value) and path not in mentioned]
    run(non_finite, "config")
    return list(dict.fromkeys(_one_line(problem.lstrip(".")) for problem in problems))


def _one_line(problem: str) -> str:
    """A problem as one line: OmegaConf's multi-line errors (an interpolation that does not resolve) keep
    their first line, prefixed with the key they name (``full_key: ...``)."""
    first, _, rest = problem.partition("\n")
    key = next((line.split("full_key:", 1)[1].strip() for line in rest.splitlines() if "full_key:" in line), "")
    return f"{key}: {first}" if key and key not in first else first
