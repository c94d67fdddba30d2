"""The config schemas of the data sources (``conf/source``) and their value rules."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import MISSING, DictConfig, OmegaConf

from dtrain import checks
from dtrain.rules import StrictBool, key_problems as _check, register_rule, register_schema


# -- data sources ---------------------------------------------------------------------------------


@register_schema("schema/source", "image_transform")
@dataclass
class ImageTransformConfig:
    """``dtrain.data.ImageTransform``: CNTK's random side crop, flip and mean subtraction."""

    _target_: str = "dtrain.data.ImageTransform"
    crop_side_ratio: Optional[float] = None
    flip: StrictBool = False
    mean: Optional[str] = None
    scale: float = 1.0


@register_schema("schema/source", "minibatch_source")
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
    randomization_window_in_chunks: Optional[int] = None   # chunked data (shards): chunks per window; null = the reader's
    randomization_window_in_samples: Optional[int] = None  # ... or samples per window (at most one of the two)


@register_schema("schema/source", "source")
@dataclass
class SourceConfig:
    """The training source, and optional test and cross-validation sources."""

    train: MinibatchSourceConfig = MISSING
    test: Optional[MinibatchSourceConfig] = None
    cv: Optional[MinibatchSourceConfig] = None


@register_schema("schema/source", "image_source")
@dataclass
class ImageSourceConfig(SourceConfig):
    """Map-file image sources; ``backend`` picks PIL decoding (``native``) or a DALI pipeline (``dali``)."""

    backend: str = "native"
    image_size: list[int] = field(default_factory=lambda: [256, 256])  # decode size [H, W], pixels
    crop_size: list[int] = field(default_factory=lambda: [224, 224])   # network input [H, W], pixels


@register_schema("schema/source", "shard_source")
@dataclass
class ShardSourceConfig(SourceConfig):
    """Sources over shard files (``source=char_parquet``, ``source=char_tar``): ``data_dir`` holds ``train/``
    and ``validation/``."""

    data_dir: str = MISSING


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
        ("randomization_window_in_chunks", checks.whole_number, {"low": 1, "allow_none": True, "unit": "chunks"}),
        ("randomization_window_in_samples", checks.sample_count, {"allow_none": True}),
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
