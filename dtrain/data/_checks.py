"""Argument checks shared by the data modules, and the check of the values a minibatch holds: one-line
messages naming the value and the fix."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping

import numpy as np
import torch

from dtrain.data.errors import DataError
from dtrain.data.streams import Sequences

__all__ = ["check_bool", "check_finite", "check_id_dtype", "check_int", "check_not_a_data_loader", "check_partition",
           "finite_once", "floating_streams", "not_finite",
           "on_accelerator"]


def check_int(name: str, value: object, minimum: int | None = None) -> int:
    """Return ``value`` as a Python int, or raise if it is not an integer >= ``minimum``.

    Raises:
        TypeError: ``value`` is not an integer (bools are refused: ``True`` is not a size).
        ValueError: ``value`` is below ``minimum``.
    """
    if type(value) is not int:  # a plain int skips the slower abstract-class check (it runs per minibatch)
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
        value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def check_partition(count_name: str, count: object, index_name: str, index: object) -> tuple[int, int]:
    """Return ``(count, index)`` as Python ints for partition ``index`` of ``count``, or raise if they
    are not integers with ``count >= 1`` and ``0 <= index < count``."""
    count = check_int(count_name, count, 1)
    index = check_int(index_name, index, 0)
    if index >= count:
        raise ValueError(f"{index_name} must be < {count_name} ({count}), got {index}")
    return count, index


def check_bool(name: str, value: object) -> bool:
    """Return ``value`` if it is a bool (numpy bools included), else raise ``TypeError``."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {value!r} ({type(value).__name__})")
    return bool(value)


def check_id_dtype(name: str, dtype: torch.dtype, num_classes: int, holder: str = "") -> None:
    """Raises DataError when the stream ``name``, which declares ``num_classes``, holds anything but integer
    ids (a class, a token): refused before it reaches a range check or an embedding. ``holder`` names what
    holds the values in the message (a deserializer, a sample), if not the stream itself."""
    if dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
        holds = f"{holder} holds" if holder else "holds"
        raise DataError(f"stream {name!r} has num_classes={num_classes} but {holds} "
                        f"{str(dtype).replace('torch.', '')} values; expected integer class or token ids")


#: in-memory data up to this size is checked for NaN and infinities once, when its deserializer is made (one pass
#: over memory); larger data (and memory-mapped files, sparse tensors) is checked minibatch by minibatch as read
CHECK_ONCE_BYTES = 1 << 30


def finite_once(*tensors: torch.Tensor) -> bool | None:
    """Whether every floating value of the in-memory ``tensors`` (a deserializer's whole data) is finite, checked
    once so that the source need not check each minibatch it reads (``values_finite``); None, left to that
    per-minibatch check, for sparse tensors or more than ``CHECK_ONCE_BYTES`` of data.

    One sum each (NaN and infinities survive it), and only when a sum is not finite (or finite values
    overflowed it) an exact pass. float64 beyond float32's range counts as not finite: it is served as
    float32, where it would be infinite, so the per-minibatch check names its sample."""
    if any(tensor.layout != torch.strided for tensor in tensors) or \
            sum(tensor.nbytes for tensor in tensors) > CHECK_ONCE_BYTES:
        return None
    for tensor in tensors:
        if not tensor.is_floating_point() or tensor.numel() == 0:
            continue
        if not math.isfinite(float(tensor.sum(dtype=torch.float64))) and not bool(torch.isfinite(tensor).all()):
            return False
        if tensor.dtype == torch.float64 and float(tensor.abs().max()) > torch.finfo(torch.float32).max:
            return False
    return True


#: float types whose sum over a minibatch may overflow their own range: summed in float32
_NARROW_FLOATS = (torch.float16, torch.bfloat16)


