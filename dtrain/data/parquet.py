"""Parquet and Arrow shards bigger than memory, read through pyarrow (``docs/data.md#sharded-data``).

A data set stored as many Parquet files (what ``datasets`` exports and the Hugging Face hub serves) or
Arrow IPC files (a ``datasets`` cache or ``Dataset.save_to_disk`` directory) is indexed by its footers
alone: each file's row groups (record batches) and their rows. A row group is a **chunk**: the source
visits chunks in a random order and the rows of each randomization window in a random order
(``dtrain.data.chunk_order``), and this reader decodes a chunk's columns once and keeps the chunks of
about one window, so memory follows the window, not the data set.

Columns become streams: a number per row is a value per sample, a fixed-size list an array of that
shape, a variable-length list a sequence stream (its lengths come from a ``NAME_lengths`` column where
the shards have one, else from reading that column once when the reader is made), and any other column
(text, bytes, an image struct) a value its ``decoders`` entry turns into an array.
"""
from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import numpy as np
import torch

from dtrain.data._shards import RecentlyUsed, expand_shards, require, shard_names
from dtrain.data.errors import DataError
from dtrain.data.streams import Sequences, StreamInfo

__all__ = ["ParquetShards"]

_SUFFIXES = (".parquet", ".arrow")
_TORCH_DTYPES = {"int8": torch.int8, "int16": torch.int16, "int32": torch.int32, "int64": torch.int64,
                 "uint8": torch.uint8, "uint16": torch.int64, "uint32": torch.int64, "uint64": torch.int64,
                 "float16": torch.float16, "float32": torch.float32, "float64": torch.float32, "bool": torch.bool}


