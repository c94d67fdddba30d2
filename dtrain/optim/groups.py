"""Parameter groups that keep normalization weights and biases out of layer-wise adaptation.

LARS and LAMB (You et al. 2017, 2019) exclude BatchNorm/LayerNorm parameters and biases from the
trust ratio and from weight decay. The rule here reads the model, not shapes: a parameter is
*excluded* when it belongs to a normalization module (any ``torch.nn`` BatchNorm, LayerNorm,
GroupNorm, InstanceNorm, LocalResponseNorm or RMSNorm) or its own name within its module is
``bias``. Everything else (weights of Linear, Conv, Embedding, attention projections, ...) is adapted.
"""
from __future__ import annotations

from typing import Any

import torch

#: module types whose every parameter is excluded (their ``weight`` is a per-channel scale)
NORMALIZATION_TYPES: tuple[type, ...] = (
    torch.nn.modules.batchnorm._NormBase, torch.nn.LayerNorm, torch.nn.GroupNorm, torch.nn.LocalResponseNorm,
    *((torch.nn.RMSNorm,) if hasattr(torch.nn, "RMSNorm") else ()),
)


def is_excluded(module: torch.nn.Module, name: str) -> bool:
    """Whether parameter ``name`` (its name within ``module``) is a normalization parameter or a bias."""
    return isinstance(module, NORMALIZATION_TYPES) or name == "bias"


def norm_and_bias_groups(model: torch.nn.Module) -> list[dict[str, Any]]:
    """``model``'s trainable parameters in two groups, in ``model.parameters()`` order within each:
    ``{"params": [...], "excluded": False}`` (adapted, decayed) then ``{"params": [...], "excluded": True}``
    (normalization parameters and biases). An empty group is left out. A tied parameter is listed once."""
    adapted, excluded, seen = [], [], set()
    for module in model.modules():
        for name, parameter in module.named_parameters(recurse=False):
            if not parameter.requires_grad or id(parameter) in seen:
                continue
            seen.add(id(parameter))
            (excluded if is_excluded(module, name) else adapted).append(parameter)
    return [group for group in ({"params": adapted, "excluded": False}, {"params": excluded, "excluded": True})
            if group["params"]]


def optimizer_parameters(optimizer_factory: Any, model: torch.nn.Module) -> Any:
    """What to give ``optimizer_factory`` (a class or a ``functools.partial`` of one): the two groups of
    :func:`norm_and_bias_groups` for an optimizer that says ``uses_norm_and_bias_groups``, else
    ``model.parameters()`` (SGD, Adam: one group, as before)."""
    cls = getattr(optimizer_factory, "func", optimizer_factory)
    if getattr(cls, "uses_norm_and_bias_groups", False):
        return norm_and_bias_groups(model)
    return model.parameters()
