"""What LARS and LAMB share: the exclusion switch applied to parameter groups, and the trust ratio."""
from __future__ import annotations

import torch


def mark_groups(param_groups: list[dict], exclude_norm_and_bias: bool) -> None:
    """Sets each group's ``adapt`` (use the trust ratio) and zeroes the weight decay of excluded groups.

    A group built by ``norm_and_bias_groups`` carries ``excluded``; plain parameters (no key) are adapted.
    """
    for group in param_groups:
        excluded = bool(group.get("excluded", False)) and exclude_norm_and_bias
        group["adapt"] = not excluded
        if excluded:
            group["weight_decay"] = 0.0


def trust_ratio(numerator_norm: torch.Tensor, denominator_norm: torch.Tensor) -> torch.Tensor:
    """``numerator / denominator``, or 1 where either norm is 0 (a fresh zero tensor, or no gradient)."""
    usable = (numerator_norm > 0) & (denominator_norm > 0)
    return torch.where(usable, numerator_norm / torch.where(usable, denominator_norm, 1.0), 1.0)