class ParquetShards:
    """Parquet (``.parquet``) or Arrow IPC (``.arrow``) shards as named streams, chunked by row group.

    Args:
        paths: the shards: files, directories (their ``.parquet``/``.arrow`` files by name; a
            ``save_to_disk`` directory's ``state.json`` order is used where present), glob patterns, a list
            of them, or a ``datasets.Dataset`` (its cache files).
        columns: the columns to serve as streams (default: every column but ``NAME_lengths`` index columns).
        num_classes: column -> the number of classes or the vocabulary of an integer column (checked on
            every read by the source).
        shapes: column -> the shape of one value (or step) of a fixed-size list column, e.g. ``[3, 32, 32]``.
        decoders: column -> a callable taking one value as Python gives it (``str``, ``bytes``, a dict for
            a struct) and returning an array: how text, encoded images and structs become numbers.
        defining_stream: the sequence stream whose steps count samples (default: the source's rule).
        randomization_window_in_chunks: the source's default window for these shards, in row groups; the
            reader keeps about this many decoded row groups.

    Raises:
        DataError: a missing, truncated or unreadable shard, a shard whose columns or types differ from
            the first one's, a column that no shard has (one line naming the file and the column).
    """

    benefits_from_read_ahead = True

    def __init__(self, paths, columns: Iterable[str] | None = None, num_classes: Mapping[str, int] | None = None,
                 shapes: Mapping[str, Iterable[int]] | None = None,
                 decoders: Mapping[str, Callable] | None = None, defining_stream: str | None = None,
                 randomization_window_in_chunks: int = 16):
        self.pa = require("pyarrow", "parquet", "ParquetShards")
        self._open_arrow = RecentlyUsed(8)
        self._open_parquet = RecentlyUsed(8)  # closed once dropped and no read holds it
        self.files = _shard_files(paths)
        self.names = shard_names(self.files)
        self._num_classes = dict(num_classes or {})
        self._shapes = {name: tuple(int(n) for n in shape) for name, shape in (shapes or {}).items()}
        self._decoders = dict(decoders or {})
        self.randomization_window_in_chunks = int(randomization_window_in_chunks)
        if defining_stream is not None:
            self.defining_stream = defining_stream
        first_schema = None
        chunk_rows: list[int] = []
        self._file_rows: list[int] = []  # rows of each shard: what a checkpoint records
        self._chunks: list[tuple[int, int]] = []  # (file, row group or record batch)
        for file_index, path in enumerate(self.files):
            schema, rows = self._index(path)
            if first_schema is None:
                first_schema = schema
                self.columns = self._chosen_columns(schema, columns, path)
            else:
                self._check_schema(schema, first_schema, path)
            chunk_rows.extend(rows)
            self._file_rows.append(sum(rows))
            self._chunks.extend((file_index, group) for group in range(len(rows)))
        self._chunk_sizes = np.asarray(chunk_rows, dtype=np.int64)
        self._chunk_starts = np.concatenate(([0], np.cumsum(self._chunk_sizes)))
        self.num_sequences = int(self._chunk_starts[-1])
        if self.num_sequences == 0:
            raise DataError(f"ParquetShards: the {len(self.files)} shards from {self.files[0]} hold no rows")
        self._schema = first_schema
        for name in list(self._shapes) + list(self._decoders) + list(self._num_classes):
            if name not in self.columns:
                raise DataError(f"ParquetShards: column {name!r} is not among the streams read "
                                f"({', '.join(self.columns)})")
        self._cache = RecentlyUsed(self.randomization_window_in_chunks + 4)  # decoded row groups of about a window
        self.streams = {name: self._stream_info(name) for name in self.columns}
        self._lengths = {name: self._read_lengths(name) for name, info in self.streams.items() if info.is_sequence}

    # -- the index -----------------------------------------------------------------------------------
    def _index(self, path: Path):
        """``(arrow schema, rows of each chunk)`` of one shard, from its footer (Parquet) or batch headers."""
        try:
            if path.suffix == ".arrow":
                batches = self._arrow_batches(path)
                return batches.schema, [batch.num_rows for batch in batches.batches]
            metadata = self._parquet(path).metadata
            return self._parquet(path).schema_arrow, [metadata.row_group(i).num_rows
                                                      for i in range(metadata.num_row_groups)]
        except (OSError, self.pa.ArrowException) as error:
            raise DataError(f"ParquetShards: shard {path} is not a readable {path.suffix[1:]} file (truncated or "
                            f"damaged: {str(error).splitlines()[0]})") from None

    def _parquet(self, path: Path):
        """The open Parquet file (its footer parsed once; the last few files are kept open)."""
        import pyarrow.parquet as pq

        return self._open_parquet.get(path, lambda: pq.ParquetFile(path))

    def _arrow_batches(self, path: Path):
        """An Arrow IPC file or stream (``datasets`` writes streams), memory-mapped: its batches cost no copy.
        The last few files' batches are kept (a stream's batches are found by walking its headers)."""
        return self._open_arrow.get(path, lambda: self._walk_arrow(path))

    def _walk_arrow(self, path: Path):
        source = self.pa.memory_map(str(path), "r")
        try:
            reader = self.pa.ipc.open_file(source)
            batches = [reader.get_batch(i) for i in range(reader.num_record_batches)]
        except self.pa.ArrowInvalid:
            source.seek(0)
            reader = self.pa.ipc.open_stream(source)
            batches = list(reader)
        return _Batches(reader.schema, batches)

    def _chosen_columns(self, schema, columns, path: Path) -> list[str]:
        if columns is None:
            names = [name for name in schema.names
                     if not (name.endswith("_lengths") and name[:-len("_lengths")] in schema.names)]
            return names
        columns = [columns] if isinstance(columns, str) else list(columns)
        for name in columns:
            if name not in schema.names:
                raise DataError(f"ParquetShards: shard {path} has no column {name!r}; it has "
                                f"{', '.join(schema.names)}")
        return columns

    def _check_schema(self, schema, first, path: Path) -> None:
        for name in self.columns:
            if name not in schema.names:
                raise DataError(f"ParquetShards: shard {path} has no column {name!r} (shard {self.files[0]} has); "
                                f"every shard needs the same columns")
            if schema.field(name).type != first.field(name).type:
                raise DataError(f"ParquetShards: column {name!r} is {schema.field(name).type} in shard {path} and "
                                f"{first.field(name).type} in shard {self.files[0]}; every shard needs one schema")

    # -- the streams ---------------------------------------------------------------------------------
    def _stream_info(self, name: str) -> StreamInfo:
        types = self.pa.types
        kind = self._schema.field(name).type
        classes = self._num_classes.get(name)
        if name in self._decoders:
            sample = np.asarray(self._decoders[name](self._first_value(name)))
            return StreamInfo(name, tuple(sample.shape), _torch_dtype(sample.dtype, name), num_classes=classes)
        if types.is_list(kind) or types.is_large_list(kind):
            step, dtype = _value_shape(kind.value_type, name, types)
            return StreamInfo(name, self._shapes.get(name, step), dtype, is_sequence=True, num_classes=classes)
        shape, dtype = _value_shape(kind, name, types)
        shape = self._shapes.get(name, shape)
        if int(np.prod(shape)) != int(np.prod(_value_shape(kind, name, types)[0])):
            raise DataError(f"ParquetShards: shapes[{name!r}]={list(shape)} does not hold the column's "
                            f"{int(np.prod(_value_shape(kind, name, types)[0]))} values")
        return StreamInfo(name, shape, dtype, num_classes=classes)

    def _first_value(self, name: str):
        return self._chunk_table(0)[name][0].as_py()

    def _read_lengths(self, name: str) -> np.ndarray:
        """Steps of every sequence of ``name``: its ``NAME_lengths`` column where the shards have one (a small
        column), else the list column's own offsets (reading that column once)."""
        import pyarrow.compute as pc

        column = f"{name}_lengths" if f"{name}_lengths" in self._schema.names else name
        lengths = np.empty(self.num_sequences, dtype=np.int64)
        for chunk in range(len(self._chunks)):
            values = self._read_chunk(chunk, [column])[column]
            if column == name:
                values = pc.list_value_length(values)
            lengths[self._chunk_starts[chunk]:self._chunk_starts[chunk + 1]] = values.to_numpy(zero_copy_only=False)
        return lengths

    def sequence_lengths(self, name: str) -> np.ndarray:
        if name not in self._lengths:
            raise KeyError(f"{name!r} is not a sequence stream")
        return self._lengths[name]

    def chunk_sizes(self) -> np.ndarray:
        """Rows of each row group (record batch), in data-set order: the source's chunks."""
        return self._chunk_sizes

    def checkpoint_identity(self) -> dict:
        """Each shard's name and rows, and the streams: a checkpoint resumes only on the same rows."""
        return {"shards": {name: int(count) for name, count in zip(self.names, self._file_rows)},
                "streams": {name: [list(info.shape), str(info.dtype), info.is_sequence]
                            for name, info in self.streams.items()}}

    # -- reading -------------------------------------------------------------------------------------
    def _read_chunk(self, chunk: int, columns: list[str]):
        file_index, group = self._chunks[chunk]
        path = self.files[file_index]
        try:
            if path.suffix == ".arrow":
                return self.pa.Table.from_batches([self._arrow_batches(path).batches[group]]).select(columns)
            return self._parquet(path).read_row_group(group, columns=columns)
        except (OSError, self.pa.ArrowException) as error:
            raise DataError(f"ParquetShards: row group {group} of shard {path} cannot be read (damaged or changed "
                            f"since the reader was made: {str(error).splitlines()[0]})") from None

    def _chunk_table(self, chunk: int):
        """The streams' columns of one chunk, decoded once and kept while the window reads them."""
        return self._cache.get(chunk, lambda: self._checked_chunk(chunk))

    def _checked_chunk(self, chunk: int):
        table = self._read_chunk(chunk, self.columns)
        if table.num_rows != self._chunk_sizes[chunk]:
            file_index, group = self._chunks[chunk]
            raise DataError(f"ParquetShards: row group {group} of shard {self.files[file_index]} holds "
                            f"{table.num_rows} rows, the index {int(self._chunk_sizes[chunk])}: the shard changed "
                            f"while it was read")
        return table

    def read(self, indices: np.ndarray) -> dict[str, torch.Tensor | Sequences]:
        indices = np.asarray(indices, dtype=np.int64)
        if not len(indices):  # an empty share
            return {name: self._stream(name, self._chunk_table(0).slice(0, 0).column(name)) for name in self.columns}
        chunks = np.searchsorted(self._chunk_starts, indices, side="right") - 1
        pieces = []
        for chunk in np.unique(chunks):
            rows = indices[chunks == chunk] - self._chunk_starts[chunk]
            pieces.append(self._chunk_table(int(chunk)).take(self.pa.array(rows)))
        table = pieces[0]
        if len(pieces) > 1:  # the pieces hold the indices by chunk (stable): put them back in the asked order
            by_chunk = np.argsort(chunks, kind="stable")
            restore = np.empty_like(by_chunk)
            restore[by_chunk] = np.arange(len(by_chunk))
            table = self.pa.concat_tables(pieces).take(self.pa.array(restore))
        return {name: self._stream(name, table.column(name)) for name in self.columns}

    def _stream(self, name: str, column):
        info = self.streams[name]
        if name in self._decoders:
            values = [np.asarray(self._decoders[name](value)) for value in column.to_pylist()]
            if info.is_sequence:
                return [torch.as_tensor(value, dtype=info.dtype) for value in values]
            return torch.as_tensor(np.stack(values) if values else np.zeros((0, *info.shape))).to(info.dtype)
        column = column.combine_chunks()
        if info.is_sequence:
            offsets = column.offsets.to_numpy()
            flat = _flat_numbers(column.flatten(), info)
            flat = flat.reshape(-1, *info.shape)
            lengths = np.diff(offsets)
            return [flat[start:start + length] for start, length in zip(offsets[:-1] - offsets[0], lengths)]
        return _flat_numbers(column, info).reshape(len(column), *info.shape)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "pa": None}  # the caches pickle empty

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.pa = require("pyarrow", "parquet", "ParquetShards")


