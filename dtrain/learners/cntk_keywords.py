"""CNTK's keyword arguments of its distributed-learner factories that dtrain's factories take as CNTK's code passes them.

CNTK's own tests call ``data_parallel_distributed_learner(learner=..., distributed_after=...,
use_async_buffered_parameter_update=False, num_quantization_bits=...)`` and
``block_momentum_distributed_learner(learner=..., block_size=..., distributed_after=...)``: ``learner`` is the local
learner the factory wraps (dtrain's ``optimizer``), and the asynchronous buffered update is a CNTK option dtrain
does not have, so its default (False) is accepted and True refused in one line rather than trained without.
"""
from __future__ import annotations

from typing import Any

from dtrain import checks


def wrapped_optimizer(factory: str, optimizer: Any, learner: Any) -> Any:
    """The optimizer ``factory`` wraps: ``optimizer``, or CNTK's name for it, ``learner=``, in its place.

    Raises:
        TypeError: neither is given, or both are (two optimizers for one learner).
    """
    if optimizer is not None and learner is not None:
        raise TypeError(f"{factory}() got both optimizer and learner (CNTK's name for it); give one of them")
    if optimizer is None and learner is None:
        raise TypeError(f"{factory}() missing the optimizer to wrap: {factory}(optimizer, comm, ...) "
                        f"(CNTK's learner= is accepted in its place)")
    return learner if optimizer is None else optimizer


def synchronous_update(use_async_buffered_parameter_update: Any) -> None:
    """CNTK's ``use_async_buffered_parameter_update``: False (CNTK's default) is what dtrain does, True is refused.

    Raises:
        ValueError: not a bool, or True (dtrain's updates are synchronous), one line.
    """
    if checks.boolean("use_async_buffered_parameter_update", use_async_buffered_parameter_update):
        raise ValueError("use_async_buffered_parameter_update=True: expected False (CNTK's default): dtrain's "
                         "data-parallel updates are synchronous and CNTK's asynchronous buffered update is not "
                         "implemented; leave it out or pass False")


__all__ = ["synchronous_update", "wrapped_optimizer"]
