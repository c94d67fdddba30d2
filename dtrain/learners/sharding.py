"""Sharding a model with torch's FSDP2: which modules are units, the checks FSDP2 needs, and the sharding itself.

Shared by ``learner=fsdp`` (:mod:`dtrain.learners.fsdp`: shards over the job, or HSDP) and the two-level block
learners with ``shard=true`` (:mod:`dtrain.learners.host_shards`: shards inside each host, an outer scheme between
hosts). Each unit's parameters are all-gathered just before its forward and backward and its gradients
reduce-scattered just after, summed (never averaged: the caller folds each rank's share into its loss).
"""
from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

#: ``learner.wrap``'s words (besides a list of module class names)
WRAP_WORDS = ("blocks", "children")
#: ``learner.param_dtype`` / ``learner.reduce_dtype``
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def wrapped_units(model: nn.Module, wrap: str | Sequence[str]) -> list[tuple[str, nn.Module]]:
    """The modules ``wrap`` chooses as FSDP units, as ``(qualified name, module)`` in model order (the root is
    always a unit besides these, for the parameters no unit holds).

    ``"blocks"``: every element of every ``nn.ModuleList`` (a transformer's blocks); ``"children"``: every
    top-level child that holds parameters; a list of class names: every module of one of those classes
    (outermost only: a match inside another match is left to it).

    Raises:
        ValueError: the policy matches no module (one line naming the policy and what the model holds).
    """
    if isinstance(wrap, str):
        if wrap == "blocks":
            units = [(f"{name}.{index}" if name else str(index), block)
                     for name, module in model.named_modules() if isinstance(module, nn.ModuleList)
                     for index, block in enumerate(module)]
        elif wrap == "children":
            units = [(name, child) for name, child in model.named_children()
                     if any(True for _ in child.parameters())]
        else:
            raise ValueError(f"learner.wrap={wrap!r}: expected blocks, children or a list of module class names")
    else:
        names = set(wrap)
        units, inside = [], set()
        for name, module in model.named_modules():
            if module is model or type(module).__name__ not in names:
                continue
            if any(name.startswith(outer + ".") for outer in inside):
                continue
            inside.add(name)
            units.append((name, module))
    units = [(name, module) for name, module in units if any(True for _ in module.parameters())]
    if not units:
        classes = sorted({type(module).__name__ for _, module in model.named_modules() if module is not model})
        what = "no nn.ModuleList of blocks" if wrap == "blocks" else "no child with parameters" \
            if wrap == "children" else f"modules of the classes {', '.join(classes[:8])}"
        raise ValueError(f"learner.wrap={_as_written(wrap)} matches no module of {type(model).__name__} (it has "
                         f"{what}); name its block classes (learner.wrap=[ClassName]) or use children")
    return units


def _as_written(wrap: str | Sequence[str]) -> str:
    return wrap if isinstance(wrap, str) else "[" + ",".join(wrap) + "]"


def tied_across_units(model: nn.Module, units: list[tuple[str, nn.Module]]) -> str | None:
    """One line naming a parameter shared by two units (or by a unit and the rest of the model); None when none is.

    FSDP2 shards each parameter in exactly one unit and all-gathers it only around that unit's forward and
    backward, so a parameter used by another unit would be read sharded there."""
    owner: dict[int, str] = {}
    for unit_name, unit in units:
        for name, parameter in unit.named_parameters(remove_duplicate=False):
            where = owner.setdefault(id(parameter), unit_name)
            if where != unit_name:
                return f"{unit_name}.{name} is tied to a parameter of {where}"
    unit_modules = {id(unit) for _, unit in units}

    def outside(module: nn.Module, prefix: str):
        for child_name, child in module.named_children():
            if id(child) in unit_modules:
                continue
            yield from ((f"{prefix}{child_name}.{n}", p) for n, p in child.named_parameters(recurse=False))
            yield from outside(child, f"{prefix}{child_name}.")

    rest = [*((n, p) for n, p in model.named_parameters(recurse=False)), *outside(model, "")]
    for name, parameter in rest:
        if id(parameter) in owner:
            return f"{name} (outside every unit) is tied to a parameter of {owner[id(parameter)]}"
    return None


