"""``learner=fsdp``: parameters, gradients and optimizer state sharded over the ranks (ZeRO-3), with torch's FSDP2.

The update is the data-parallel learner's: N ranks make the update one process makes on the global minibatch,
each rank's gradient weighted by its share of the samples (uneven shares, sequences, micro-batches), exactly as
``learner=data_parallel``. What changes is where the model lives: every rank holds ``1/N`` of each parameter, of
its gradient and of the optimizer's state (``torch.distributed.fsdp.fully_shard`` over a one-dimensional
``DeviceMesh`` of the job's ranks); a wrapped unit's parameters are all-gathered just before its forward and its
backward and its gradients reduce-scattered just after, so only one unit is whole at a time.

How the weighting stays exact: FSDP2 averages gradients by default (divides by N); here every unit sums them
(``set_gradient_divide_factor(1.0)`` with sum-only collectives, which Gloo supports too) and each rank's loss is
multiplied by ``local_samples / global_samples`` before backward (:meth:`FSDPLearner.fold_gradient_scale`, which
``training_session`` calls; a hand-driven loop that does not gets the same factor applied to the gradient
flowing out of the model's output). A rank without samples still makes an (empty) forward and backward, since
every unit's all-gather and reduce-scatter is a collective (:attr:`FSDPLearner.collective_forward`).

Where the shards are cut (``shard_over``): over the whole job (one flat group, the default), or inside each host
and replicated across hosts (``"host"``: HSDP, torch's two-dimensional ``DeviceMesh`` of ``(replicate, shard)``),
where a host's ranks all-gather and reduce-scatter among themselves and only the reduced shards cross hosts, once
per step (an all-reduce of each shard between the ranks holding it). The update is the same either way. Shards
inside each host under an outer scheme between hosts (DiLoCo, block momentum) are the two-level block learners'
``shard=true`` (:mod:`dtrain.learners.host_shards`).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from dtrain.learners.base import Learner
from dtrain.learners.replicated import make_buffers_consistent
from dtrain.learners.settings import FSDP
from dtrain.learners.sharding import (_as_written, broadcast_from_rank0, load_full_optimizer_state,
                                     optimizer_state_by_name, process_group_of, scale_output_gradient, shard_model,
                                     sharded_session_problems, tied_across_units, wrapped_units)
from dtrain.rules import check_settings

class FSDPLearner(Learner):
    """Synchronous data-parallel SGD on a model sharded over the ranks (ZeRO-3, torch's FSDP2): the update of the
    mean loss over the GLOBAL minibatch, as :class:`~dtrain.learners.DataParallelLearner` makes it.

    ``training_session`` hands the model over once (:meth:`shard`), before anything reads it: the chosen units and
    then the root are ``fully_shard``-ed over the job's ranks, the optimizer's parameters are replaced by their
    sharded counterparts (same order, same groups), and rank 0's values are what every rank starts from. From then
    on ``model.parameters()`` are ``DTensor`` shards: checkpoints are sharded (``torch.distributed.checkpoint``,
    every rank writing its part: ``dtrain.session.sharded_checkpoint``) and ``model.safetensors`` is gathered one
    tensor at a time (``dtrain.session.weights.save_sharded_weights``).

    With one process nothing is sharded: it is the local learner (and writes ordinary checkpoints).

    Args:
        optimizer: the torch optimizer of the model's (unsharded) parameters.
        comm: the job's communicator (its torch.distributed group carries the all-gathers and reduce-scatters).
        wrap: what is a unit (all-gathered whole for its forward and backward): ``"blocks"`` (each element of
            the model's ``nn.ModuleList``\\ s: transformer blocks), ``"children"`` (each top-level child with
            parameters) or a list of module class names.
        reshard_after_forward: free a unit's gathered parameters after its forward (gathered again for
            backward: least memory); ``False`` keeps them until its backward (one all-gather less per unit).
        param_dtype: ``"float32"`` or ``"bfloat16"``: the dtype units compute in (FSDP2's ``MixedPrecisionPolicy``:
            the sharded parameters and optimizer state stay float32).
        reduce_dtype: the dtype gradients are reduce-scattered in (``"float32"``, or ``"bfloat16"``).
        cpu_offload: keep the shards, their gradients and the optimizer step on the CPU between uses
            (``CPUOffloadPolicy``); only where training runs on a GPU.
        activation_checkpointing: recompute each unit's activations in backward instead of keeping them
            (``torch.utils.checkpoint``, non-reentrant).
        shard_over: ``"job"`` (every rank holds ``1/N``) or ``"host"`` (HSDP: each host's ranks hold ``1/R`` each,
            ``R`` ranks a host, every host the whole model; hosts from the launcher, or ``comm.ranks_per_host``).

    Raises:
        ValueError: a setting out of range (one line ``learner.NAME=value: expected ...``); from :meth:`shard`, a
            policy that matches no module, parameters tied across units, ``cpu_offload`` on a CPU run.
    """

    kind = "fsdp"
    #: ranks hold one model (sharded): statistics pooled over them describe it (``sync_batchnorm``)
    holds_one_model = True

    def __init__(self, optimizer: torch.optim.Optimizer, comm=None, wrap: str | Sequence[str] = "blocks",
                 reshard_after_forward: bool = True, param_dtype: str = "float32", reduce_dtype: str = "float32",
                 cpu_offload: bool = False, activation_checkpointing: bool = False, shard_over: str = "job"):
        super().__init__(optimizer, comm, 0)
        if not isinstance(wrap, str):
            wrap = list(wrap)
        check_settings(FSDP, wrap=wrap, reshard_after_forward=reshard_after_forward, param_dtype=param_dtype,
                       reduce_dtype=reduce_dtype, cpu_offload=cpu_offload,
                       activation_checkpointing=activation_checkpointing, shard_over=shard_over)
        self.shard_over = shard_over
        self.shard_ranks = self.comm.size  # the ranks one model's shards are spread over (a host's, for "host")
        self.wrap = wrap
        self.reshard_after_forward = bool(reshard_after_forward)
        self.param_dtype, self.reduce_dtype = param_dtype, reduce_dtype
        self.cpu_offload = bool(cpu_offload)
        self.activation_checkpointing = bool(activation_checkpointing)
        self.model: nn.Module | None = None
        self.units: list[tuple[str, nn.Module]] = []  # the FSDP units besides the root, once sharded
        self.mesh = None
        self._unfolded_scale = 1.0  # state: the share the gradient still needs (1 once the caller folded it)

    # -- what the session reads -----------------------------------------------------------------
    @property
    def shards_model(self) -> bool:
        """Whether the model's parameters are sharded over the ranks (several processes)."""
        return self.comm.size > 1

    @property
    def collective_forward(self) -> bool:
        """Whether every forward and backward is a collective (a rank without samples makes an empty pass)."""
        return self.shards_model

    def session_problems(self, *, precision: str, compile: bool, ema_decay: float | None,  # noqa: A002
                         batchnorm_statistics: str) -> list[str]:
        """The session settings this learner cannot honour with sharded parameters, one line each."""
        if not self.shards_model:
            return []
        return sharded_session_problems("learner=fsdp", precision=precision, compile=compile,
                                        batchnorm_statistics=batchnorm_statistics)

    # -- sharding -----------------------------------------------------------------------------------
    def shard(self, model: nn.Module, device: torch.device | str = "cpu") -> None:
        """Shards ``model`` over the job's ranks (every rank calls it once, with the same model): units chosen by
        ``wrap``, then the root; the optimizer's parameters become the shards. Rank 0's values win (a
        collective broadcast first). A second call with the same model does nothing; with one process, nothing
        is sharded.

        Raises:
            ValueError: the policy matches no module, parameters are tied across units, or ``cpu_offload`` on the
                CPU (one line each).
        """
        if self.model is model:
            return
        if self.model is not None:
            raise ValueError("learner=fsdp: this learner already sharded another model; build one learner per model")
        device = torch.device(device)
        if self.cpu_offload and device.type == "cpu":
            raise ValueError("learner.cpu_offload=true: this run trains on the CPU, where the shards already live; "
                             "drop cpu_offload (it moves GPU shards to host memory)")
        self.model = model
        if not self.shards_model:
            return
        from torch.distributed.device_mesh import DeviceMesh

        group = process_group_of(self.comm)
        # rank 0's model for everyone, as data_parallel starts (a model built from one seed is the same anyway)
        broadcast_from_rank0(model, self.comm)
        self.mesh = self._host_mesh(device.type) if self.shard_over == "host" else \
            DeviceMesh.from_group(group, device.type)
        self.units = shard_model(model, self.optimizer, self.mesh, self.wrap,
                                 reshard_after_forward=self.reshard_after_forward, param_dtype=self.param_dtype,
                                 reduce_dtype=self.reduce_dtype, cpu_offload=self.cpu_offload,
                                 activation_checkpointing=self.activation_checkpointing)
        model.register_forward_hook(self._scale_output_gradient)

    def _host_mesh(self, device_type: str):
        """HSDP's mesh: ``(replicate, shard)``, a host's ranks along ``shard``, the ranks of the same place on every
        host along ``replicate`` (each a sub-communicator's torch.distributed group; collective).

        Raises:
            ValueError: hosts of different numbers of ranks (the mesh is a rectangle).
        """
        import torch.distributed as dist
        from torch.distributed.device_mesh import DeviceMesh

        hosts = self.comm.host_ranks(self.comm.ranks_per_host)
        if len({len(ranks) for ranks in hosts}) > 1:
            raise ValueError(f"learner.shard_over=host needs as many ranks on every host; the hosts have "
                             f"{', '.join(str(len(ranks)) for ranks in hosts)} (set comm.ranks_per_host, or "
                             f"learner.shard_over=job)")
        host = next(index for index, ranks in enumerate(hosts) if self.comm.rank in ranks)
        place = hosts[host].index(self.comm.rank)
        inside = self.comm.split(host, key=self.comm.rank)
        across = self.comm.split(place, key=host)
        global_rank = self.comm.allgather_object(dist.get_rank())  # the mesh names the default group's ranks
        layout = torch.tensor([[global_rank[rank] for rank in ranks] for ranks in hosts])
        self.shard_ranks = len(hosts[0])
        return DeviceMesh.from_group([process_group_of(across), process_group_of(inside)], device_type, mesh=layout,
                                     mesh_dim_names=("replicate", "shard"))

    def prepare(self, model: nn.Module) -> None:
        """Shards ``model`` if :meth:`shard` was not called with it (a hand-driven loop)."""
        self.shard(model, self.comm.device if self.shards_model else "cpu")

    # -- one minibatch ------------------------------------------------------------------------------
    def begin_minibatch(self, local_samples: int, global_samples: int) -> None:
        """Clears the gradients and records the counts; this rank's gradient is to be weighted by its share."""
        super().begin_minibatch(local_samples, global_samples)
        self._unfolded_scale = local_samples / global_samples if self.shards_model and global_samples else 1.0

    def fold_gradient_scale(self) -> float:
        """This rank's share ``local_samples / global_samples``, which the caller multiplies the loss by (the
        reduce-scatter then sums exactly the gradient of the global mean loss)."""
        scale, self._unfolded_scale = self._unfolded_scale, 1.0
        return scale

    def _scale_output_gradient(self, module: nn.Module, inputs: Any, output: Any) -> Any:
        """Forward hook on the root: where the caller did not fold the share into the loss, the gradient flowing
        back out of the model's output is multiplied by it (read at backward time)."""
        return scale_output_gradient(self, output)

    def apply_update(self) -> None:
        """The optimizer's step on the shards: their gradients were reduce-scattered during backward (the sum of
        every rank's share-weighted gradient: the gradient of the global mean loss). Every rank steps, also one
        without samples: its shards got the others' gradients. Micro-batches reduce-scatter after every pass and
        accumulate the sharded sums (no unsharded gradient is kept between passes)."""
        if self.shards_model or self.local_samples > 0:
            self._step_optimizer()

    def synchronize(self) -> None:
        """Floating-point buffers (BatchNorm statistics, kept whole on every rank) averaged over the ranks, the
        others taken from rank 0, so evaluation and checkpoints see one model (the parameters are one already)."""
        if self.shards_model and self.model is not None:
            make_buffers_consistent(self.model, self.comm, 25 * 2 ** 20)

    def describe(self) -> str:
        """The learner and how it shards."""
        if not self.shards_model:
            return f"learner {self.kind} (one process: nothing to shard, the local learner's update)"
        extras = [f"{len(self.units)} units ({_as_written(self.wrap)}) and the root"]
        if not self.reshard_after_forward:
            extras.append("gathered parameters kept from forward to backward")
        if self.param_dtype != "float32" or self.reduce_dtype != "float32":
            extras.append(f"computing in {self.param_dtype}, reducing in {self.reduce_dtype}")
        if self.cpu_offload:
            extras.append("shards offloaded to the CPU")
        if self.activation_checkpointing:
            extras.append("activations recomputed per unit")
        hosts = self.comm.size // self.shard_ranks
        if self.shard_over == "host" and self.shard_ranks == 1:
            over = f"held whole by each of the {hosts} hosts' one rank (HSDP with nothing to shard)"
        elif self.shard_over == "host" and hosts > 1:
            over = f"sharded over the {self.shard_ranks} ranks of each host and replicated over the {hosts} hosts " \
                   f"(HSDP)"
        else:
            over = f"sharded over {self.comm.size} ranks"
        return f"learner {self.kind}: parameters, gradients and optimizer state {over}, " + ", ".join(extras)

    # -- checkpoints -------------------------------------------------------------------------------
    def checkpoint_identity(self) -> dict[str, Any]:
        """The kind alone: how the model is cut into units, its dtypes and offloading leave the state as it is."""
        return {"kind": self.kind}

    def state_dict(self) -> dict[str, Any]:
        """The counters; with sharded parameters the optimizer's state is not here but in
        :meth:`sharded_state_dict` (written by every rank), else the optimizer's state dict as every learner's."""
        if not self.shards_model:
            return super().state_dict()
        return {"kind": self.kind, "samples_seen": self.samples_seen, "distributed_after": 0}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores the counters and, from a replicated checkpoint (``data_parallel``'s, or this learner's in one
        process), the optimizer's whole state, sharded here; the state of a sharded checkpoint comes back through
        :meth:`load_sharded_state_dict`."""
        if state.get("kind") not in INTERCHANGEABLE_KINDS:
            raise ValueError(f"checkpoint was written by the {state.get('kind')!r} learner, this run uses "
                             f"{self.kind!r}; use fsdp or data_parallel, or start a new run directory")
        if "optimizer" in state:
            load_full_optimizer_state(self.model, self.optimizer, state["optimizer"], sharded=self.shards_model)
        self.samples_seen = int(state["samples_seen"])

    def sharded_state_dict(self, local_state: dict[str, Any] | None = None) -> dict[str, Any]:
        """``{"model": ..., "optimizer": ...}``: this rank's shards (``DTensor``\\ s keyed by parameter name), as
        ``torch.distributed.checkpoint`` saves and loads them (``local_state``: this learner keeps none there)."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        return {"model": model_state, "optimizer": optimizer_state}

    def load_sharded_state_dict(self, tensors: dict[str, Any]) -> None:
        """:meth:`sharded_state_dict`'s tensors, read, into the model's shards and the optimizer's state."""
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(self.model, self.optimizer, model_state_dict=tensors["model"],
                       optim_state_dict=tensors["optimizer"])


