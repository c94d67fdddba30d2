"""WebDataset tar shards read by sample, through an index of where each file of each sample lies.

A WebDataset shard is a plain tar file whose consecutive members sharing a key (the path up to the first
dot of the file name) form one sample: ``000017.jpg`` and ``000017.cls`` are the fields ``jpg`` and ``cls``
of sample ``000017``. The ``webdataset`` library reads a shard from its start; dtrain needs any sample at
any position (every rank its own share, shuffled, resumable), so :class:`TarShards` reads the tar headers
(Python's ``tarfile``) into an index of each field's offset and size, reads a sample with one seek per
field, and decodes it with ``webdataset``'s own decoders (images by ``decode``, ``.cls``, ``.json``,
``.npy`` and the rest by extension), so fields decode as in a ``webdataset`` pipeline.

A shard is a **chunk** for the source's randomization (``dtrain.data.chunk_order``): a window of shards
is read at a time, and only the indexes of the shards being read are kept, so memory does not grow with
the data set. Making the reader walks every shard's headers once (no data is read) to count samples.
"""
from __future__ import annotations

import json
import os
import re
import tarfile
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import numpy as np
import torch

from dtrain.data._shards import RecentlyUsed, expand_shards, require, shard_names
from dtrain.data.dataset import DatasetDeserializer
from dtrain.data.errors import DataError

__all__ = ["TarShards"]

#: webdataset's split of a member name into the sample's key and the field's extension
_KEY_AND_EXTENSION = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")


class _ShardIndex:
    """One shard's samples: their keys and, per field, the byte offset and size of its file in the tar."""

    def __init__(self, path: Path):
        keys: list[str] = []
        fields: list[dict[str, tuple[int, int]]] = []
        try:
            with tarfile.open(path, "r:") as tar:
                for member in tar:
                    if not member.isfile():
                        continue
                    match = _KEY_AND_EXTENSION.match(member.name)
                    if match is None or Path(member.name).name.startswith(("__", ".")):
                        continue
                    key, extension = match.groups()
                    if not keys or keys[-1] != key:
                        keys.append(key)
                        fields.append({})
                    fields[-1][extension.lower()] = (member.offset_data, member.size)
                end = tar.offset  # where the end-of-archive blocks begin (tarfile stops quietly at a cut header)
            with open(path, "rb") as handle:
                handle.seek(end)
                closing = handle.read(1024)
            if len(closing) < 1024 or any(closing):
                raise tarfile.ReadError(f"no end-of-archive blocks after byte {end:,}")
        except (OSError, tarfile.TarError, EOFError) as error:
            raise DataError(f"TarShards: shard {path} is not a readable tar file (truncated or damaged: "
                            f"{error})") from None
        self.keys, self.fields = keys, fields