def process_group_of(comm, who: str = "learner=fsdp"):
    """The torch.distributed group ``comm`` reduces through (FSDP2 needs one: Gloo, NCCL, or MPI's Gloo group).

    Raises:
        ValueError: a communicator without a torch.distributed group.
    """
    import torch.distributed as dist

    group = getattr(comm, "_group", None)
    if group is None and dist.is_initialized() and dist.get_world_size() == comm.size:
        group = dist.group.WORLD
    if group is None:
        raise ValueError(f"{who} needs a torch.distributed process group (comm.backend=gloo, mpi or nccl); "
                         f"the {type(comm).__name__} communicator has none")
    return group


class _ScaleGradient(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by the owner's unfolded share of the minibatch."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, learner: Any) -> torch.Tensor:  # noqa: D102
        ctx.learner = learner
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, gradient: torch.Tensor):  # noqa: D102
        scale = ctx.learner._unfolded_scale
        return (gradient if scale == 1.0 else gradient * scale), None


def checkpoint_activations(unit: nn.Module) -> None:
    """``unit``'s forward recomputed in backward (non-reentrant ``torch.utils.checkpoint``); its parameter names
    stay as they are (the forward is replaced on the instance, the module is not wrapped)."""
    from torch.utils.checkpoint import checkpoint

    forward = unit.forward
    unit.forward = functools.partial(checkpoint, forward, use_reentrant=False)


def shard_model(model: nn.Module, optimizer: torch.optim.Optimizer, mesh, wrap: str | Sequence[str], *,
                reshard_after_forward: bool = True, param_dtype: str = "float32", reduce_dtype: str = "float32",
                cpu_offload: bool = False, activation_checkpointing: bool = False,
                who: str = "learner=fsdp") -> list[tuple[str, nn.Module]]:
    """``fully_shard``-s the units ``wrap`` chooses and then the root over ``mesh`` (every rank of the mesh calls it,
    with the same model), makes every unit sum its gradients, and replaces the optimizer's parameters (and any state
    it holds) by their shards; returns the units. The caller makes the ranks' values equal first.

    Raises:
        ValueError: the policy matches no module, or parameters are tied across units (one line each, naming
            ``who``).
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard

    units = wrapped_units(model, wrap)
    tied = tied_across_units(model, units)
    if tied is not None:
        raise ValueError(f"{who} with learner.wrap={_as_written(wrap)}: {tied}; FSDP2 shards each "
                         f"parameter in one unit, so tied parameters must live in one unit: choose a wrap that "
                         f"leaves both users in the same unit (or outside every unit), or untie them")
    names = {id(parameter): name for name, parameter in model.named_parameters()}
    options: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": reshard_after_forward,
                               "mp_policy": MixedPrecisionPolicy(param_dtype=DTYPES[param_dtype],
                                                                 reduce_dtype=DTYPES[reduce_dtype])}
    if cpu_offload:
        options["offload_policy"] = CPUOffloadPolicy()
    for _, unit in units:
        if activation_checkpointing:
            checkpoint_activations(unit)
        fully_shard(unit, **options)
    fully_shard(model, **options)
    for module in model.modules():
        if isinstance(module, FSDPModule):  # sums, never averages: the loss carries each rank's share
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    replace_optimizer_parameters(optimizer, mesh, names, dict(model.named_parameters()), who)
    return units


def replace_optimizer_parameters(optimizer: torch.optim.Optimizer, mesh, names: dict[int, str],
                                 sharded: dict[str, nn.Parameter], who: str = "learner=fsdp") -> None:
    """The optimizer's parameters (and any state it holds) become the shards of the same name."""
    from torch.distributed.tensor import distribute_tensor

    for group in optimizer.param_groups:
        replaced = []
        for parameter in group["params"]:
            if id(parameter) not in names:
                raise ValueError(f"{who}: the optimizer holds a parameter that is not the model's; build "
                                 f"the optimizer from model.parameters()")
            new = sharded[names[id(parameter)]]
            state = optimizer.state.pop(parameter, None)
            if state:
                optimizer.state[new] = {
                    key: distribute_tensor(value.to(new.device), mesh, new.placements)
                    if torch.is_tensor(value) and value.shape == new.shape and value.dim() > 0 else value
                    for key, value in state.items()}
            replaced.append(new)
        group["params"] = replaced