def check_finite(streams: Mapping[str, object], describe: Callable[[int], str]) -> None:
    """Raises DataError when a floating stream of a minibatch (on the CPU) holds NaN or an infinity.

    One sum per stream (NaN and infinities survive it; about 20 µs for the digits' 32 x 64 values, 0.1% of
    their training step), and only when it is not finite a pass that finds the first such sample:
    ``describe(row)`` names that row of the minibatch in the message. Streams on an accelerator are not
    read here (that would wait for the device every minibatch): the source queues their check
    (:mod:`dtrain.data.device_checks`). A sparse stream (CTF's ``layout: sparse``) is
    checked in its stored values.
    """
    for name, data in floating_streams(streams):
        if on_accelerator(data):
            continue
        sparse = data.layout != torch.strided
        if sparse:
            data = (data if data.layout == torch.sparse_coo else data.to_sparse_coo()).coalesce()
        values = data.values() if sparse else data
        total = values.sum(dtype=torch.float32) if values.dtype in _NARROW_FLOATS else values.sum()
        if math.isfinite(float(total)):
            continue
        bad = ~torch.isfinite(values.reshape(values.shape[0], -1)).all(dim=1)
        if not bool(bad.any()):
            continue  # finite values whose sum overflowed
        if sparse:  # the first sample of the minibatch with a bad stored value (coalesced: in row order)
            entry = int(bad.nonzero()[0, 0])
            row = int(data.indices()[0, entry])
            in_row = values[data.indices()[0] == row]
        else:
            row = int(bad.nonzero()[0, 0])
            in_row = values[row]
        raise DataError(not_finite(name, describe(row), has_nan=bool(torch.isnan(in_row).any())))


def floating_streams(streams: Mapping[str, object]) -> list[tuple[str, torch.Tensor]]:
    """``(name, values)`` of the minibatch's non-empty floating streams (a sequence stream's padded data)."""
    found = []
    for name, value in streams.items():
        data = value.data if isinstance(value, Sequences) else value
        if isinstance(data, torch.Tensor) and data.is_floating_point() and data.numel() > 0:
            found.append((name, data))
    return found


def on_accelerator(data: torch.Tensor) -> bool:
    """Whether ``data`` lives on an accelerator, where reading its values back would wait for the device."""
    return data.device.type != "cpu"


def not_finite(name: str, sample: str, has_nan: bool) -> str:
    """The one line for stream ``name``'s ``sample`` holding NaN (``has_nan``) or an infinity."""
    what = "NaN" if has_nan else "an infinite value"
    return (f"stream {name!r}: {sample} holds {what}; expected finite numbers (the data holds NaN or inf, which "
            f"training would report as a divergence: fix or drop that sample)")


def check_not_a_data_loader(value: object) -> None:
    """Raises TypeError for a torch ``DataLoader`` (or an iterator over one), naming what to pass instead: its
    ``dataset``. dtrain makes the minibatches itself, so a loader's batches cannot be its samples."""
    loader_iterator = getattr(torch.utils.data.dataloader, "_BaseDataLoaderIter", ())
    if not isinstance(value, (torch.utils.data.DataLoader, loader_iterator)):
        return
    name = type(value).__name__
    if isinstance(value, torch.utils.data.DataLoader):
        given = "a DataLoader" if name == "DataLoader" else f"{name} (a DataLoader)"
    else:
        given = f"{name} (an iterator over a DataLoader)"
    is_loader = isinstance(value, torch.utils.data.DataLoader)
    prefix = "" if is_loader else "_"  # an iterator over a loader keeps the loader's settings as private copies
    dataset = getattr(value, f"{prefix}dataset", None)
    workers = getattr(value, f"{prefix}num_workers", 0)
    collate = getattr(value, f"{prefix}collate_fn", None)
    arguments = ["loader.dataset"] + ([f"num_workers={workers}"] if workers else [])
    if collate is not None and getattr(collate, "__name__", "") != "default_collate":
        arguments.append(f"collate_fn={getattr(collate, '__qualname__', type(collate).__name__)}")
    instead = f"dtrain.data.DatasetDeserializer({', '.join(arguments)})"
    if isinstance(dataset, torch.utils.data.IterableDataset):
        instead = (f"the shard files its {type(dataset).__name__} reads (dtrain.data.ParquetShards, "
                   f"dtrain.data.TarShards) or a map-style Dataset (its IterableDataset has no index to read by)")
    raise TypeError(f"{given} cannot be read as data: dtrain makes the minibatches itself (each rank its share of "
                    f"every global minibatch, exactly once per sweep; the loader's sampler, batch_size and shuffle "
                    f"would not apply); pass {instead} instead")
