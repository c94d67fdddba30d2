"""A host's model sharded over the host's ranks, for the two-level block learners (``learner.shard=true``).

INTELLECT-1's layout: inside each host the model, its gradients and the inner optimizer's state are sharded
over the host's ranks with torch's FSDP2 (one-dimensional ``DeviceMesh`` of the host's communicator), and
between hosts the block learner's outer scheme (DiLoCo, block momentum, local SGD, with any exchange) runs on
each rank's shards: the rank at place ``i`` of every host holds the same slice of every parameter, so it
exchanges its slice's delta with the place-``i`` ranks of the other hosts, and keeps the outer state
(``W_prev``, the outer optimizer's momentum) and the exchange's residual of that slice only. No rank holds the
whole model or its outer state (``docs/learners.md#fsdp``).

:class:`HostShards` is the part of the learner that knows about shards: it shards the model, tells each rank its
share of the host's minibatch (the host's gradient is the mean over the host's samples, as the unsharded
two-level learner's exact all-reduce makes it), and turns the flat outer state into ``DTensor``\\ s for a sharded
checkpoint (``torch.distributed.checkpoint``, so it is resumed at another layout) and back.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from dtrain.learners.sharding import (broadcast_from_rank0, local_tensor, process_group_of, scale_output_gradient,
                                     shard_model)

#: what a sharded learner's replicated state holds in place of a tensor that is in the sharded files
SHARDED = "sharded"
WHO = "learner.shard=true"


class HostShards:
    """The host's model sharded over ``host``'s ranks (FSDP2), and what a two-level block learner needs of it.

    Args:
        host: the communicator of this rank's host (its torch.distributed group carries the all-gathers and
            reduce-scatters).
        wrap: the FSDP units (``learner.wrap``: ``blocks``, ``children`` or a list of module class names).
    """

    def __init__(self, host, wrap: str | Sequence[str] = "blocks"):
        self.host = host
        self.wrap = wrap
        self.model: nn.Module | None = None
        self.mesh = None
        self.units: list[tuple[str, nn.Module]] = []
        self.names: dict[int, str] = {}  # id(sharded parameter) -> its name in the model
        self.host_samples = 0  # this minibatch's samples on this host (every rank of the host alike)
        self._unfolded_scale = 1.0  # the share the gradient still needs (1 once the caller folded it)

    def shard(self, model: nn.Module, optimizer: torch.optim.Optimizer, job, device: torch.device) -> None:
        """Makes every rank's model rank 0's (a broadcast over ``job``), then shards it over the host's ranks; the
        optimizer's parameters become the shards."""
        from torch.distributed.device_mesh import DeviceMesh

        broadcast_from_rank0(model, job)
        self.mesh = DeviceMesh.from_group(process_group_of(self.host, WHO), device.type)
        self.units = shard_model(model, optimizer, self.mesh, self.wrap, who=WHO)
        self.names = {id(parameter): name for name, parameter in model.named_parameters()}
        model.register_forward_hook(lambda module, inputs, output: scale_output_gradient(self, output))
        self.model = model

    @staticmethod
    def local_views(parameters: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Each parameter's local shard, detached, sharing its storage (what the block learner packs and unpacks)."""
        return [local_tensor(parameter).detach() for parameter in parameters]

    # -- one minibatch ----------------------------------------------------------------------------
    def begin_minibatch(self, local_samples: int) -> None:
        """Sums the host's samples (a collective inside the host) and sets this rank's share of them, which its
        gradient is weighted by: the reduce-scatter then sums the gradient of the host's mean loss."""
        count = torch.tensor([float(local_samples)], device=self.host.device)
        self.host_samples = int(self.host.allreduce(count, op="sum").item()) if self.host.size > 1 else local_samples
        self._unfolded_scale = local_samples / self.host_samples if self.host_samples else 1.0

    def fold_gradient_scale(self) -> float:
        """This rank's share of the host's samples, which the caller multiplies the loss by."""
        scale, self._unfolded_scale = self._unfolded_scale, 1.0
        return scale

    # -- checkpoints ------------------------------------------------------------------------------
    def as_dtensors(self, flat: torch.Tensor | None, parameters: Sequence[torch.Tensor]) -> dict[str, Any]:
        """The flat tensor of this rank's shards (``W_prev``, or an outer state of its size) as one ``DTensor`` per
        parameter, keyed by name, each placed as its parameter (None: zeros, a template to load into)."""
        from torch.distributed.tensor import DTensor

        tensors, offset = {}, 0
        for parameter in parameters:
            local = local_tensor(parameter)
            count = local.numel()
            values = torch.zeros_like(local) if flat is None else \
                flat[offset:offset + count].view_as(local).to(local.dtype)
            tensors[self.names[id(parameter)]] = DTensor.from_local(
                values.detach().clone() if flat is None else values, self.mesh, parameter.placements,
                run_check=False, shape=parameter.shape, stride=parameter.stride())
            offset += count
        return tensors

    @staticmethod
    def cut_flat(whole: torch.Tensor, parameters: Sequence[torch.Tensor]) -> torch.Tensor:
        """A flat tensor over the whole parameters (an unsharded learner's ``W_prev``, or an outer state of its size)
        as the flat tensor of this rank's shards: each parameter's local chunk, cut as the parameter is (every rank
        holds the whole tensor, so no communication)."""
        from torch.distributed.tensor import distribute_tensor

        pieces, offset = [], 0
        for parameter in parameters:
            count = parameter.numel()  # the global count
            whole_parameter = whole[offset:offset + count].view(parameter.shape).to(parameter.device)
            pieces.append(distribute_tensor(whole_parameter, parameter.device_mesh, parameter.placements,
                                            src_data_rank=None).to_local().reshape(-1).to(whole.dtype))
            offset += count
        return torch.cat(pieces)

    def as_flat(self, tensors: dict[str, Any], parameters: Sequence[torch.Tensor],
                dtype: torch.dtype) -> torch.Tensor:
        """:meth:`as_dtensors`' inverse: the local shards of ``tensors`` (by the parameters' names) in one flat tensor."""
        return torch.cat([local_tensor(tensors[self.names[id(parameter)]]).reshape(-1).to(dtype)
                          for parameter in parameters])


def outer_state_markers(state: dict[str, Any], flat_size: int) -> dict[str, Any]:
    """An outer optimizer's ``state_dict`` with each tensor of ``flat_size`` values (a state of ``W_prev``'s shape,
    sharded) replaced by :data:`SHARDED`, the rest (a step count) copied to the host."""
    return {**state, "state": {index: {key: SHARDED if _is_flat(value, flat_size)
                                       else (value.detach().cpu().clone() if torch.is_tensor(value) else value)
                                       for key, value in entries.items()}
                               for index, entries in state.get("state", {}).items()}}


def sharded_entries(state: dict[str, Any] | None) -> list[tuple[Any, str]]:
    """``(index, key)`` of every entry :func:`outer_state_markers` replaced, in order."""
    if not state:
        return []
    return [(index, key) for index, entries in state.get("state", {}).items()
            for key, value in entries.items() if isinstance(value, str) and value == SHARDED]


#: the key of a placeholder that :func:`split_tensors` leaves where a tensor went to the sharded files
IN_SHARDED_FILES = "in_sharded_files"


def split_tensors(state: Any, path: str = "") -> tuple[Any, dict[str, torch.Tensor]]:
    """``state`` (nested dicts and lists) with every tensor replaced by a small placeholder naming it, its shape and
    dtype, and the tensors by those names: the placeholders go into the checkpoint's ``dtrain.pt``, the tensors into
    the sharded files, written by the rank they belong to (a lossy exchange's residual is as large as the rank's
    slice: rank 0 does not gather them)."""
    if torch.is_tensor(state):
        return {IN_SHARDED_FILES: path, "shape": list(state.shape), "dtype": str(state.dtype).removeprefix("torch.")}, \
            {path: state.detach()}
    tensors: dict[str, torch.Tensor] = {}
    if isinstance(state, dict):
        skeleton = {}
        for key, value in state.items():
            skeleton[key], found = split_tensors(value, f"{path}/{key}")
            tensors.update(found)
        return skeleton, tensors
    if isinstance(state, (list, tuple)):
        parts = [split_tensors(value, f"{path}/{index}") for index, value in enumerate(state)]
        for _, found in parts:
            tensors.update(found)
        return type(state)(part for part, _ in parts), tensors
    return state, tensors


def _is_placeholder(value: Any) -> bool:
    return isinstance(value, dict) and IN_SHARDED_FILES in value


def placeholder_templates(skeleton: Any) -> dict[str, torch.Tensor]:
    """Empty host tensors of the shapes and dtypes :func:`split_tensors`' placeholders name, to read the files into."""
    if _is_placeholder(skeleton):
        return {skeleton[IN_SHARDED_FILES]: torch.empty(skeleton["shape"], dtype=getattr(torch, skeleton["dtype"]))}
    values = skeleton.values() if isinstance(skeleton, dict) else skeleton if isinstance(skeleton, (list, tuple)) \
        else ()
    templates: dict[str, torch.Tensor] = {}
    for value in values:
        templates.update(placeholder_templates(value))
    return templates


def join_tensors(skeleton: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """:func:`split_tensors`' inverse: the placeholders replaced by the tensors read."""
    if _is_placeholder(skeleton):
        return tensors[skeleton[IN_SHARDED_FILES]]
    if isinstance(skeleton, dict):
        return {key: join_tensors(value, tensors) for key, value in skeleton.items()}
    if isinstance(skeleton, (list, tuple)):
        return type(skeleton)(join_tensors(value, tensors) for value in skeleton)
    return skeleton


def flat_entries(state: dict[str, Any], flat_size: int) -> list[tuple[Any, str, torch.Tensor]]:
    """``(index, key, tensor)`` of an outer optimizer's ``state_dict`` entries of ``W_prev``'s size (the sharded
    ones), in order."""
    return [(index, key, value) for index, entries in state.get("state", {}).items()
            for key, value in entries.items() if _is_flat(value, flat_size)]


def cut_outer_state(state: dict[str, Any], flat_size: int, cut) -> dict[str, Any]:
    """An outer optimizer's ``state_dict`` with each entry of ``W_prev``'s whole size (``flat_size`` values) replaced
    by ``cut(entry)`` (this rank's slices of it), the rest as it is."""
    return {**state, "state": {index: {key: cut(value) if _is_flat(value, flat_size) else value
                                       for key, value in entries.items()}
                               for index, entries in state.get("state", {}).items()}}


def _is_flat(value: Any, flat_size: int) -> bool:
    """Whether an outer state entry is a tensor of ``W_prev``'s shape (flat, ``flat_size`` values): a sharded one."""
    return torch.is_tensor(value) and value.dim() == 1 and value.numel() == flat_size


__all__ = ["IN_SHARDED_FILES", "SHARDED", "HostShards", "cut_outer_state", "flat_entries", "join_tensors", "placeholder_templates",
           "split_tensors", "outer_state_markers", "sharded_entries"]
