"""``model.safetensors``: the trained weights alone, readable without dtrain (and without pickle); written at the
end of a run (:func:`save_weights`) and read back by the tools that use a finished run (:func:`load_weights`)."""
from __future__ import annotations

from pathlib import Path

import torch

from dtrain.safe_files import write_through_temporary


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


def load_weights(model: torch.nn.Module, path: str | Path, model_of: str = "the model") -> None:
    """Loads the weights :func:`save_weights` wrote at ``path`` into ``model`` (every tensor, in place).

    ``model_of`` names where the model came from in messages (``the model of run/config.yaml``).

    Raises:
        FileNotFoundError / OSError: the file cannot be opened.
        ValueError: one line naming the file: not a safetensors file (cut short, overwritten, another
            format), weights of another model, or weights that hold NaN or infinity.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_model

    try:
        load_model(model, str(path))
    except SafetensorError as error:
        raise ValueError(f"{path}: not a readable safetensors file ({str(error).splitlines()[0]}); expected the "
                         f"weights a finished run writes (cut short or overwritten files cannot be read)") from None
    except (RuntimeError, KeyError) as error:
        raise ValueError(f"{path} does not fit {model_of}: {str(error).splitlines()[0]}") from None
    broken = next((name for name, tensor in model.state_dict().items()
                   if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all())), None)
    if broken is not None:
        raise ValueError(f"{path}: {broken} holds NaN or infinity; expected the finite weights of a finished run")