class _TarSamples(torch.utils.data.Dataset):
    """The samples of every shard, by global index: a dict of decoded fields (what DatasetDeserializer reads)."""

    def __init__(self, files: list[Path], counts: np.ndarray, fields: Mapping[str, tuple[str, ...]],
                 decode: str, decoders: Mapping[str, Callable], keep: int):
        self.files, self.fields, self.decode_spec, self.decoders, self.keep = files, dict(fields), decode, \
            dict(decoders), keep
        self.starts = np.concatenate(([0], np.cumsum(counts)))
        self._setup()

    def _setup(self) -> None:
        autodecode = require("webdataset", "webdataset", "TarShards").autodecode
        self._decoder = autodecode.Decoder([autodecode.imagehandler(self.decode_spec)])
        self._indexes = RecentlyUsed(self.keep)  # the tar indexes of about a window of shards
        self._handles = RecentlyUsed(self.keep)

    def __len__(self) -> int:
        return int(self.starts[-1])

    def index(self, shard: int) -> _ShardIndex:
        """Shard ``shard``'s index, kept for the last ``keep`` shards read."""
        return self._indexes.get(shard, lambda: self._checked_index(shard))

    def _checked_index(self, shard: int) -> _ShardIndex:
        index = _ShardIndex(self.files[shard])
        expected = int(self.starts[shard + 1] - self.starts[shard])
        if len(index.keys) != expected:
            raise DataError(f"TarShards: shard {self.files[shard]} holds {len(index.keys)} samples, {expected} when "
                            f"the reader was made: it changed while it was read")
        return index

    def raw(self, position: int) -> dict:
        """Sample ``position``'s fields as bytes, with ``__key__`` and ``__url__`` (webdataset's sample)."""
        shard = int(np.searchsorted(self.starts, position, side="right")) - 1
        index = self.index(shard)
        row = position - int(self.starts[shard])
        sample = {"__key__": index.keys[row], "__url__": str(self.files[shard])}
        for name, extensions in self.fields.items():
            found = next((extension for extension in extensions if extension in index.fields[row]), None)
            if found is None:
                raise self.missing_field(shard, index, row, name)
            offset, size = index.fields[row][found]
            data = self._read_at(shard, offset, size)
            if len(data) != size:
                raise DataError(f"TarShards: shard {self.files[shard]} ends inside sample {index.keys[row]!r} "
                                f"(truncated)")
            sample[found] = data
        return sample

    def _read_at(self, shard: int, offset: int, size: int) -> bytes:
        """``size`` bytes of shard ``shard`` from ``offset``, by a positional read (worker processes forked from the
        reader share its open files, and so their offsets). The file is kept open while its shard is read, and
        closed once dropped and no read holds it (never under a reader's feet)."""
        handle = self._handles.get(shard, lambda: open(self.files[shard], "rb"))  # noqa: SIM115
        return os.pread(handle.fileno(), size, offset)

    def missing_field(self, shard: int, index: _ShardIndex, row: int, name: str) -> DataError:
        return DataError(f"TarShards: sample {index.keys[row]!r} of shard {self.files[shard]} has no "
                         f"{' or '.join(self.fields[name])} file for stream {name!r} (it has "
                         f"{', '.join(sorted(index.fields[row]))})")

    def __getitem__(self, position: int) -> dict:
        sample = self.raw(position)
        out = {}
        for name, extensions in self.fields.items():
            field = next(extension for extension in extensions if extension in sample)
            value = sample[field]
            try:
                value = self.decoders[name](value) if name in self.decoders else \
                    self._decoder.decode({"__key__": sample["__key__"], field: value})[field]
            except Exception as error:  # noqa: BLE001 - a decoder's own error, named with the sample
                cause = error.__cause__ or error  # webdataset wraps the codec's error in a DecodingError
                text = str(cause).splitlines()[0] if str(cause) else ""
                raise DataError(f"TarShards: {field} of sample {sample['__key__']!r} in {sample['__url__']} does not "
                                f"decode: {type(cause).__name__}: {text}") from None
            if isinstance(value, (str, bytes, dict, list)):
                raise DataError(f"TarShards: stream {name!r} ({field}) decodes to {type(value).__name__}; give "
                                f"decoders={{{name!r}: function}} that returns numbers or an array")
            out[name] = value
        return out

    def npy_length(self, position: int, name: str) -> int:
        """The first dimension of sample ``position``'s ``.npy`` field of stream ``name``, from its header alone."""
        import io

        shard = int(np.searchsorted(self.starts, position, side="right")) - 1
        index = self.index(shard)
        row = position - int(self.starts[shard])
        field = next((extension for extension in self.fields[name] if extension in index.fields[row]), None)
        if field is None:
            raise self.missing_field(shard, index, row, name)
        offset, size = index.fields[row][field]
        header = io.BytesIO(self._read_at(shard, offset, min(size, 4096)))
        try:
            major, _ = np.lib.format.read_magic(header)
            read = np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
            shape = read(header)[0]
        except ValueError as error:
            raise DataError(f"TarShards: {field} of sample {index.keys[row]!r} in {self.files[shard]} is not a .npy "
                            f"array ({error})") from None
        return int(shape[0]) if shape else 1

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.pop("_decoder")  # made again by _setup; the caches pickle empty
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._setup()


def _shard_list(paths) -> list[tuple[Path, int]] | None:
    """``(shard, samples)`` from a JSON shard list (``paths`` one ``.json`` file), else None."""
    if not isinstance(paths, (str, os.PathLike)) or not str(paths).endswith(".json"):
        return None
    path = Path(paths).expanduser()
    try:
        listed = json.loads(path.read_text())["shardlist"]
        shards = [(path.parent / entry["url"], int(entry["nsamples"])) for entry in listed]
    except OSError as error:
        raise DataError(f"TarShards: shard list {path} cannot be read ({error.strerror})") from None
    except (ValueError, KeyError, TypeError) as error:
        raise DataError(f"TarShards: shard list {path} is not a JSON shard list ({{\"shardlist\": [{{\"url\": ..., "
                        f"\"nsamples\": ...}}]}}: {error})") from None
    if not shards:
        raise DataError(f"TarShards: shard list {path} names no shard")
    missing = next((shard for shard, _ in shards if not shard.is_file()), None)
    if missing is not None:
        raise DataError(f"TarShards: shard {missing} of shard list {path} does not exist")
    return shards


