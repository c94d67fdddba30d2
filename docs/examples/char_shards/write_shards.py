"""Write the character language model's corpus as shards: Parquet, WebDataset tar, or both.

    python docs/examples/char_shards/write_shards.py /tmp/char_shards
    python -m dtrain +recipe=shakespeare_char source=char_parquet source.data_dir=/tmp/char_shards/parquet
    python -m dtrain +recipe=shakespeare_char source=char_tar source.data_dir=/tmp/char_shards/tar

Each sample is one window of ``context_length + 1`` token ids of ``dtrain.data.CharCorpus`` (the shipped
Shakespeare text, or ``--text FILE``), the windows the recipe's own source reads: a column ``text``
(a list of int64) in Parquet shards of ``--row-group`` rows per row group, a ``KEY.text.npy`` file per
sample in tar shards. ``train/`` holds the training split in ``--shards`` shards, ``validation/`` the
held-out tail in one.
"""
from __future__ import annotations

import argparse
import io
import tarfile
from pathlib import Path

import numpy as np

from dtrain.data import CharCorpus


def windows(split: str, context_length: int, text: str | None) -> np.ndarray:
    """``[n, context_length + 1]`` int64: every window of the split, in order."""
    corpus = CharCorpus(split=split, context_length=context_length, path=text)
    return corpus.read(np.arange(corpus.num_sequences))["text"].data.numpy()


def write_parquet(rows: np.ndarray, directory: Path, shards: int, row_group: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    directory.mkdir(parents=True, exist_ok=True)
    for shard, part in enumerate(np.array_split(rows, shards)):
        column = pa.ListArray.from_arrays(pa.array(np.arange(0, part.size + 1, part.shape[1], dtype=np.int32)),
                                          pa.array(part.ravel()))
        pq.write_table(pa.table({"text": column}), directory / f"part-{shard:05d}.parquet", row_group_size=row_group)


def write_tar(rows: np.ndarray, directory: Path, shards: int) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    first = 0
    for shard, part in enumerate(np.array_split(rows, shards)):
        with tarfile.open(directory / f"shard-{shard:05d}.tar", "w") as tar:
            for offset, window in enumerate(part):
                buffer = io.BytesIO()
                np.save(buffer, window)
                info = tarfile.TarInfo(f"{first + offset:08d}.text.npy")
                info.size = buffer.tell()
                buffer.seek(0)
                tar.addfile(info, buffer)
        first += len(part)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="directory to write parquet/ and tar/ into")
    parser.add_argument("--format", choices=["parquet", "tar", "both"], default="both")
    parser.add_argument("--shards", type=int, default=8, help="training shards (default 8)")
    parser.add_argument("--row-group", type=int, default=256, help="rows per Parquet row group (default 256)")
    parser.add_argument("--context-length", type=int, default=128, help="the model's context (default 128)")
    parser.add_argument("--text", default=None, help="a UTF-8 text file instead of the shipped corpus")
    arguments = parser.parse_args()
    for split, shards in (("train", arguments.shards), ("validation", 1)):
        rows = windows(split, arguments.context_length, arguments.text)
        if arguments.format in ("parquet", "both"):
            write_parquet(rows, arguments.out / "parquet" / split, shards, arguments.row_group)
        if arguments.format in ("tar", "both"):
            write_tar(rows, arguments.out / "tar" / split, shards)
        print(f"{split}: {len(rows):,} windows of {rows.shape[1]} tokens in {shards} shard(s) under {arguments.out}")


if __name__ == "__main__":
    main()
