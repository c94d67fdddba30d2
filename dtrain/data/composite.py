"""Several deserializers joined by sequence key into one: CNTK's composite reader (``docs/data.md#composite-sources``).

The first deserializer, the *primary*, defines the sequences and their order; every other one is read
at the sequence whose key equals the primary's. Keys come from each deserializer's ``sequence_keys()``
(a CTF file's sequence ids, a map file's ``seqId`` column or image index) or from ``keys=``; without
keys the deserializers are joined by index. The join is computed once, at construction, into one
int64 index array per deserializer, so a read costs one gather per deserializer.
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence as SequenceType

import numpy as np
import torch

from dtrain.data.deserializer import FeaturesAndLabels, as_stream_deserializer, deserializer_identity
from dtrain.data.errors import DataError
from dtrain.data.streams import Sequences, StreamInfo

__all__ = ["CompositeDeserializer"]

#: a string key of at most this many digits is read as a number (CNTK's numeric sequence keys: "7" is 7)
_NUMERIC_DIGITS = 18


def _normalised_keys(keys, what: str) -> np.ndarray:
    """``keys`` as a 1-d array: int64 when every key is an integer or a string of digits, else str."""
    if isinstance(keys, torch.Tensor):
        keys = keys.numpy()
    elif not isinstance(keys, np.ndarray):
        keys = list(keys)
    array = np.asarray(keys)
    if array.ndim != 1:
        raise TypeError(f"{what} must be a flat list of str or int keys, one per sequence; got shape {array.shape}")
    if array.dtype.kind in "iu":
        return array.astype(np.int64, copy=False)
    if array.dtype.kind not in "UO" and len(array):
        raise TypeError(f"{what} must be str or int keys, got {array.dtype} values such as {array[0]!r}")
    if array.dtype.kind == "O":
        bad = next((key for key in array.tolist() if isinstance(key, bool) or not isinstance(key, (str, int))), None)
        if bad is not None:
            raise TypeError(f"{what} must be str or int keys, got {type(bad).__name__} {bad!r}")
    strings = array.astype(str)
    if len(strings) and bool(np.char.isdigit(strings).all()) and int(np.char.str_len(strings).max()) <= _NUMERIC_DIGITS:
        return strings.astype(np.int64)
    return strings


def _plain_key(key) -> str | int:
    return int(key) if isinstance(key, np.integer) else str(key)


class _Part:
    """One deserializer of a composite: what it serves, under which names, and where its sequences lie."""

    def __init__(self, number: int, given, names) -> None:
        self.number = number
        self.given = given
        self.data = as_stream_deserializer(given)
        self.original = getattr(self.data, "deserializer", given) if isinstance(self.data, FeaturesAndLabels) \
            else self.data
        path = getattr(self.original, "path", None) or getattr(getattr(self.original, "map", None), "path", None)
        where = f" {os.fspath(path)}" if isinstance(path, (str, os.PathLike)) else ""
        self.label = f"deserializer {number} ({type(self.original).__name__}{where})"
        self.num_sequences = int(self.data.num_sequences)
        own = dict(self.data.streams)
        if names is None:
            served = {name: name for name in own}
        elif isinstance(names, Mapping):
            served = {str(name): str(new) for name, new in names.items()}
        elif isinstance(names, SequenceType) and not isinstance(names, (str, bytes)):
            served = {str(name): str(name) for name in names}
        else:
            raise TypeError(f"names[{number}] must be a mapping own name -> served name, a list of stream names or "
                            f"None, got {type(names).__name__} {names!r}")
        unknown = [name for name in served if name not in own]
        if unknown:
            raise ValueError(f"names[{number}] names stream {unknown[0]!r}, which {self.label} does not have; its "
                             f"streams are {', '.join(own)}")
        if not served:
            raise ValueError(f"names[{number}] serves no stream of {self.label}; name at least one of {', '.join(own)}")
        self.served = served  # own name -> served name
        self.streams = {new: dataclasses.replace(own[name], name=new) for name, new in served.items()}
        # two-stream features are served as float32, as the source serves them
        self.float_features = isinstance(self.data, FeaturesAndLabels) and "features" in served
        self.index: np.ndarray | None = None  # composite sequence -> this part's sequence (None: the same)

    def keys(self, given) -> np.ndarray | None:
        """This part's keys in its own order: ``given``, else its ``sequence_keys()``; None without either."""
        if given is None:
            own = getattr(self.original, "sequence_keys", None) or getattr(self.data, "sequence_keys", None)
            if own is None:
                return None
            given = own()
        keys = _normalised_keys(given, f"the keys of {self.label}")
        if len(keys) != self.num_sequences:
            raise ValueError(f"{self.label} has {self.num_sequences} sequences but {len(keys)} keys; expected one key "
                             f"per sequence")
        return keys


