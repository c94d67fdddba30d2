"""The config schemas of ``optimizer=lars|lamb|rmsprop_warmup_sgd`` and their value rules (registered here per
``_target_``); the optimizers' constructors apply the same rules (``OPTIMIZER``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dtrain import checks
from dtrain.rules import KeyChecks, StrictBool, fraction, register_rule, register_schema, settings_problems



@dataclass
class LARSConfig:
    """``dtrain.optim.LARS``: momentum SGD with a per-tensor trust ratio (You, Gitman, Ginsburg 2017)."""

    _target_: str = "dtrain.optim.LARS"
    _partial_: bool = True
    lr: float = 0.1
    momentum: float = 0.9
    eta: float = 0.001                  # trust coefficient
    weight_decay: float = 0.0005
    eps: float = 1e-9
    exclude_norm_and_bias: StrictBool = True  # normalization parameters and biases: no trust ratio, no decay


@dataclass
class LAMBConfig:
    """``dtrain.optim.LAMB``: Adam moments, decoupled weight decay, per-tensor trust ratio (You et al. 2019)."""

    _target_: str = "dtrain.optim.LAMB"
    _partial_: bool = True
    lr: float = 1e-3
    momentum: float = 0.9               # beta1
    variance_momentum: float = 0.999    # beta2
    eps: float = 1e-6
    weight_decay: float = 0.01
    bias_correction: StrictBool = True
    exclude_norm_and_bias: StrictBool = True


@dataclass
class RMSpropWarmupSGDConfig:
    """``dtrain.optim.RMSpropWarmupSGD``: RMSprop becoming momentum SGD around ``center_samples`` (Akiba et al. 2017)."""

    _target_: str = "dtrain.optim.RMSpropWarmupSGD"
    _partial_: bool = True
    lr: float = 0.1
    momentum: float = 0.9
    variance_momentum: float = 0.99
    eps: float = 1e-8
    weight_decay: float = 0.0
    center_samples: int = 100_000       # global samples where the update is half SGD (the paper's beta_center)
    period_samples: int = 50_000        # the rise's width: all SGD at center + period/2 (beta_period)
    rmsprop_scale: float = 0.01         # RMSprop's part steps at lr x rmsprop_scale (alpha_rmsprop's size)


def _non_negative(name: str, value: Any) -> Any:
    return checks.positive_number(name, value, allow_zero=True)


#: every optimizer hyper-parameter's value rule, used by dtrain's optimizers' constructors and by ``validate``
OPTIMIZER: KeyChecks = {
    "lr": checks.positive_number, "eta": checks.positive_number, "eps": checks.positive_number,
    "momentum": fraction(), "variance_momentum": fraction(), "weight_decay": _non_negative,
    "bias_correction": checks.boolean, "exclude_norm_and_bias": checks.boolean,
    "period_samples": checks.sample_count, "rmsprop_scale": checks.positive_number,
    "center_samples": lambda name, value: checks.sample_count(name, value, allow_zero=True),
}


def problems(node: Any, name: str) -> list[str]:
    """One line per value of an ``optimizer=lars|lamb|rmsprop_warmup_sgd`` node out of range."""
    return settings_problems(OPTIMIZER, node, name)


#: (config name, schema) of each option; each is registered as ``schema/optimizer/<name>``, and :func:`problems`
#: is their rule
OPTIONS: dict[str, type] = {"lars": LARSConfig, "lamb": LAMBConfig, "rmsprop_warmup_sgd": RMSpropWarmupSGDConfig}


for _name, _schema in OPTIONS.items():
    register_schema("schema/optimizer", _name, _schema)
    register_rule(_schema._target_, problems)
