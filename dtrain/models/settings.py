"""The config schemas of the shipped models (``conf/model``) and their value rules."""
from __future__ import annotations

from dataclasses import dataclass

from omegaconf import MISSING, DictConfig

from dtrain import checks
from dtrain.rules import StrictBool, fraction as _fraction, key_problems as _check, register_rule


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
