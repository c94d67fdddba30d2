"""What a MinibatchSource reads from: the deserializer protocols (``docs/data.md#deserializers``).

Two protocols:

* :class:`StreamDeserializer` serves named streams, sequences included: ``streams`` (name ->
  :class:`~dtrain.data.streams.StreamInfo`), ``num_sequences``, ``sequence_lengths(name)`` for each
  sequence stream, and ``read(indices)`` -> ``{name: tensor or Sequences}``.
* :class:`Deserializer` is the older two-stream form (``get(indices) -> (features, labels)``) that
  the image, CIFAR-10 and array deserializers implement; :class:`FeaturesAndLabels` shows it as the
  streams ``features`` and ``labels``.

:func:`as_stream_deserializer` accepts either, and any map-style ``torch.utils.data.Dataset``
(wrapped in ``dtrain.data.DatasetDeserializer``).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import numpy as np
import torch

from dtrain.data._checks import check_not_a_data_loader
from dtrain.data.streams import Sequences, StreamInfo

__all__ = ["Deserializer", "FeaturesAndLabels", "StreamDeserializer", "as_stream_deserializer", "deserializer_identity",
           "label_tensor"]


class Deserializer(Protocol):
    """The two-stream deserializer: features and labels, one sample per index.

    Optionally also ``mean_image() -> torch.Tensor``: float32 per-pixel mean over the training
    split, shape ``feature_shape`` (used by ``ImageTransform(mean="dataset")``), and
    ``take(index: torch.Tensor)``: ``get`` for an int64 index tensor, which the source then calls
    with a slice of its cached sweep order (in-memory data, whose read is a few tensor calls); the
    slice is a view of that cache, to be read, never written to.
    """

    num_samples: int  # samples in one sweep
    feature_shape: tuple  # shape of one sample's features
    num_classes: int

    def get(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Raw features ``[len(indices), *feature_shape]`` and labels ``[len(indices), ...]``: int64 class
        indices, or floating-point targets (regression), whose dtype the source keeps."""
        ...


class StreamDeserializer(Protocol):
    """Named streams, some of them sequences (``docs/data.md#deserializers``).

    Optionally also ``defining_stream`` (the stream whose steps count samples when the source is
    not told), ``benefits_from_read_ahead`` (reads are slow: the source reads the next minibatch in
    the background), ``read_ahead_minibatches`` (how many reads the source keeps in flight, default
    1), ``prefetch(indices)`` (a hint, given when the source queues a read: ``read`` of the same
    indices follows, in the order of the hints, so workers of its own may start on them now) and
    ``checkpoint_identity() -> dict`` (what a checkpoint of it must match).
    """

    streams: Mapping[str, StreamInfo]
    num_sequences: int  # sequences (samples, for data without sequences) in one sweep

    def sequence_lengths(self, name: str) -> np.ndarray:
        """int64 ``[num_sequences]``: the steps of every sequence of the sequence stream ``name``, in
        data-set order, known without reading the data (the source plans minibatches with them)."""
        ...

    def read(self, indices: np.ndarray) -> Mapping[str, torch.Tensor | Sequences]:
        """The streams of the sequences ``indices`` (int64, in this order): a tensor ``[n, *shape]`` for a
        stream with one value per sequence, a :class:`Sequences` (or a list of ``[L_i, *shape]``
        tensors, which the source pads) for a sequence stream."""
        ...


def deserializer_identity(deserializer, streams: Mapping[str, StreamInfo]) -> dict:
    """What a checkpoint of data read through ``deserializer`` must match: its type and its own
    ``checkpoint_identity()`` where it declares one, else its size, feature shape and classes (a two-stream
    :class:`Deserializer`) or its sequences and ``streams`` (a :class:`StreamDeserializer`). Where the files
    lie is left out, so a checkpoint resumes on data moved elsewhere."""
    kind = f"{type(deserializer).__module__}.{type(deserializer).__qualname__}"
    own = getattr(deserializer, "checkpoint_identity", None)  # optional in both protocols
    if callable(own):
        return {"deserializer": kind, **own()}
    if hasattr(deserializer, "feature_shape"):  # the two-stream protocol
        return {"deserializer": kind, "num_samples": _plain(deserializer.num_samples),
                "feature_shape": _plain(deserializer.feature_shape), "num_classes": _plain(deserializer.num_classes)}
    return {"deserializer": kind, "num_sequences": _plain(getattr(deserializer, "num_sequences", None)),
            "streams": {name: [_plain(info.shape), str(info.dtype), bool(info.is_sequence), _plain(info.num_classes)]
                        for name, info in streams.items()}}


