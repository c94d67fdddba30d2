"""The config schemas of the shipped models (``conf/model``) and their value rules, which the models'
constructors apply too."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from omegaconf import MISSING

from dtrain import checks
from dtrain.rules import KeyChecks, StrictBool, fraction as _fraction, register_rule, register_schema, settings_rule


# -- models ---------------------------------------------------------------------------------------


@register_schema("schema/model", "digits_cnn")
@dataclass
class DigitsCNNConfig:
    _target_: str = "dtrain.models.DigitsCNN"
    num_classes: int = 10
    hidden: int = 128
    dropout: float = 0.0
    batch_norm: StrictBool = False      # Conv-BatchNorm-ReLU (docs/batchnorm.md)


@register_schema("schema/model", "cifar10_convnet")
@dataclass
class ConvNetCIFAR10Config:
    _target_: str = "dtrain.models.ConvNetCIFAR10"
    num_classes: int = 10
    dropout: float = 0.5


@register_schema("schema/model", "resnet50")
@dataclass
class ResNet50Config:
    """``dtrain.models.ResNet50``; ``width`` 64 is the paper's network (smaller for quick tests)."""

    _target_: str = "dtrain.models.ResNet50"
    num_classes: int = 1000
    width: int = 64
    zero_init_residual: StrictBool = False


@register_schema("schema/model", "char_transformer")
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


@register_schema("schema/model", "seq2seq_transformer")
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


# -- models
def _at_least(low: int, unit: str) -> Callable[[str, Any], Any]:
    return lambda name, value: checks.whole_number(name, value, low=low, unit=unit)


#: each model's value rules, used by its constructor (``check_settings``) and by ``validate``
NUM_CLASSES: KeyChecks = {"num_classes": _at_least(2, "classes")}
DIGITS_CNN: KeyChecks = {**NUM_CLASSES, "hidden": _at_least(1, "units"), "dropout": _fraction(),
                         "batch_norm": checks.boolean}
CIFAR10_CONVNET: KeyChecks = {**NUM_CLASSES, "dropout": _fraction()}
RESNET: KeyChecks = {**NUM_CLASSES, "width": _at_least(1, "channels")}
RESNET50: KeyChecks = {**RESNET, "zero_init_residual": checks.boolean}


register_rule("dtrain.models.DigitsCNN", settings_rule(DIGITS_CNN))
register_rule("dtrain.models.ConvNetCIFAR10", settings_rule(CIFAR10_CONVNET))
register_rule("dtrain.models.ResNet50", settings_rule(RESNET50))