class _Batches:
    def __init__(self, schema, batches):
        self.schema, self.batches = schema, batches


def _shard_files(paths) -> list[Path]:
    """The shard files: ``paths`` expanded, a ``save_to_disk`` directory in its ``state.json`` order, or a
    ``datasets.Dataset``'s own cache files."""
    cache_files = getattr(paths, "cache_files", None)
    if cache_files is not None and not isinstance(paths, (str, os.PathLike)):
        if getattr(paths, "_indices", None) is not None:
            raise DataError("ParquetShards: this datasets.Dataset has an indices mapping (select, shuffle, filter); "
                            "save it with .flatten_indices() or save_to_disk first, then pass its files")
        if not cache_files:
            raise DataError("ParquetShards: this datasets.Dataset is held in memory, not in files; save_to_disk it "
                            "and pass the directory")
        return [Path(entry["filename"]) for entry in cache_files]
    if isinstance(paths, (str, os.PathLike)) and (Path(paths) / "state.json").is_file():
        state = json.loads((Path(paths) / "state.json").read_text())
        files = [Path(paths) / entry["filename"] for entry in state.get("_data_files", [])]
        if files:
            return expand_shards(files, _SUFFIXES, "ParquetShards")
    return expand_shards(paths, _SUFFIXES, "ParquetShards")