def _plain(value) -> int | list[int] | str:
    """An int, a list of ints, or else the value's text: comparable and safe to store in a checkpoint."""
    try:
        if isinstance(value, (tuple, list, torch.Size)):
            return [int(n) for n in value]
        return int(value)
    except (TypeError, ValueError):
        return str(value)


def label_tensor(labels: torch.Tensor) -> torch.Tensor:
    """Integer class labels as int64 (what torch's classification losses take); floating-point
    targets unchanged, so a regression target of 0.25 stays 0.25."""
    if labels.dtype is torch.int64 or labels.dtype.is_floating_point or labels.dtype.is_complex:
        return labels
    return labels.to(torch.int64)


class FeaturesAndLabels:
    """A two-stream :class:`Deserializer` seen as the streams ``features`` and ``labels``.

    Features are served as the deserializer gives them (the source converts them to float32, or its
    transform does); integer labels as int64.
    """

    def __init__(self, deserializer: Deserializer):
        self.deserializer = deserializer
        num_classes = deserializer.num_classes
        self.streams = {
            "features": StreamInfo("features", tuple(int(n) for n in deserializer.feature_shape), torch.float32),
            "labels": StreamInfo("labels", (), torch.int64 if num_classes is not None else torch.float32,
                                 num_classes=num_classes),
        }
        self.num_sequences = int(deserializer.num_samples)

    def sequence_lengths(self, name: str) -> np.ndarray:
        raise KeyError(f"{name!r} is not a sequence stream")

    def read(self, indices: np.ndarray) -> dict[str, torch.Tensor]:
        features, labels = self.deserializer.get(indices)
        return {"features": features, "labels": label_tensor(labels)}


def _is_stream_deserializer(value: object) -> bool:
    return all(hasattr(value, name) for name in ("streams", "num_sequences", "read"))


def _is_two_stream_deserializer(value: object) -> bool:
    return all(hasattr(value, name) for name in ("num_samples", "feature_shape", "num_classes", "get"))


def as_stream_deserializer(value: object) -> StreamDeserializer:
    """``value`` as a :class:`StreamDeserializer`: itself, a two-stream deserializer wrapped in
    :class:`FeaturesAndLabels`, or a map-style torch ``Dataset`` wrapped in ``DatasetDeserializer``.

    Raises:
        TypeError: an ``IterableDataset`` (no index, so no exactly-once partitions and no resume), a
            ``DataLoader`` (pass its ``dataset``), or anything else that is none of these (the message names
            what to pass instead).
    """
    if _is_stream_deserializer(value):
        return value
    if _is_two_stream_deserializer(value):
        return FeaturesAndLabels(value)
    check_not_a_data_loader(value)
    if isinstance(value, torch.utils.data.IterableDataset):
        raise TypeError(
            f"{type(value).__name__} is an IterableDataset: it can only be read from the start, so dtrain cannot give "
            f"each rank its own share exactly once per sweep, shuffle it, or resume mid-sweep; dtrain needs to read "
            f"any sample by its index: pass the shard files themselves (dtrain.data.ParquetShards for Parquet or "
            f"Arrow files, a datasets cache or save_to_disk directory; dtrain.data.TarShards for WebDataset tar "
            f"shards), or a map-style Dataset (__getitem__ and __len__)")
    if isinstance(value, (np.ndarray, torch.Tensor)):
        raise TypeError(
            f"deserializer must have streams, num_sequences and read() (or num_samples, feature_shape, num_classes "
            f"and get()), or be a map-style torch Dataset; a {type(value).__name__} is an array: wrap arrays in "
            f"dtrain.data.ArrayDeserializer(features, labels)")
    if isinstance(value, torch.utils.data.Dataset) or (hasattr(value, "__getitem__") and hasattr(value, "__len__")
                                                       and not isinstance(value, (str, bytes, Mapping))):
        from dtrain.data.dataset import DatasetDeserializer

        return DatasetDeserializer(value)
    raise TypeError(
        f"deserializer must have streams, num_sequences and read() (or num_samples, feature_shape, num_classes and "
        f"get()), or be a map-style torch Dataset; {type(value).__name__} is none of these (wrap other data in "
        f"dtrain.data.DatasetDeserializer or dtrain.data.ArrayDeserializer, see docs/data.md)")
