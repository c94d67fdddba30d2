"""Two levels: exact data-parallel steps inside each host, a block learner's sync between hosts.

On several hosts the ranks of one host share memory, where an exact all-reduce is nearly free, and
the links between hosts are slow. :class:`TwoLevel` makes any :class:`~dtrain.learners.block.BlockLearner`
two-level: every minibatch the ranks of a host average their gradients exactly over the host's
communicator (one model per host, identical on its ranks after every step), and every block the
hosts' models are synced by the block learner's own outer update (DiLoCo's Nesterov step, BMUF's
filter, local SGD's average), its deltas exchanged between the hosts' leaders by any exchange strategy (e.g.
4-bit), as OpenDiLoCo / INTELLECT-1 train (``docs/multi-host.md#two-levels``).
With ``shard=true`` each host's model is sharded over its ranks (FSDP2) and every rank exchanges its own slice
(:mod:`dtrain.learners.host_shards`), INTELLECT-1's layout.

Why the leaders: the hosts' deltas are identical on the ranks of a host, so one rank per host
sends it; splitting it into per-local-rank slices would send the same bytes between hosts but
cut the matrices PowerSGD compresses, and needs equal hosts for every rank to have a slice.

:class:`TwoLevelDataParallelLearner` keeps synchronous data parallel instead: every step's gradient
is summed exactly inside each host and compressed between the host leaders only
(``docs/multi-host.md#gradients-between-hosts``).
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from dtrain.comm.hosts import describe_hosts
from dtrain.comm.local import LocalCommunicator
from dtrain.exchange import AllReduce, Exchange, full_precision_allreduce_bytes
from dtrain.exchange.between_hosts import BetweenHosts
from dtrain.learners.base import AUTO
from dtrain.learners.block import BlockLearner
from dtrain.learners.flat_copies import broadcast, pack, unpack
from dtrain.learners.host_shards import (HostShards, cut_outer_state, flat_entries, join_tensors,
                                        outer_state_markers, placeholder_templates, sharded_entries, split_tensors)
from dtrain.learners.sharding import load_full_optimizer_state, sharded_session_problems
from dtrain.learners.block_momentum import BlockMomentumLearner
from dtrain.learners.data_parallel import DataParallelLearner
from dtrain.learners.diloco import DiLoCoLearner
from dtrain.learners.local_sgd import LocalSGDLearner
from dtrain.learners.outer import load_outer_state
from dtrain.learners.settings import HOST_SHARDS, refuse_retired
from dtrain.rules import check_settings


def host_layout(comm, ranks_per_host: int | None, equal_hosts: bool = True,
                one_level: str = "learner=data_parallel or learner=diloco") -> tuple[list[list[int]], str]:
    """``(ranks of each host, where the hosts came from)`` for a two-level learner on ``comm``
    (collective). Raises ValueError for one host (naming the ``one_level`` learners to use instead),
    or hosts of different sizes with ``equal_hosts``."""
    if ranks_per_host is None and comm.local_size == comm.size:
        hosts = [list(range(comm.size))]  # the launcher put every rank on this node
    else:
        hosts = comm.host_ranks(ranks_per_host)
    source = f"comm.ranks_per_host={ranks_per_host}" if ranks_per_host is not None else f"the {comm.launcher} launcher"
    if len(hosts) < 2:
        raise ValueError(f"a two-level learner needs several hosts; this job runs on {describe_hosts(hosts)} (from "
                         f"{source}): use the one-level learner (e.g. {one_level}), or "
                         f"comm.ranks_per_host=N to rehearse N ranks per host on one machine")
    if equal_hosts and len({len(ranks) for ranks in hosts}) > 1:
        raise ValueError(f"a two-level learner needs the same number of ranks on every host (each host's model is "
                         f"weighted equally); this job runs on {describe_hosts(hosts)} (from {source})")
    return hosts, source


class TwoLevel:
    """Mixin over a :class:`BlockLearner` subclass (first in the bases): one model per host.

    * Each minibatch: the host's ranks sum ``[grad * local_samples, local_samples]`` exactly over
      the host communicator, divide by the host's samples (the gradient of the host's mean loss)
      and step; the host's ranks step on the same gradient, so they hold the same parameters.
    * Warm start (before ``distributed_after``): each host trains on the whole global minibatch,
      split among its ranks, with no traffic between hosts; at its end rank 0's model is everyone's.
    * Each block: the leaders (local rank 0) exchange ``d_host = W_prev - W_host`` over the
      cross-host communicator (``outer_comm``, size H) with the learner's strategy and broadcast the
      sum over the host; every rank then makes the learner's outer update with ``N = H``. BatchNorm
      statistics are averaged exactly over all ranks.

    ``block_size`` counts the job's samples and the sync period is ``block_size // (ranks in the
    job)`` per rank, as for the one-level learners; ``"auto"`` rules take ``N`` = the number of hosts
    (the models that train apart). ``ranks_per_host`` (None: ``comm.ranks_per_host``, else the
    launcher's hosts) groups the ranks.
    """

    outer_name = "a block learner"
    """The outer scheme, in words (the start-up line)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if not issubclass(cls, BlockLearner):
            raise TypeError(f"{cls.__qualname__}: TwoLevel nests a block learner (DiLoCoLearner, LocalSGDLearner, "
                            f"a BlockLearner of your own) between hosts: put it first among the bases of a BlockLearner subclass")

    def __init__(self, optimizer, comm=None, *args, ranks_per_host: int | None = None, shard: bool = False,
                 wrap: str | Sequence[str] = "blocks", **kwargs):
        if kwargs.get("overlap"):
            raise ValueError("learner.overlap=true: the two-level learners do not overlap their exchange between hosts "
                             "yet; use a one-level block learner (learner=diloco, block_momentum, local_sgd) with "
                             "learner.overlap=true, or learner.overlap=false")
        comm = comm if comm is not None else LocalCommunicator()
        if ranks_per_host is None:
            ranks_per_host = getattr(comm, "ranks_per_host", None)
        hosts, self.hosts_source = host_layout(comm, ranks_per_host)
        self.hosts = hosts
        self.host_index = next(index for index, ranks in enumerate(hosts) if comm.rank in ranks)
        self.host = comm.host_groups(ranks_per_host).local
        # local rank i of every host; on the leaders (i = 0) the communicator of the delta exchange
        cross = comm.split(self.host.rank, key=self.host_index)
        self.host_shards: HostShards | None = None  # set below; read by synced_tensors
        super().__init__(optimizer, comm, *args, outer_comm=cross, **kwargs)
        if not isinstance(wrap, str):
            wrap = [str(name) for name in wrap]
        check_settings(HOST_SHARDS, shard=shard, wrap=wrap)
        self.shard_requested = bool(shard)
        # the host's model sharded over its ranks (None: one model on every rank, or nothing to shard on one rank)
        self.host_shards = HostShards(self.host, wrap) if shard and self.host.size > 1 else None
        self._gradients: torch.Tensor | None = None
        self._restored_hosts: list[int] | None = None
        self._read_local_tensors: dict[str, torch.Tensor] = {}  # with shards: the exchange's tensors, as read
        self._loading_shards = False  # with shards: between load_state_dict() and load_sharded_state_dict()
        self._cutting = False  # with shards: restoring an unsharded checkpoint (load_state_dict cuts it)

    @property
    def is_leader(self) -> bool:
        """Whether this rank exchanges its host's delta with the other hosts (local rank 0; every rank, its own
        slice, where the host's model is sharded)."""
        return self.host.rank == 0 or self.host_shards is not None

    # -- the host's model sharded (learner.shard=true) ---------------------------------------------
    @property
    def shards_model(self) -> bool:
        """Whether each host's model is sharded over its ranks (``shard=true`` with several ranks a host)."""
        return self.host_shards is not None

    @property
    def collective_forward(self) -> bool:
        """With shards, every forward and backward is a collective inside the host."""
        return self.host_shards is not None

    @property
    def synced_tensors(self) -> list[torch.Tensor]:
        """The optimizer's parameters; with shards, this rank's local slices of them (what the outer scheme syncs;
        the parameters themselves stay the sharded ones, whose gradients clipping and the optimizer read)."""
        shards = self.host_shards
        return self.parameters if shards is None or shards.model is None else shards.local_views(self.parameters)

    def shard(self, model: torch.nn.Module, device: torch.device | str = "cpu") -> None:
        """With shards: rank 0's model for every rank, then sharded over each host's ranks (FSDP2)."""
        if self.host_shards is not None and self.host_shards.model is not model:
            if self.host_shards.model is not None:
                raise ValueError(f"{self.kind}: this learner already sharded another model; build one learner per "
                                 f"model")
            self.host_shards.shard(model, self.optimizer, self.comm, torch.device(device))

    def session_problems(self, *, precision: str, compile: bool, ema_decay: float | None,  # noqa: A002
                         batchnorm_statistics: str) -> list[str]:
        """With shards, the session settings sharded parameters cannot honour, one line each."""
        if self.host_shards is None:
            return []
        return sharded_session_problems("learner.shard=true", precision=precision, compile=compile,
                                        batchnorm_statistics=batchnorm_statistics)

    def prepare(self, model: torch.nn.Module) -> None:
        """Shards ``model`` first where the session did not (a hand-driven loop), then the block learner's."""
        if self.host_shards is not None and self.host_shards.model is None:
            self.shard(model, self.comm.device)
        super().prepare(model)

    def begin_minibatch(self, local_samples: int, global_samples: int) -> None:
        """The base's; with shards, the host's samples summed (a collective inside the host)."""
        super().begin_minibatch(local_samples, global_samples)
        if self.host_shards is not None:
            self.host_shards.begin_minibatch(local_samples)

    def fold_gradient_scale(self) -> float:
        """With shards, this rank's share of its host's samples (the reduce-scatter sums the host's mean gradient)."""
        return self.host_shards.fold_gradient_scale() if self.host_shards is not None else 1.0

    def broadcast_model(self) -> None:
        """Rank 0's model for every rank; with shards, host 0's slices to the same place on every host."""
        if self.host_shards is None:
            super().broadcast_model()
            return
        broadcast(self.synced_tensors, self.outer_comm)  # the outer communicator's rank 0 is host 0's
        broadcast(self._float_buffers + self._other_buffers, self.comm)

    def model_replicas(self) -> int:
        """The hosts: one model each between syncs."""
        return len(self.hosts)

    def data_partition(self) -> tuple[int, int]:
        """The job's partition once blocks run; during the warm start the host's (every host reads the whole minibatch)."""
        if self.is_distributed():
            return self.comm.size, self.comm.rank
        return self.host.size, self.host.rank

    def describe(self) -> str:
        """The host layout, then the block learner's line."""
        inner = "exact gradient all-reduce inside each host every step"
        between = "the host leaders"
        if self.host_shards is not None:
            inner = (f"each host's model, gradients and optimizer state sharded over its {self.host.size} ranks "
                     f"(FSDP2, {len(self.host_shards.units)} units and the root)")
            between = "the ranks holding the same slice on every host"
        elif self.shard_requested:
            inner += " (learner.shard=true: one rank a host, nothing to shard)"
        return (f"two levels over {describe_hosts(self.hosts)} (from {self.hosts_source}): {inner}, "
                f"{type(self).outer_name} between {between}; "
                f"{super().describe().replace('local training on the full stream', 'each host on the full stream')}")

    # -- the step inside the host -----------------------------------------------------------------
    def _local_step(self) -> None:
        """The host's exact data-parallel step: the sample-weighted mean gradient over the host's ranks (with shards,
        reduce-scattered in backward already)."""
        if self.host_shards is not None:
            if self.host_shards.host_samples:  # no sample on this host in this minibatch: its ranks skip alike
                self._step_with_share(self.host_shards.host_samples / self.global_samples)
            return
        parameters = self.parameters
        count = self._num_parameter_elements
        if self._gradients is None:
            self._gradients = torch.empty(count + len(parameters) + 1, dtype=self._scratch.dtype,
                                          device=self._scratch.device)
        flat, weight = self._gradients, float(self.local_samples)
        flags = flat[count:count + len(parameters)]
        offset = 0
        with torch.no_grad():
            for index, parameter in enumerate(parameters):
                size = parameter.numel()
                has_gradient = parameter.grad is not None and weight > 0
                if has_gradient:
                    flat[offset:offset + size].copy_(parameter.grad.reshape(-1)).mul_(weight)
                else:
                    flat[offset:offset + size].zero_()
                flags[index] = float(has_gradient)
                offset += size
            flat[-1] = weight
            started = time.perf_counter()
            self.host.allreduce(flat, op="sum")
            self.exchange_seconds_last_step = time.perf_counter() - started
            host_samples = float(flat[-1])
            if host_samples == 0:
                return  # no sample on this host in this minibatch: its ranks skip the step alike
            flat[:count].div_(host_samples)
            offset = 0
            for index, parameter in enumerate(parameters):
                size = parameter.numel()
                if flags[index] > 0:
                    mean = flat[offset:offset + size].view_as(parameter)
                    if parameter.grad is None:
                        parameter.grad = mean.to(parameter.dtype).clone()
                    else:
                        parameter.grad.copy_(mean)
                else:
                    parameter.grad = None
                offset += size
        self._step_with_share(host_samples / self.global_samples)

    # -- the sync between hosts -------------------------------------------------------------------
    def _exchange_model_delta(self) -> None:
        """Sums the hosts' deltas over the leaders with the strategy, broadcasts the sum inside each
        host, and averages the floating-point buffers exactly over every rank."""
        if self.host_shards is not None:  # every rank exchanges its slice with the same place on the other hosts
            seconds = self.exchange_seconds_last_step
            super()._exchange_model_delta()  # BatchNorm statistics averaged over the same place of every host
            self.average_float_buffers(self.host)  # then over the host: the mean over every rank (equal hosts)
            self.exchange_seconds_last_step += seconds  # after this step's reduce-scatters
            return
        started = time.perf_counter()
        scratch, count = self._scratch, self._num_parameter_elements
        buffers = scratch[count:]
        pack(self._float_buffers, buffers)
        if buffers.numel():
            self.host.allreduce(buffers, op="sum")
        sent = full = 0
        if self.is_leader:
            self.exchange.begin_step()
            extra = 0
            if self.exchange.lossless:
                self.exchange.allreduce_("model", scratch, [torch.Size([count]), torch.Size([buffers.numel()])])
            else:
                self.exchange.allreduce_("model", scratch[:count], [p.shape for p in self.synced_tensors])
                if buffers.numel():
                    self.outer_comm.allreduce(buffers, op="sum")
                    extra = full_precision_allreduce_bytes(buffers.numel(), self.outer_comm.size) \
                        * buffers.element_size() // 4
            sent = self.exchange.bytes_sent_last_step + extra
            full = self.exchange.full_precision_bytes_last_step + extra
        self.host.broadcast(scratch, root=0)
        unpack(buffers.div_(self.comm.size), self._float_buffers)
        self._bytes_sent_last_sync, self._full_precision_bytes_last_sync = sent, full
        self.bytes_sent_total += sent
        self.exchange_seconds_last_step += time.perf_counter() - started  # after this step's host all-reduce

    # -- checkpoints ------------------------------------------------------------------------------
    def checkpoint_identity(self) -> dict[str, Any]:
        """The block learner's, and ``shard`` where the host's model is sharded (its checkpoints are sharded)."""
        identity = super().checkpoint_identity()
        return {**identity, "shard": True} if self.host_shards is not None else identity

    def state_dict(self) -> dict[str, Any]:
        """The block learner's state plus the layout ``[hosts, ranks per host]`` it was trained on; with shards,
        without the tensors :meth:`sharded_state_dict` holds (the inner optimizer's state, ``W_prev``, the outer
        state of ``W_prev``'s size)."""
        state = {**super().state_dict(), "hosts": [len(self.hosts), len(self.hosts[0])]}
        if self.host_shards is not None:
            state.pop("optimizer", None)
            state["block"]["sharded"] = True
        return state

    def block_tensors(self) -> tuple[torch.Tensor | None, dict[str, Any] | None]:
        """The block learner's; with shards, none of ``W_prev`` and only the outer state's small entries (a step
        count), the others marked as in the sharded files."""
        if self.host_shards is None:
            return super().block_tensors()
        outer = self._restored_outer if self.outer_optimizer is None else self.outer_optimizer.state_dict()
        return None, None if outer is None else outer_state_markers(outer, self._num_parameter_elements)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The block learner's restore; the model, ``W_prev``, the outer state and the counters carry
        over to any layout. Remembers the saved layout for :meth:`load_local_state_dict`; with shards, the outer
        state's small entries, the rest coming from :meth:`load_sharded_state_dict`. With shards from an unsharded
        checkpoint (``learner.shard`` turned on): ``W_prev``, the outer state and the inner optimizer's state are cut
        into this rank's slices (:meth:`_cut_into_slices`)."""
        self._cutting = self.host_shards is not None and not (state.get("block") or {}).get("sharded")
        whole_optimizer = None
        if self._cutting:
            state, whole_optimizer = self._cut_into_slices(state)
        super().load_state_dict(state)
        self._restored_hosts = list(state.get("hosts") or [])
        if whole_optimizer is not None:  # rank 0's (host 0's); at the same layout each rank's own comes after
            load_full_optimizer_state(self.host_shards.model, self.optimizer, whole_optimizer, sharded=True)
        if self.host_shards is not None and not self._cutting:
            self._restored_outer = state["block"].get("outer_optimizer")
            self._loading_shards = True  # sharded_state_dict() is now the template of the checkpoint's tensors

    def _cut_into_slices(self, state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """An unsharded checkpoint's learner state as this sharded learner reads it: ``W_prev`` and the outer state
        of its size cut into this rank's slices (every rank holds the whole: no communication), and the inner
        optimizer's whole state taken out, to be sharded (returned beside)."""
        state = dict(state)
        whole_optimizer = state.pop("optimizer", None)
        block = dict(state["block"])
        parameters, whole = self.parameters, sum(parameter.numel() for parameter in self.parameters)

        def cut(tensor: torch.Tensor) -> torch.Tensor:
            return self.host_shards.cut_flat(tensor, parameters)

        for key in ("prev_parameters", "smoothed_gradient"):  # the last: checkpoints from before outer optimizers
            if block.get(key) is not None:
                block[key] = cut(block[key])
        if block.get("outer_optimizer") is not None:
            block["outer_optimizer"] = cut_outer_state(block["outer_optimizer"], whole, cut)
        state["block"] = block
        if self.comm.is_main:
            print(f"dtrain: the checkpoint's hosts were not sharded and this run's are (learner.shard=true): W_prev, "
                  f"the outer state and the inner optimizer's state are cut into each rank's slices; the "
                  f"{self.exchange.name} exchange state starts afresh", flush=True)
        return state, whole_optimizer

    def local_state_dict(self) -> dict[str, Any]:
        """The block learner's; with shards, the exchange's state alone, its tensors replaced by placeholders (they
        are in the sharded files, as the inner optimizer's state is)."""
        if self.host_shards is None:
            return super().local_state_dict()
        return {"exchange": split_tensors(self.exchange.state_dict())[0]}

    def _optimizer_key(self) -> str:
        """Where the sharded files keep this host's inner optimizer state (each host's differs between syncs): its
        own host's, or on another layout than the checkpoint's, host 0's."""
        layout = [len(self.hosts), len(self.hosts[0])]
        restored = self._restored_hosts
        return f"optimizer_host{0 if restored and restored != layout else self.host_index}"

    def sharded_state_dict(self, local_state: dict[str, Any] | None = None) -> dict[str, Any]:
        """This rank's shards as ``torch.distributed.checkpoint`` saves (and loads) them: the model, this host's
        inner optimizer state, ``W_prev`` and the outer state of its size (``DTensor``\\ s keyed by parameter name),
        and this rank's exchange state (its own key). To load: ``local_state`` is this rank's
        :meth:`local_state_dict` as the checkpoint holds it (at the same world size; None: not read)."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        shards, parameters = self.host_shards, self.parameters
        model_state, optimizer_state = get_state_dict(shards.model, self.optimizer)
        if self._loading_shards:  # a template to read into: the entries the checkpoint's run had
            prev = None
            entries = [(f"{index}_{key}", None) for index, key in sharded_entries(self._restored_outer)]
        else:
            prev, outer = self.prev_parameters, self.outer_optimizer.state_dict()
            entries = [(f"{index}_{key}", value)
                       for index, key, value in flat_entries(outer, self._num_parameter_elements)]
        outer_tensors = {name: shards.as_dtensors(value, parameters) for name, value in entries}
        tensors = {"model": model_state, self._optimizer_key(): optimizer_state,
                   "outer": {"prev_parameters": shards.as_dtensors(prev, parameters), **outer_tensors}}
        if not self._loading_shards:
            tensors[f"rank{self.comm.rank}"] = split_tensors(self.exchange.state_dict())[1]
        elif local_state is not None:  # at the same world size
            tensors[f"rank{self.comm.rank}"] = placeholder_templates(local_state.get("exchange"))
        return tensors

    def load_sharded_state_dict(self, tensors: dict[str, Any]) -> None:
        """:meth:`sharded_state_dict`'s tensors, read, into the model, the inner optimizer, ``W_prev`` and the outer
        state (the last two taken by :meth:`prepare`)."""
        from torch.distributed.checkpoint.state_dict import set_state_dict

        shards, parameters = self.host_shards, self.parameters
        set_state_dict(shards.model, self.optimizer, model_state_dict=tensors["model"],
                       optim_state_dict=tensors[self._optimizer_key()])
        dtype = torch.promote_types(parameters[0].dtype, torch.float32) if parameters else torch.float32
        outer = tensors["outer"]
        prev = shards.as_flat(outer["prev_parameters"], parameters, dtype)
        restored = self._restored_outer
        for index, key in sharded_entries(restored):
            restored["state"][index][key] = shards.as_flat(outer[f"{index}_{key}"], parameters, dtype)
        if self.outer_optimizer is None:  # prepare() takes them
            self.prev_parameters = prev
        else:  # prepared already (a hand-driven restore): into the tensors the outer optimizer steps
            self.prev_parameters.copy_(prev)
            load_outer_state(self.outer_optimizer, self.prev_parameters, restored)
            self._restored_outer = None
        self._read_local_tensors = tensors.get(f"rank{self.comm.rank}", {})  # for load_local_state_dict
        self._loading_shards = False

    def load_local_state_dict(self, state: dict[str, Any]) -> None:
        """This rank's optimizer and exchange state, only onto the layout that saved them; onto
        another (same ranks, other hosts) every rank keeps rank 0's optimizer state and a fresh exchange."""
        layout = [len(self.hosts), len(self.hosts[0])]
        if self._restored_hosts and self._restored_hosts != layout:
            if self.comm.is_main:
                print(f"dtrain: the checkpoint was trained on {self._restored_hosts[0]} hosts x "
                      f"{self._restored_hosts[1]} ranks, this run has {layout[0]} x {layout[1]}: every rank continues "
                      f"with rank 0's optimizer state and a fresh {self.exchange.name} exchange state", flush=True)
            return
        if self._cutting:  # an unsharded checkpoint: this rank's (its host's) whole optimizer state, sharded
            if "optimizer" in state:
                load_full_optimizer_state(self.host_shards.model, self.optimizer, state["optimizer"], sharded=True)
            return
        if self.host_shards is not None and "exchange" in state:
            state = {**state, "exchange": join_tensors(state["exchange"], self._read_local_tensors)}
        super().load_local_state_dict(state)


class TwoLevelDiLoCoLearner(TwoLevel, DiLoCoLearner):
    """``learner=two_level_diloco``: exact data-parallel steps inside each host, DiLoCo's outer
    Nesterov step between hosts (``N`` = hosts); arguments as :class:`DiLoCoLearner`'s plus ``ranks_per_host``."""

    kind = "two_level_diloco"
    outer_name = "DiLoCo"


class TwoLevelBlockMomentumLearner(TwoLevel, BlockMomentumLearner):
    """``learner=two_level_block_momentum``: exact data-parallel steps inside each host, BMUF's filtered
    sync between hosts (CNTK's default time constant with ``N`` = hosts); arguments as
    :class:`BlockMomentumLearner`'s plus ``ranks_per_host``."""

    kind = "two_level_block_momentum"
    outer_name = "block momentum"


class TwoLevelLocalSGDLearner(TwoLevel, LocalSGDLearner):
    """``learner=two_level_local_sgd``: exact data-parallel steps inside each host, the hosts'
    models averaged every block; arguments as :class:`LocalSGDLearner`'s plus ``ranks_per_host``."""

    kind = "two_level_local_sgd"
    outer_name = "local SGD"


class TwoLevelDataParallelLearner(DataParallelLearner):
    """``learner=two_level_quantized`` / ``two_level_powersgd``: data parallel whose exchange runs between hosts only.

    Every minibatch each gradient bucket is summed exactly (float32) inside each host, the host
    leaders sum the host sums with ``exchange`` (k-bit with error feedback, PowerSGD, ...; ``N`` =
    the hosts, its state on the leaders), and each leader broadcasts the result inside its host
    (:class:`~dtrain.exchange.between_hosts.BetweenHosts`): one model on every rank after every step,
    bucket by bucket and overlapped with backward as for :class:`DataParallelLearner`. A
    compressing strategy's float32 warm start takes the same three steps in float32 (the
    hierarchical all-reduce). Hosts may hold different numbers of ranks: the sum weights every
    sample alike, whatever its host.

    Args: as :class:`DataParallelLearner` (``exchange`` None: float32 between the hosts), plus
    ``ranks_per_host`` (None: ``comm.ranks_per_host``, else the launcher's hosts).

    Raises:
        ValueError: one host or one process (use ``learner=quantized`` or ``learner=powersgd``), or
            any of :class:`DataParallelLearner`'s.
        TypeError: ``exchange`` is not an exchange strategy.
    """

    kind = "two_level_data_parallel"

    def __init__(self, optimizer: torch.optim.Optimizer, comm=None, distributed_after: int | str = AUTO,
                 bucket_size_mb: float = 25.0, exchange: Exchange | None = None, overlap_backward: bool = True,
                 warm_start_mode: str | None = None, ranks_per_host: int | None = None,
                 freeze_variance: bool | str = AUTO, **retired: Any):
        refuse_retired(type(self).__name__, retired)
        comm = comm if comm is not None else LocalCommunicator()
        if ranks_per_host is None:
            ranks_per_host = getattr(comm, "ranks_per_host", None)
        self.hosts, self.hosts_source = host_layout(comm, ranks_per_host, equal_hosts=False,
                                                    one_level="learner=quantized or learner=powersgd")
        groups = comm.host_groups(ranks_per_host)
        between = BetweenHosts(exchange if exchange is not None else AllReduce(), groups)
        super().__init__(optimizer, comm, distributed_after, bucket_size_mb, exchange=between,
                         overlap_backward=overlap_backward, warm_start_mode=warm_start_mode,
                         freeze_variance=freeze_variance)
        if self.warm_start_exchange is not None:  # float32 warm start: the same three steps, exact
            self.warm_start_exchange = BetweenHosts(AllReduce(), groups)
            self.warm_start_exchange.bind(self.comm)
        self._restored_hosts: list[int] | None = None

    @property
    def layout(self) -> list[int]:
        """The ranks of each host, counted: what the leaders' exchange state belongs to."""
        return [len(ranks) for ranks in self.hosts]

    @property
    def is_leader(self) -> bool:
        """Whether this rank exchanges its host's sum with the other hosts (its host's lowest rank)."""
        return self.exchange.is_leader

    @property
    def bytes_between_hosts_last_step(self) -> int:
        """Bytes this rank sent to other hosts in the last distributed step (0 off the leaders)."""
        return int(self._active.bytes_between_hosts_last_step)

    def describe(self) -> str:
        """The host layout, then the data-parallel learner's line."""
        return (f"two levels over {describe_hosts(self.hosts)} (from {self.hosts_source}): gradients summed exactly "
                f"inside each host every step, then between the host leaders; {super().describe()}")

    def progress_note(self) -> str:
        """Bytes this rank sent between hosts and in all in the last step, once the strategy runs."""
        if not self.bytes_sent_last_step:
            return ""
        if self._active is not self.exchange:
            return f"float32 warm start until {self.distributed_after:,} samples"
        return (f"{self.exchange.inner.describe()}: {self.bytes_between_hosts_last_step / 1e3:,.0f} kB between hosts/step, "
                f"{self.bytes_sent_last_step / 1e3:,.0f} kB sent/step")

    # -- checkpoints ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The data-parallel learner's state plus the host layout (ranks per host) it was trained on."""
        return {**super().state_dict(), "hosts": self.layout}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The replicated state; the strategy's state starts afresh, with a line (rank 0) when the
        checkpoint's host layout differs from this run's (it then stays fresh)."""
        super().load_state_dict({**state, "exchange_world_size": None})
        self._restored_hosts = list(state["hosts"]) if state.get("hosts") else None
        saved = self._restored_hosts
        if saved and saved != self.layout and self.exchange.stateful and self.comm.is_main:
            print(f"dtrain: the {self.exchange.inner.name} exchange state between hosts was saved on "
                  f"{describe_hosts([range(count) for count in saved])}, this run has {describe_hosts(self.hosts)}: "
                  f"starting it afresh", flush=True)

    def load_local_state_dict(self, state: dict[str, Any]) -> None:
        """This rank's strategy state, only onto the host layout that saved it."""
        if self._restored_hosts and self._restored_hosts != self.layout:
            return
        super().load_local_state_dict(state)


__all__ = ["TwoLevel", "TwoLevelBlockMomentumLearner", "TwoLevelDataParallelLearner", "TwoLevelDiLoCoLearner",
           "TwoLevelLocalSGDLearner", "host_layout"]
