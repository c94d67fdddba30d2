"""A session's BatchNorm policy: ``sync_batchnorm`` (statistics over the global minibatch) and
``batchnorm_statistics`` (``running`` averages, or ``recomputed`` exactly at the end). See ``docs/batchnorm.md``.
"""
from __future__ import annotations

from functools import partial

import torch
from torch.nn.modules.batchnorm import _BatchNorm

from dtrain import checks
from dtrain.learners.replicated import ReplicatedLearner
from dtrain.nn.sync_batchnorm import BatchNormSync, batchnorm_layers, convert_sync_batchnorm
from dtrain.rules import KeyChecks, check_settings, settings_problems

BATCHNORM_STATISTICS = ("running", "recomputed")
"""``session.batchnorm_statistics``: the running averages training kept, or statistics recomputed at the end."""

DEFAULT_RECOMPUTE_SAMPLES = 4096
"""``session.batchnorm_recompute_samples``: global training samples the recomputed statistics average over."""


#: the BatchNorm settings' value rules, used by :func:`prepare_batchnorm` and by ``validate``
BATCHNORM: KeyChecks = {
    "sync_batchnorm": checks.boolean,
    "batchnorm_statistics": partial(checks.choice, choices=BATCHNORM_STATISTICS),
    "batchnorm_recompute_samples": checks.sample_count,
}


def batchnorm_setting_problems(session) -> list[str]:
    """The problems of the ``session.*`` BatchNorm settings (a config node or any object with the three fields)."""
    return settings_problems(BATCHNORM, {key: getattr(session, key) for key in BATCHNORM}, "session")


def prepare_batchnorm(model: torch.nn.Module, learner, sync_batchnorm: bool, statistics: str,
                      recompute_samples: int) -> BatchNormSync | None:
    """Checks the settings against the model and the learner and converts ``model``'s BatchNorm layers to
    :class:`~dtrain.nn.SyncBatchNorm` when either setting needs them; returns their shared
    :class:`BatchNormSync` (``None``: neither setting is on, the model is left alone).

    ``sync_batchnorm`` reduces in every training forward of a distributed minibatch; ``recomputed``
    alone converts too, but reduces only while recomputing, so training keeps per-rank statistics.

    Raises:
        ValueError: a bad value; either setting on a model without BatchNorm layers; ``sync_batchnorm``
            with a learner whose ranks hold different models between syncs (block momentum, DiLoCo).
    """
    check_settings(BATCHNORM, sync_batchnorm=sync_batchnorm, batchnorm_statistics=statistics,
                   batchnorm_recompute_samples=recompute_samples)
    sync_batchnorm = bool(sync_batchnorm)
    if not sync_batchnorm and statistics == "running":
        return None
    if next(batchnorm_layers(model), None) is None:
        setting = "sync_batchnorm=true" if sync_batchnorm else "batchnorm_statistics=recomputed"
        raise ValueError(f"{setting}: {type(model).__name__} has no BatchNorm layer, so the setting would change "
                         f"nothing; drop it (or use a model with BatchNorm, e.g. model.batch_norm=true for digits)")
    if isinstance(model, _BatchNorm):  # converting replaces layers inside a model, never the model itself
        raise ValueError(f"sync_batchnorm/batchnorm_statistics: the model is a bare {type(model).__name__}; wrap it "
                         f"in a module (e.g. torch.nn.Sequential(layer))")
    comm = learner.comm
    if sync_batchnorm and comm.size > 1 and not (isinstance(learner, ReplicatedLearner)
                                                   or getattr(learner, "holds_one_model", False)):
        raise ValueError(f"sync_batchnorm=true with the {learner.kind} learner: its ranks hold different models "
                         f"between syncs, so statistics pooled over them would describe no model; use "
                         f"learner=data_parallel (or quantized), or drop sync_batchnorm (per-rank statistics)")
    sync = BatchNormSync(comm)
    sync.in_training = sync_batchnorm
    sync.active = False  # the training loop turns it on for each distributed minibatch (MinibatchStep)
    convert_sync_batchnorm(model, sync)
    return sync


def describe(sync_batchnorm: bool, statistics: str, recompute_samples: int, world_size: int) -> str:
    """The start-up line's words for the BatchNorm settings ("" when both are off)."""
    parts = []
    if sync_batchnorm:
        parts.append("BatchNorm statistics over the global minibatch (sync_batchnorm)" if world_size > 1 else
                     "sync_batchnorm (one process: nothing to synchronize)")
    if statistics == "recomputed":
        parts.append(f"BatchNorm statistics recomputed over {recompute_samples:,} training samples at the end")
    return ", ".join(parts)


__all__ = ["BATCHNORM_STATISTICS", "DEFAULT_RECOMPUTE_SAMPLES", "batchnorm_setting_problems", "describe",
           "prepare_batchnorm"]
