"""A learner's checkpoint round trip through the API, as the session makes it: the replicated state,
this rank's own state and the model, saved to memory and restored into a fresh learner."""
from __future__ import annotations

import io

import torch


def save_learner(learner, model: torch.nn.Module) -> io.BytesIO:
    """``learner.state_dict()``, ``local_state_dict()`` and the model's state, saved to memory."""
    saved = io.BytesIO()
    torch.save({"learner": learner.state_dict(), "local": learner.local_state_dict(),
                "model": model.state_dict()}, saved)
    return saved


def restore_learner(saved: io.BytesIO, learner, model: torch.nn.Module) -> None:
    """Loads :func:`save_learner`'s output into ``model`` and a fresh ``learner``, then prepares it."""
    saved.seek(0)
    state = torch.load(saved, weights_only=True)
    model.load_state_dict(state["model"])
    learner.load_state_dict(state["learner"])
    learner.load_local_state_dict(state["local"])
    learner.prepare(model)