def scale_output_gradient(owner: Any, output: Any) -> Any:
    """``output`` with the gradient flowing back through it multiplied by ``owner._unfolded_scale`` (read at backward
    time), where the caller did not fold its share into the loss (a forward hook's return value; None: unchanged)."""
    if not torch.is_grad_enabled() or owner._unfolded_scale == 1.0:
        return None
    return torch.utils._pytree.tree_map_only(
        torch.Tensor, lambda tensor: _ScaleGradient.apply(tensor, owner)
        if tensor.requires_grad and tensor.is_floating_point() else tensor, output)


def broadcast_from_rank0(model: nn.Module, comm) -> None:
    """Every rank's parameters and buffers become rank 0's (over ``comm``, through its device), before sharding."""
    for tensor in [*model.parameters(), *model.buffers()]:
        comm.broadcast(tensor.data, root=0) if tensor.device.type == comm.device.type else \
            tensor.data.copy_(comm.broadcast(tensor.data.to(comm.device), root=0))


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A ``DTensor``'s local shard (sharing its storage: writing it writes the parameter), or ``tensor`` itself."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def optimizer_state_by_name(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
                            ) -> dict[str, Any]:
    """A torch optimizer state dict keyed by parameter numbers (``optimizer.state_dict()``) keyed by the
    parameters' names instead, as ``torch.distributed.checkpoint.state_dict`` keys it."""
    names = {id(parameter): name for name, parameter in model.named_parameters()}
    ordered = [names[id(parameter)] for group in optimizer.param_groups for parameter in group["params"]]
    number = {index: name for index, name in enumerate(ordered)}
    return {"state": {number[int(index)]: value for index, value in state["state"].items()},
            "param_groups": [{**group, "params": [number[int(index)] for index in group["params"]]}
                             for group in state["param_groups"]]}


def load_full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any],
                              sharded: bool) -> None:
    """Loads a replicated optimizer state dict (whole tensors, every rank the same) into ``optimizer``, sharding
    it where the model is sharded."""
    if not sharded:
        optimizer.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(model, optimizer, optimizer_state_by_name(model, optimizer, state),
                             options=StateDictOptions(full_state_dict=True))


def sharded_session_problems(who: str, *, precision: str, compile: bool,  # noqa: A002
                             batchnorm_statistics: str) -> list[str]:
    """The session settings a learner with sharded parameters (``who``: ``learner=fsdp``, ``learner.shard=true``)
    cannot honour, one line each."""
    problems = []
    if precision == "fp16":
        problems.append(f"session.precision=fp16 with {who}: fp16's loss scaling needs every rank's overflow verdict "
                        f"on whole gradients; use learner.param_dtype=bfloat16 (FSDP's mixed precision) or "
                        f"session.precision=bf16")
    if compile:
        problems.append(f"session.compile=true with {who}: the compiled whole model would trace through FSDP's "
                        f"all-gathers, which dtrain does not support yet; set session.compile=false")
    if batchnorm_statistics == "recomputed":
        problems.append(f"session.batchnorm_statistics=recomputed with {who}: the recomputing passes are not "
                        f"collective; use batchnorm_statistics=running (with sync_batchnorm=true if wanted)")
    return problems


__all__ = ["DTYPES", "WRAP_WORDS", "broadcast_from_rank0", "checkpoint_activations", "load_full_optimizer_state",
           "local_tensor", "optimizer_state_by_name", "process_group_of", "replace_optimizer_parameters",
           "scale_output_gradient", "shard_model", "sharded_session_problems", "tied_across_units", "wrapped_units"]
