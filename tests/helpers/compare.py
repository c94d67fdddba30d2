"""Comparing models: between two models in one process, and between the ranks of a job."""
from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn


def max_difference(model_a: nn.Module, model_b: nn.Module) -> float:
    """The largest absolute difference between corresponding parameters of two models of one architecture."""
    return max(float((a.detach() - b.detach()).abs().max()) for a, b in zip(model_a.parameters(), model_b.parameters()))


def assert_syncs_match(label: str, got: list[torch.Tensor], expected: list[torch.Tensor], tolerance: float) -> None:
    """Each flat model of ``got`` (one per sync, then the final one) within ``tolerance`` of ``expected``'s."""
    assert len(got) == len(expected), (label, len(got), len(expected))
    for index, (mine, want) in enumerate(zip(got, expected)):
        difference = float((mine - want).abs().max())
        assert difference <= tolerance, f"{label} {index} differs from the reference by {difference}"


def differing_on_ranks(comm, tensors: Mapping[str, torch.Tensor]) -> list[str]:
    """Names of the tensors some rank holds differently from rank 0 (bitwise), sorted; a collective.

    ``tensors`` is e.g. ``dict(model.named_parameters())`` or ``model.state_dict()`` (buffers too).
    """
    everyone = comm.allgather_object({name: tensor.detach().cpu() for name, tensor in tensors.items()})
    return sorted({name for copy in everyone[1:] for name in tensors if not torch.equal(copy[name], everyone[0][name])})
