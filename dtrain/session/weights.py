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


#: safetensors' names of torch dtypes
_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
                       torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                       torch.uint8: "U8", torch.bool: "BOOL"}


def save_sharded_weights(model: torch.nn.Module, path: str | Path, comm,
                         metadata: dict[str, str] | None = None) -> Path | None:
    """Writes a model whose parameters are sharded over ``comm``'s ranks (``DTensor``\\ s, ``learner=fsdp``) to ``path``
    as :func:`save_weights` writes a whole one: the same names, dtypes and values (tied parameters once), a file
    ``safetensors.torch.load_file`` reads. A collective: every rank calls it; rank 0 writes and returns the path
    (the others ``None``).

    Streamed: the header is known from the global shapes alone, so rank 0 writes it first, then the tensors one
    at a time in the header's order, each all-gathered (``DTensor.full_tensor()``) just before its bytes are
    written and dropped just after. Rank 0 never holds more than one whole tensor (at most one unit's worth)
    plus the file's write buffer; the other ranks hold their shards and, for one gather at a time, that tensor.

    Raises:
        OSError: the file could not be written (nothing is left at ``path``'s temporary name).
    """
    import json
    import struct

    from torch.distributed.tensor import DTensor

    state = model.state_dict()
    tied: dict[int, list[str]] = {}  # names of one tensor: kept once, under its first name in sorted order
    for name, tensor in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        if name in state:
            tied.setdefault(id(tensor), []).append(name)
    kept = {min(names) for names in tied.values()}
    entries = [(name, tensor) for name, tensor in state.items() if name in kept]
    header: dict[str, object] = {"__metadata__": {"format": "pt", **(metadata or {})}}
    offset = 0
    for name, tensor in entries:
        size = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": _SAFETENSORS_DTYPES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # safetensors aligns the data to 8 bytes

    def write(name: str | None) -> None:
        stream = open(name, "wb", buffering=1 << 20) if name is not None else None
        try:
            if stream is not None:
                stream.write(struct.pack("<Q", len(encoded)) + encoded)
            for _, tensor in entries:
                whole = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor  # a collective per tensor
                if stream is not None:
                    stream.write(whole.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
                del whole
        finally:
            if stream is not None:
                stream.close()

    if not comm.is_main:
        write(None)
        return None
    return write_through_temporary(Path(path), write)
