"""Sharded checkpoints (``learner=fsdp``): a directory written by every rank in parallel with
``torch.distributed.checkpoint`` (DCP), with the guarantees of the one-file format (``checkpoint.py``).

``checkpoint-<samples>.pt/`` (the configured name, numbered as every checkpoint is) holds DCP's files (``.metadata``
and one ``__<rank>_0.distcp`` per writing rank: each rank's shards of the model and of the optimizer's state, keyed
by parameter name) and :data:`META`, a file in the one-file format (header, checksum, ``torch.load(weights_only)``)
with everything else a resume needs: counters, the data position, per-rank random states, the identity and
settings, the model's shapes (as ``meta`` tensors) and ``sharded``: the byte count and SHA-256 of every DCP file.

Atomic: all ranks write into a temporary directory beside the checkpoints (``.checkpoint-<samples>.pt.<random>.tmp``,
on a file system every rank sees), rank 0 then checksums the files, writes :data:`META` last, fsyncs and renames
the directory into place. A directory without a readable :data:`META`, or whose files are missing, truncated or
changed, is refused when read (``checkpoint.load``) and the newest good checkpoint is used instead.

A sharded checkpoint is restored at any world size (DCP re-shards on load) and by a replicated learner
(``data_parallel``, or ``fsdp`` on one process), which loads whole tensors from it; a replicated learner's file is
restored into a sharded model (``checkpoint_state.apply``).
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from dtrain.session.shard_manifest import META, manifest


def model_shapes(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state as ``meta`` tensors of the global shapes (what the one-file format's ``model`` entry is
    checked for when a checkpoint is restored), without any data."""
    return {name: torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
            for name, tensor in model.state_dict().items()}


def save(path: Path, meta: dict[str, Any], tensors: dict[str, Any], comm, previous: Path | None) -> None:
    """Writes a sharded checkpoint at ``path`` (a collective: every rank calls it with its own ``tensors``; ``meta``
    matters on rank 0): DCP's files from every rank, then :data:`META`, then one rename.

    Raises:
        CheckpointError: the directory could not be written (on rank 0; the temporary directory is removed and
            the earlier checkpoints are left as they were).
    """
    import torch.distributed.checkpoint as dcp

    from dtrain.session.checkpoint import CheckpointError, kept_note, save_atomic

    temporary = None
    if comm.is_main:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        os.chmod(temporary, 0o777 & ~_umask())
    temporary = Path(comm.broadcast_object(temporary, root=0))
    dcp.save(tensors, checkpoint_id=str(temporary))
    comm.barrier()  # every rank's files are complete
    if not comm.is_main:
        comm.barrier()
        return
    try:
        save_atomic({**meta, "sharded": {"files": manifest(temporary), "world_size": comm.size}},
                    temporary / META, previous=previous)
        if path.exists():  # a checkpoint of the same samples (a resumed run that saves at once) is replaced
            shutil.rmtree(path)
        os.replace(temporary, path)
        _fsync_directory(path.parent)
    except (OSError, CheckpointError) as error:
        shutil.rmtree(temporary, ignore_errors=True)
        comm.barrier()
        raise CheckpointError(f"checkpoint {path} could not be written ({getattr(error, 'strerror', None) or error}); "
                              f"{kept_note(previous)}") from None
    comm.barrier()


def load_tensors(path: Path, tensors: dict[str, Any]) -> None:
    """Reads a sharded checkpoint's tensors into ``tensors`` in place (every rank; DCP reads what each rank's
    shards, or whole tensors, need from whichever files hold them)."""
    import torch.distributed.checkpoint as dcp

    dcp.load(tensors, checkpoint_id=str(path))


def _umask() -> int:
    from dtrain.safe_files import current_umask

    return current_umask()


def _fsync_directory(directory: Path) -> None:
    handle = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(handle)
    finally:
        os.close(handle)