#: learners whose checkpoints hold the same thing (one model and the optimizer state of the global minibatch's
#: update), so each restores the other's: a sharded checkpoint into a replicated learner and back
INTERCHANGEABLE_KINDS = ("fsdp", "data_parallel", "local")


def fsdp_learner(optimizer: torch.optim.Optimizer, comm=None, wrap: str | Sequence[str] = "blocks",
                 reshard_after_forward: bool = True, param_dtype: str = "float32", reduce_dtype: str = "float32",
                 cpu_offload: bool = False, activation_checkpointing: bool = False,
                 shard_over: str = "job") -> FSDPLearner:
    """``learner=fsdp``: an :class:`FSDPLearner` (its settings; a config's list arrives as a ListConfig)."""
    if wrap is not None and not isinstance(wrap, str):
        wrap = [str(name) for name in wrap]
    return FSDPLearner(optimizer, comm, wrap=wrap, reshard_after_forward=reshard_after_forward,
                       param_dtype=param_dtype, reduce_dtype=reduce_dtype, cpu_offload=cpu_offload,
                       activation_checkpointing=activation_checkpointing, shard_over=shard_over)


__all__ = ["FSDPLearner", "INTERCHANGEABLE_KINDS", "fsdp_learner", "load_full_optimizer_state",
           "optimizer_state_by_name", "tied_across_units", "wrapped_units"]