class TarShards(DatasetDeserializer):
    """WebDataset tar shards as named streams (``docs/data.md#sharded-data``), chunked by shard.

    Args:
        paths: the ``.tar`` shards: files, directories (their ``.tar`` files by name), glob patterns, or a
            list of them; or a JSON shard list (``save_shard_list``, webdataset's ``wids`` format), which saves
            counting every shard's samples at start-up (a shard is checked against it when it is first read).
        fields: stream -> the extensions that hold it, webdataset's way (``{"image": "jpg;png", "label": "cls"}``);
            default: every extension of the first sample, each its own stream.
        decode: webdataset's image spec for image fields (``torchrgb``: float CHW in [0, 1]; ``rgb8``: uint8 HWC, ...).
        decoders: stream -> a function of the field's bytes returning an array (text, a format of one's own).
        sequences: streams of variable length (first dimension: steps); their lengths come from ``.npy``
            headers, else from decoding every sample once when the reader is made.
        num_classes, num_workers, worker_type, defining_stream: as :class:`DatasetDeserializer`'s (workers
            decode in parallel, in order).
        randomization_window_in_chunks: the source's default window, in shards (the reader keeps the indexes
            and open files of about that many shards).

    Raises:
        DataError: a missing, truncated or unreadable shard, a shard without samples, a sample without a
            field a stream needs (naming the shard, the sample and the stream).
    """

    def __init__(self, paths, fields: Mapping[str, str | Iterable[str]] | None = None, decode: str = "torchrgb",
                 decoders: Mapping[str, Callable] | None = None, sequences: Iterable[str] | str = (),
                 num_classes: Mapping[str, int] | None = None, num_workers: int = 0, worker_type: str = "process",
                 defining_stream: str | None = None, randomization_window_in_chunks: int = 32):
        require("webdataset", "webdataset", "TarShards")
        listed = _shard_list(paths)
        files = [path for path, _ in listed] if listed else expand_shards(paths, (".tar",), "TarShards")
        self.files, self.names = files, shard_names(files)
        self.randomization_window_in_chunks = int(randomization_window_in_chunks)
        first = _ShardIndex(files[0])
        counts = [count for _, count in listed] if listed else [len(_ShardIndex(path).keys) for path in files]
        empty = next((path for path, count in zip(files, counts) if count < 1), None)
        if empty is not None:
            raise DataError(f"TarShards: shard {empty} holds no samples (no member named KEY.EXTENSION)")
        if listed and len(first.keys) != counts[0]:
            raise DataError(f"TarShards: shard {files[0]} holds {len(first.keys)} samples, its shard list "
                            f"{paths} says {counts[0]}; write the list again (TarShards.save_shard_list)")
        if fields is None:
            fields = {extension.replace(".", "_"): (extension,) for extension in first.fields[0]}
        else:
            fields = {name: tuple(extensions.split(";")) if isinstance(extensions, str) else tuple(extensions)
                      for name, extensions in fields.items()}
        self._counts = np.asarray(counts, dtype=np.int64)
        samples = _TarSamples(files, self._counts, fields, decode, decoders or {},
                              keep=self.randomization_window_in_chunks + 4)
        sequence_names = [sequences] if isinstance(sequences, str) else list(sequences)
        lengths = {name: self._npy_lengths(samples, name) for name in sequence_names
                   if all(extension.split(".")[-1] == "npy" for extension in fields.get(name, ()))}
        super().__init__(samples, sequences=sequence_names, lengths=lengths, num_classes=num_classes,
                         num_workers=num_workers, worker_type=worker_type, defining_stream=defining_stream)

    @staticmethod
    def _npy_lengths(samples: _TarSamples, name: str) -> np.ndarray:
        return np.fromiter((samples.npy_length(position, name) for position in range(len(samples))),
                           dtype=np.int64, count=len(samples))

    def chunk_sizes(self) -> np.ndarray:
        """Samples of each shard, in data-set order: the source's chunks."""
        return self._counts

    def save_shard_list(self, path) -> None:
        """Writes the shards and their samples as a JSON shard list (webdataset's ``wids`` format: ``shardlist``
        of ``url`` and ``nsamples``, urls relative to the list's directory), which ``TarShards(path)`` reads
        instead of counting every shard's samples at start-up."""
        path = Path(path)
        base = path.resolve().parent
        shards = [{"url": os.path.relpath(file.resolve(), base), "nsamples": int(count)}
                  for file, count in zip(self.files, self._counts)]
        path.write_text(json.dumps({"__kind__": "wids-shard-index-v1", "wids_version": 1, "shardlist": shards},
                                   indent=1))

    def checkpoint_identity(self) -> dict:
        """Each shard's name and samples, and the streams: a checkpoint resumes only on the same samples."""
        return {"shards": {name: int(count) for name, count in zip(self.names, self._counts)},
                "streams": {name: [list(info.shape), str(info.dtype), info.is_sequence]
                            for name, info in self.streams.items()}}
