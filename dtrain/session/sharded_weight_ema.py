"""The weight EMA of a sharded model (``learner=fsdp``, ``learner.shard=true``): each rank averages its own shards.

The rule is :mod:`dtrain.session.weight_ema`'s (``ema <- decay * ema + (1 - decay) * weights`` where the ranks hold
one model, ``decay ** k`` for a block of ``k`` steps, buffers copied), applied to each parameter's local shard, so
no rank ever holds the whole average and an update is local (no communication). Elementwise the same arithmetic as
``AveragedModel`` (``torch._foreach_lerp_``), so the sharded average equals the unsharded one wherever the weights do.

To be evaluated or exported, the average is copied into the live model's shards for the duration
(:meth:`ShardedWeightEMA.evaluated`: the forward is FSDP's, collective, as the model's own), and the shards are put
back after. In checkpoints its shards are ``DTensor``\\ s in the sharded files under ``weight_ema``; the one-file
part keeps the counters, the buffers and a ``meta`` placeholder per parameter, keyed as ``AveragedModel``'s state
(``module.<name>``), so either kind of average restores the other's checkpoint.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from dtrain.learners.sharding import local_tensor
from dtrain.session.weight_ema import UPDATES_KEY, AverageClock

_PREFIX = "module."  # AveragedModel's prefix of the averaged module's entries


class ShardedWeightEMA(AverageClock):
    """The average of a model whose parameters are ``DTensor``\\ s (sharded by FSDP2), kept as shards like them."""

    #: whether the average is kept in shards (and its tensors go in a sharded checkpoint's files)
    sharded = True

    def __init__(self, model: torch.nn.Module, decay: float) -> None:
        super().__init__(decay)
        self._live = dict(model.named_parameters())  # one entry per parameter, under its first name
        # the average's shards, placed as the parameters' (a clone: a DTensor on the same mesh)
        self.averaged = {name: parameter.detach().clone() for name, parameter in self._live.items()}
        first = {id(parameter): name for name, parameter in self._live.items()}
        # every name of each (a tied read-out's too, inside one unit), as the model's state dict and AveragedModel's
        self._names = {name: first[id(parameter)] for name, parameter in model.named_parameters(remove_duplicate=False)}
        self.buffers = {name: buffer.detach().clone() for name, buffer in model.named_buffers()}
        self.n_averaged = 0

    @property
    def updates(self) -> int:
        """How many times the average took in the weights."""
        return self.n_averaged

    def to(self, device: torch.device) -> "ShardedWeightEMA":
        """Nothing to move: the shards were cloned on the parameters' device."""
        return self

    def take_rank0s(self, comm) -> None:
        """Nothing to do: every replica of a shard takes in the same synchronized shard, and there is no whole
        average to broadcast."""

    @torch.no_grad()
    def _take_in(self, model: torch.nn.Module, decay: float) -> None:
        names = list(self.averaged)
        averaged = [local_tensor(self.averaged[name]) for name in names]
        live = [local_tensor(self._live[name].detach()) for name in names]
        if self.n_averaged == 0:  # the first update copies, as AveragedModel's
            torch._foreach_copy_(averaged, live)
        elif averaged:
            torch._foreach_lerp_(averaged, live, 1.0 - decay)
        for name, buffer in model.named_buffers():
            self.buffers[name].copy_(buffer)
        self.n_averaged += 1

    @contextlib.contextmanager
    def evaluated(self, model: torch.nn.Module) -> Iterator[torch.nn.Module]:
        """``model`` (the live sharded model) holding the average's weights and buffers until the block ends, then
        its own again (a copy of this rank's shards is kept meanwhile). Every FSDP unit is resharded before and
        after, so no forward uses parameters gathered from the other weights."""
        with torch.no_grad():
            shards = [(local_tensor(self._live[name]), local_tensor(average))
                      for name, average in self.averaged.items()]
            buffers = [(buffer, self.buffers[name]) for name, buffer in model.named_buffers()]
            _reshard(model)
            kept = [live.clone() for live, _ in shards] + [buffer.clone() for buffer, _ in buffers]
            for live, average in [*shards, *buffers]:
                live.copy_(average)
        try:
            yield model
        finally:
            with torch.no_grad():
                _reshard(model)
                for (live, _), saved in zip([*shards, *buffers], kept):
                    live.copy_(saved)

    # -- checkpoints -----------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The one-file part: the counters, the buffers, and a ``meta`` tensor of each parameter's global shape
        where the sharded files hold its shards (:meth:`sharded_state_dict`)."""
        placeholders = {key: torch.empty(average.shape, dtype=average.dtype, device="meta")
                        for key, average in self.sharded_state_dict().items()}
        buffers = {_PREFIX + name: buffer.detach().cpu().clone() for name, buffer in self.buffers.items()}
        return {UPDATES_KEY: torch.tensor(self.n_averaged), **placeholders, **buffers, **self._counters()}

    def sharded_state_dict(self) -> dict[str, Any]:
        """This rank's shards of the average (``DTensor``\\ s), as ``torch.distributed.checkpoint`` saves them."""
        return {_PREFIX + name: self.averaged[first] for name, first in self._names.items()}

    def tensors_to_read(self, saved: dict[str, Any]) -> dict[str, torch.Tensor]:
        """The shards to read from a sharded checkpoint's files (those ``saved`` has as placeholders), filled in
        place by ``torch.distributed.checkpoint`` at any world size."""
        return {key: tensor for key, tensor in self.sharded_state_dict().items()
                if isinstance(saved.get(key), torch.Tensor) and saved[key].is_meta}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores the counters and buffers; a parameter's average from a one-file checkpoint (whole tensors, an
        unsharded run's) is cut into this rank's shard, one read from the sharded files is already in place.

        Raises:
            ValueError: an entry is missing, or a placeholder was not read (a sharded checkpoint's files).
        """
        from torch.distributed.tensor import DTensor, distribute_tensor

        rest = self._load_counters(state)
        missing = [key for key in [*self.sharded_state_dict(), *(_PREFIX + name for name in self.buffers)]
                   if key not in rest]
        if missing:
            raise ValueError(f"the checkpoint's weight EMA has no {missing[0]!r}; it was written for another model")
        for name, first in self._names.items():
            average, saved = self.averaged[first], rest[_PREFIX + name]
            if saved is average or isinstance(saved, DTensor):  # read into place from the sharded files
                continue
            if saved.is_meta:
                raise ValueError(f"the weight EMA's {name!r} is in the sharded checkpoint's files and was not read")
            whole = saved.to(device=average.device, dtype=average.dtype)
            local = distribute_tensor(whole, average.device_mesh, average.placements, src_data_rank=None)
            local_tensor(average).copy_(local.to_local())
        for name, buffer in self.buffers.items():
            buffer.copy_(rest[_PREFIX + name])
        self.n_averaged = int(rest[UPDATES_KEY])


def _reshard(model: torch.nn.Module) -> None:
    """Frees every FSDP unit's gathered parameters, so that the next forward gathers the shards as they are now."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
