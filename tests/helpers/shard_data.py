"""Small shard files in the real formats, written by the tests: Parquet (row groups), Arrow IPC and
WebDataset tar. Every sample carries its global id and a token sequence whose content is a function of
the id, so a reader's output can be checked sample by sample and a ledger kept of what was read."""
from __future__ import annotations

import io
import tarfile
from pathlib import Path

import numpy as np


def shard_sizes(num_shards: int = 5, base: int = 37) -> list[int]:
    """Uneven shard sizes, so that sweeps and windows end inside shards."""
    return [base + 11 * shard for shard in range(num_shards)]


def tokens_of(sample_id: int) -> np.ndarray:
    """The token sequence of sample ``sample_id``: 2 to 10 steps of ids below 13 (the tiny test models'
    vocabulary), each a function of the id."""
    length = 2 + (sample_id * 7919) % 9
    return (sample_id + np.arange(length, dtype=np.int64)) % 13


def features_of(sample_id: int) -> np.ndarray:
    """A fixed-size float value of the sample: [2, 3]."""
    return (sample_id + np.arange(6, dtype=np.float32)).reshape(2, 3)


def write_parquet_shards(directory: Path, sizes: list[int], row_group_size: int = 16, arrow: bool = False,
                         lengths_column: bool = False) -> list[Path]:
    """Shards of columns ``id`` (int64), ``features`` (fixed-size list [2, 3] float32) and ``tokens``
    (list of int64); ``.arrow`` IPC streams (as ``datasets`` writes) with ``arrow``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    directory.mkdir(parents=True, exist_ok=True)
    files, first = [], 0
    for shard, size in enumerate(sizes):
        ids = np.arange(first, first + size, dtype=np.int64)
        first += size
        features = pa.FixedSizeListArray.from_arrays(
            pa.FixedSizeListArray.from_arrays(pa.array(np.concatenate([features_of(i).ravel() for i in ids])), 3), 2)
        tokens = [tokens_of(int(i)) for i in ids]
        columns = {"id": pa.array(ids), "features": features, "tokens": pa.array(tokens, pa.list_(pa.int64()))}
        if lengths_column:
            columns["tokens_lengths"] = pa.array([len(t) for t in tokens], pa.int32())
        table = pa.table(columns)
        if arrow:
            path = directory / f"data-{shard:05d}-of-{len(sizes):05d}.arrow"
            with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
                for batch in table.to_batches(max_chunksize=row_group_size):
                    writer.write_batch(batch)
        else:
            path = directory / f"part-{shard:05d}.parquet"
            pq.write_table(table, path, row_group_size=row_group_size)
        files.append(path)
    return files


def write_tar_shards(directory: Path, sizes: list[int]) -> list[Path]:
    """WebDataset shards: per sample ``KEY.cls`` (the id), ``KEY.features.npy`` and ``KEY.tokens.npy``."""
    directory.mkdir(parents=True, exist_ok=True)
    files, first = [], 0
    for shard, size in enumerate(sizes):
        path = directory / f"shard-{shard:05d}.tar"
        with tarfile.open(path, "w") as tar:
            for sample_id in range(first, first + size):
                key = f"sample{sample_id:07d}"
                add_member(tar, f"{key}.cls", str(sample_id).encode())
                add_member(tar, f"{key}.features.npy", npy_bytes(features_of(sample_id)))
                add_member(tar, f"{key}.tokens.npy", npy_bytes(tokens_of(sample_id)))
        first += size
        files.append(path)
    return files


def add_member(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


def tar_fields() -> dict[str, str]:
    """The streams of the tar shards: the names the Parquet shards use."""
    return {"id": "cls", "features": "features.npy", "tokens": "tokens.npy"}