def _value_shape(kind, name: str, types) -> tuple[tuple[int, ...], torch.dtype]:
    """``(shape, dtype)`` of one value of an Arrow type: a number, or nested fixed-size lists of numbers."""
    shape: list[int] = []
    while types.is_fixed_size_list(kind):
        shape.append(kind.list_size)
        kind = kind.value_type
    if not (types.is_integer(kind) or types.is_floating(kind) or types.is_boolean(kind)):
        raise DataError(f"ParquetShards: column {name!r} holds {kind}; give decoders={{{name!r}: function}} that "
                        f"turns one value into an array (numbers, fixed-size lists and lists of numbers are read "
                        f"as they are)")
    return tuple(shape), _torch_dtype(np.dtype(kind.to_pandas_dtype()), name)


def _torch_dtype(dtype: np.dtype, name: str) -> torch.dtype:
    torch_dtype = _TORCH_DTYPES.get(np.dtype(dtype).name)
    if torch_dtype is None:
        raise DataError(f"ParquetShards: column {name!r} decodes to {dtype}; expected numbers or booleans")
    return torch_dtype


def _flat_numbers(array, info: StreamInfo) -> torch.Tensor:
    """An Arrow array of numbers or of nested fixed-size lists as one flat tensor of ``info.dtype``."""
    if array.null_count:
        raise DataError(f"ParquetShards: column {info.name!r} holds {array.null_count} missing values (null) in "
                        f"this minibatch; expected a value in every row")
    while array.type.num_fields:  # (fixed-size) lists down to their numbers
        array = array.flatten()
        if array.null_count:
            raise DataError(f"ParquetShards: column {info.name!r} holds missing values (null) inside its lists")
    values = array.to_numpy(zero_copy_only=False)
    if values.dtype == np.float64:
        values = values.astype(np.float32)
    elif values.dtype.kind == "u" and values.dtype != np.uint8:
        values = values.astype(np.int64)
    values = np.ascontiguousarray(values)
    return torch.from_numpy(values if values.flags.writeable else values.copy())
