"""``model.safetensors``: the trained weights alone, readable without dtrain (and without pickle)."""
from __future__ import annotations

from pathlib import Path

import torch

from dtrain.session.safe_files import write_through_temporary


def save_weights(model: torch.nn.Module, path: str | Path, metadata: dict[str, str] | None = None) -> Path:
    """Writes ``model``'s state dict (parameters and buffers) to ``path`` in the safetensors format.

    The file is written to a temporary name and renamed, so a reader never sees half a file and a
    link planted at ``path`` is replaced, not followed; it gets the umask's permissions like every
    other output (safetensors alone would make it readable by its owner only). A
    ``torch.compile`` wrapper is looked through, so the names are those of the plain model. Tied
    weights are stored once (``safetensors.torch.save_model``); load such a model with
    ``safetensors.torch.load_model``, any other with ``model.load_state_dict(load_file(path))``.

    Args:
        model: the trained model (any device).
        path: where to write, e.g. ``run_dir/model.safetensors``.
        metadata: string pairs stored in the file's header (e.g. the samples trained on).

    Raises:
        ImportError: the ``safetensors`` package is not installed.
    """
    from safetensors.torch import save_model  # imported here: only rank 0 writes, once, at the end

    plain = getattr(model, "_orig_mod", model)  # torch.compile's OptimizedModule keeps the model here
    return write_through_temporary(Path(path), lambda name: save_model(plain, name,
                                                                      metadata={"format": "pt", **(metadata or {})}))
