"""The shipped Hydra config tree, composed as the CLI composes it (schemas registered first)."""
from __future__ import annotations

from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from dtrain.cli import config_dir
from dtrain.config import register_schemas

CONF = Path(config_dir())


def compose_config(*overrides: str) -> DictConfig:
    """``config.yaml`` with ``overrides`` (``+recipe=digits``, ``learner=quantized``, ...)."""
    register_schemas()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=list(overrides))