class CompositeDeserializer:
    """Deserializers joined by sequence key into one stream deserializer, as CNTK's composite reader joins them.

    The first deserializer (the *primary*) defines the sequences and their order; each other one is
    read at the sequence with the same key (it may hold more sequences, which are not read). The
    streams are the union of the deserializers' streams, each name served by one deserializer.

    Keys (``keys="auto"``, the default): every deserializer that has ``sequence_keys()`` gives its
    own, as CNTK keys them: a CTF file's sequence ids (a line without an id: the sequence's 0-based
    index in the file) and a map file's ``seqId`` column (a line without one: the image's 0-based
    index). A string of digits is the number it spells, so the CTF id ``7`` and the map file's line
    key 7 are one key. When any deserializer has no keys, the deserializers are joined by index
    (sequence ``i`` of each), which needs equal sizes.

    Args:
        deserializers: a non-empty list of deserializers: stream deserializers, two-stream ones
            (served as ``features`` and ``labels``) or map-style torch Datasets
            (``dtrain.data.deserializer.as_stream_deserializer``); in a config, a list of ``_target_``
            blocks.
        keys: ``"auto"`` (above), ``"key"`` (join by key; every deserializer must have keys),
            ``"index"`` (join by index), or a list with one entry per deserializer: its keys in its
            own order (str or int), or None for its own ``sequence_keys()``.
        names: None (every stream under its own name) or a list with one entry per deserializer:
            a mapping own name -> served name (streams left out are not served: ``{"features":
            "image"}`` serves a map file's images as ``image`` and drops its labels), a list of the
            stream names to serve, or None (all, as named).
        defining_stream: the stream whose steps count samples when the source is not told; default
            the first ``defining_stream`` a deserializer declares.

    Raises:
        ValueError: an empty list, a stream name served by two deserializers, a ``names`` entry naming a
            stream that does not exist, different sizes and no keys, a key count other than the
            sequence count, a ``defining_stream`` that is not served.
        DataError: a key twice in one deserializer, or a key of the primary missing from another
            deserializer (one line naming the key and the deserializer; CNTK's reader drops such a
            sequence instead, silently unless traced).
        TypeError: a value of the wrong type (keys that are not str or int).
    """

    def __init__(self, deserializers: SequenceType, keys: str | SequenceType = "auto",
                 names: SequenceType | None = None, defining_stream: str | None = None) -> None:
        if isinstance(deserializers, (str, bytes, Mapping)) or not isinstance(deserializers, SequenceType) \
                or not deserializers:
            raise ValueError(f"deserializers must be a non-empty list of deserializers (the first one defines the "
                             f"sequences), got {deserializers!r}")
        deserializers = list(deserializers)
        if names is not None:
            names = list(names)
            if len(names) != len(deserializers):
                raise ValueError(f"names has {len(names)} entries for {len(deserializers)} deserializers; expected one "
                                 f"per deserializer (None: all its streams)")
        self._parts = [_Part(number, given, None if names is None else names[number])
                       for number, given in enumerate(deserializers)]
        self.streams: dict[str, StreamInfo] = {}
        self._owner: dict[str, _Part] = {}
        for part in self._parts:
            for name, info in part.streams.items():
                if name in self._owner:
                    raise ValueError(f"stream {name!r} is served by {self._owner[name].label} and {part.label}; expected "
                                     f"each stream name once: rename one with names=[..., {{{name!r}: 'other'}}] or "
                                     f"leave it out")
                self._owner[name] = part
                self.streams[name] = info
        self.num_sequences = self._parts[0].num_sequences
        self.join = self._join(keys)
        self.defining_stream = self._defining_stream(defining_stream)
        self.benefits_from_read_ahead = any(
            bool(getattr(part.original, "benefits_from_read_ahead", False)
                 or getattr(part.data, "benefits_from_read_ahead", False)) for part in self._parts)
        self.read_ahead_minibatches = max(max(1, int(getattr(part.data, "read_ahead_minibatches", 1)))
                                          for part in self._parts)
        self._prefetching = [part for part in self._parts if callable(getattr(part.data, "prefetch", None))]
        if self._prefetching:
            self.prefetch = self._prefetch
        if all(getattr(part.original, "values_finite", None) is True for part in self._parts):
            self.values_finite = True  # every part was checked once: the source need not check each read

    # -- the join ----------------------------------------------------------------------------------
    def _join(self, keys) -> str:
        """Sets each part's index array; returns ``"key"`` or ``"index"``."""
        if isinstance(keys, str):
            if keys not in ("auto", "key", "index"):
                raise ValueError(f"keys must be 'auto', 'key', 'index' or a list of keys per deserializer, got {keys!r}")
            mode, given = keys, [None] * len(self._parts)
        else:
            given = list(keys)
            if len(given) != len(self._parts):
                raise ValueError(f"keys has {len(given)} entries for {len(self._parts)} deserializers; expected one per "
                                 f"deserializer (None: its own sequence_keys())")
            mode = "key"
        found = [] if mode == "index" else [part.keys(entry) for part, entry in zip(self._parts, given)]
        if mode == "key" and any(k is None for k in found):
            part = self._parts[[k is None for k in found].index(True)]
            raise ValueError(f"keys={keys!r} joins by key, and {part.label} has no sequence_keys(); give its keys in "
                             f"keys=[...] or join by index (keys='index')")
        if mode == "index" or any(k is None for k in found):
            if len(self._parts) > 1 and len({part.num_sequences for part in self._parts}) > 1:
                sizes = ", ".join(f"{part.label} {part.num_sequences}" for part in self._parts)
                without = [part.label for part, k in zip(self._parts, found) if k is None]
                reason = f"{without[0]} has no sequence_keys()" if without else "keys='index'"
                raise ValueError(f"deserializers of different sizes ({sizes} sequences) cannot be joined by index, and "
                                 f"{reason}; give keys=[...] per deserializer or deserializers of equal size")
            return "index"
        primary = found[0]
        self._check_unique(self._parts[0], primary)
        for part, secondary in zip(self._parts[1:], found[1:]):
            part.index = self._index_of(part, primary, secondary)
        return "key"

    @staticmethod
    def _check_unique(part: _Part, keys: np.ndarray) -> np.ndarray:
        """The order that sorts ``keys``; DataError naming a key that is there twice."""
        order = np.argsort(keys, kind="stable")
        ordered = keys[order]
        repeated = np.flatnonzero(ordered[1:] == ordered[:-1])
        if len(repeated):
            first, second = sorted((int(order[repeated[0]]), int(order[repeated[0] + 1])))
            raise DataError(f"{part.label} has key {_plain_key(ordered[repeated[0]])!r} twice (sequences {first} and "
                            f"{second}); expected each key once")
        return order

    def _index_of(self, part: _Part, primary: np.ndarray, keys: np.ndarray) -> np.ndarray:
        """int64: for each primary key, the sequence of ``part`` with that key."""
        if primary.dtype.kind != keys.dtype.kind:  # numbers against names: compare as text
            primary, keys = primary.astype(str), keys.astype(str)
        order = self._check_unique(part, keys)
        ordered = keys[order]
        at = np.searchsorted(ordered, primary)
        found = at < len(ordered)
        found[found] = ordered[at[found]] == primary[found]
        if not found.all():
            missing = int(np.argmin(found))
            count = int(len(found) - found.sum())
            raise DataError(f"key {_plain_key(primary[missing])!r} (sequence {missing} of {self._parts[0].label}, the "
                            f"primary) is not in {part.label}"
                            f"{f' ({count:,} keys missing in all)' if count > 1 else ''}; expected every key of the "
                            f"primary in every other deserializer")
        return order[at].astype(np.int64, copy=False)

    def _defining_stream(self, defining_stream: str | None) -> str | None:
        if defining_stream is not None:
            if defining_stream not in self.streams:
                raise ValueError(f"defining_stream={defining_stream!r} is not a stream of the composite; its streams are "
                                 f"{', '.join(self.streams)}")
            return defining_stream
        for part in self._parts:
            own = getattr(part.data, "defining_stream", None)
            if own is not None and own in part.served:
                return part.served[own]
        return None

    # -- the stream protocol --------------------------------------------------------------------------
    @property
    def deserializers(self) -> list:
        """The deserializers, as given (the primary first)."""
        return [part.given for part in self._parts]

    def sequence_keys(self) -> np.ndarray:
        """The primary's keys (normalised: int64 where every key is a number), or its indices when joined by index."""
        keys = self._parts[0].keys(None) if self.join == "key" else None
        return np.arange(self.num_sequences, dtype=np.int64) if keys is None else keys

    def _indices(self, part: _Part, indices: np.ndarray) -> np.ndarray:
        return indices if part.index is None else part.index[indices]

    def sequence_lengths(self, name: str) -> np.ndarray:
        """int64 ``[num_sequences]``: the steps of every sequence of the sequence stream ``name``, in the primary's order."""
        part = self._owner.get(name)
        if part is None or not self.streams[name].is_sequence:
            raise KeyError(f"{name!r} is not a sequence stream of the composite")
        own = next(own for own, served in part.served.items() if served == name)
        lengths = np.asarray(part.data.sequence_lengths(own))
        return lengths if part.index is None else lengths[part.index]

    def read(self, indices: np.ndarray) -> dict[str, torch.Tensor | Sequences]:
        """The streams of the sequences ``indices`` (in the primary's order): each deserializer read once, at its own
        sequences of the same keys."""
        indices = np.asarray(indices, dtype=np.int64)
        streams: dict[str, torch.Tensor | Sequences] = {}
        for part in self._parts:
            read = part.data.read(self._indices(part, indices))
            for own, served in part.served.items():
                if own not in read:
                    raise DataError(f"{part.label}.read returned {sorted(read)}; expected its declared stream {own!r}")
                value = read[own]
                if part.float_features and own == "features" and isinstance(value, torch.Tensor) \
                        and value.dtype is not torch.float32:
                    value = value.to(torch.float32)
                streams[served] = value
        return streams

    def _prefetch(self, indices: np.ndarray) -> None:
        """Passes the read-ahead hint on to each deserializer that takes one, at its own sequences."""
        indices = np.asarray(indices, dtype=np.int64)
        for part in self._prefetching:
            part.data.prefetch(self._indices(part, indices))

    def checkpoint_identity(self) -> dict:
        """What a checkpoint of it must match: each deserializer's identity, the served names and how they are joined."""
        return {"join": self.join,
                "parts": [deserializer_identity(part.original, part.data.streams) for part in self._parts],
                "names": [dict(part.served) for part in self._parts]}
