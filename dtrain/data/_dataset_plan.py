"""How a map-style dataset's samples become dtrain's streams (for :class:`~dtrain.data.dataset.DatasetDeserializer`).

:class:`Plan` holds what reading a chunk of samples needs (the layouts of a sample and of a collated
batch, the streams described by sample 0, ``collate_fn``) and reads chunks: in the calling thread, in a
worker thread, or in a worker process that holds its own copy. :class:`Merger` puts the chunks of one
read back together in index order. Every error is one line naming the stream and the index.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np
import torch

from dtrain.data._checks import check_id_dtype, check_int
from dtrain.data.errors import DataError
from dtrain.data.streams import PADDING_VALUE, Sequences, StreamInfo

__all__ = ["PAIR_NAMES", "Borrowed", "Merger", "Plan", "one_line", "padded"]

#: the stream names of a sample that is a pair, when ``names`` is not given
PAIR_NAMES = ("features", "labels")
#: Python numbers as tensors
_NUMBER_DTYPES = {bool: torch.bool, int: torch.int64, float: torch.float32}


# -- what a sample holds ----------------------------------------------------------------------------------

class _Layout:
    """How a sample (or a collated batch) maps onto streams: ``kind`` is ``"tuple"`` (elements by
    position), ``"dict"`` (values by key) or ``"single"`` (the value itself); ``names`` in stream order."""

    def __init__(self, kind: str, keys: tuple, names: tuple[str, ...]):
        self.kind, self.keys, self.names = kind, keys, names

    @classmethod
    def of(cls, value: object, names: tuple[str, ...] | None, what: str) -> _Layout:
        """The layout of ``value`` (sample 0, or ``collate_fn([sample 0])``), named by ``names``."""
        if isinstance(value, Mapping):
            if names is not None:
                raise ValueError(f"names={list(names)}: {what} is a dict, whose keys name its streams "
                                 f"({', '.join(map(repr, value))}); leave names out")
            bad = [key for key in value if not isinstance(key, str)]
            if bad:
                raise DataError(f"{what} is a dict with the key {bad[0]!r}; stream names are strings")
            if not value:
                raise DataError(f"{what} is an empty dict; a sample holds at least one stream")
            return cls("dict", tuple(value), tuple(value))
        if isinstance(value, (tuple, list)):
            if names is None:
                if len(value) != 2:
                    raise DataError(f"{what} is {_describe(value)}; name its streams "
                                    f"with names=[...] (one per value; only a pair is named "
                                    f"{' and '.join(PAIR_NAMES)} without it)")
                names = PAIR_NAMES
            if len(names) != len(value):
                raise ValueError(f"names={list(names)} names {len(names)} streams but {what} is a "
                                 f"{type(value).__name__} of {len(value)} values; give one name per value")
            return cls("tuple", tuple(range(len(value))), tuple(names))
        if names is not None and len(names) != 1:
            raise ValueError(f"names={list(names)} names {len(names)} streams but {what} is a single "
                             f"{type(value).__name__} (one stream); give one name")
        return cls("single", (None,), tuple(names or ("features",)))

    def split(self, value: object, what: str) -> list:
        """The values of ``value``'s streams, in stream order.

        Raises:
            DataError: ``value`` has another structure than sample 0 (``what`` names it).
        """
        if self.kind == "tuple":
            if isinstance(value, (tuple, list)) and len(value) == len(self.keys):
                return list(value)
            expected = f"a tuple of {len(self.keys)} values ({', '.join(self.names)})"
        elif self.kind == "dict":
            if isinstance(value, Mapping) and len(value) == len(self.keys):
                try:
                    return [value[key] for key in self.keys]
                except KeyError:
                    pass
            expected = f"a dict with the keys {', '.join(map(repr, self.keys))}"
        else:
            if not isinstance(value, (tuple, list, Mapping)):
                return [value]
            expected = "a single value"
        return _raise(DataError(f"{what} is {_describe(value)}, but sample 0 was {expected}; every sample needs the "
                                f"same structure"))


class Plan:
    """What reading a chunk of samples needs, in a form that pickles and that each worker holds a copy
    of: the layouts, the streams (from sample 0) and ``collate_fn``. Its methods run in the caller or in
    a worker; everything they raise is a one-line DataError naming the stream and the index."""

    def __init__(self, type_name: str, collate_fn: Callable | None):
        self.type_name = type_name
        self.collate_fn = collate_fn
        self.sample_layout: _Layout | None = None
        self.batch_layout: _Layout | None = None
        self.infos: dict[str, StreamInfo] = {}
        #: set by a worker process on its own copy: ``arena(shape, dtype)``, the place in the worker's
        #: shared-memory arena to collate a result into, or None (small enough to send inline, or no room)
        self.arena: Callable[[tuple[int, ...], torch.dtype], torch.Tensor | None] | None = None

    # -- construction ---------------------------------------------------------------------------------
    def describe(self, dataset, names, sequence_names: list[str], num_classes: dict) -> None:
        """Sets the layouts and stream infos from sample 0 (and ``collate_fn([sample 0])``)."""
        sample = self.sample(dataset, 0)
        what = f"{self.type_name}[0]"
        layout = None
        if self.collate_fn is None or sequence_names:
            layout = self.sample_layout = _Layout.of(sample, names, what)
        if self.collate_fn is not None:
            batch = self.collate(dataset, [sample], [0])
            self.batch_layout = _Layout.of(batch, names, f"collate_fn([{what}])")
            if layout is not None and set(layout.names) != set(self.batch_layout.names):
                raise DataError(f"collate_fn([{what}]) holds the streams {list(self.batch_layout.names)} but {what} "
                                f"holds {list(layout.names)}; the batch must have the sample's streams")
        stream_names = (self.batch_layout or layout).names
        unknown = [name for name in sequence_names if name not in stream_names]
        if unknown:
            raise ValueError(f"sequences names {unknown}, which are not streams; the streams are {list(stream_names)}")
        unknown = sorted(set(num_classes) - set(stream_names))
        if unknown:
            raise ValueError(f"num_classes names {unknown}, which are not streams; the streams are "
                             f"{list(stream_names)}")
        sample_values = dict(zip(layout.names, layout.split(sample, what))) if layout is not None else {}
        batch_values = dict(zip(self.batch_layout.names, self.batch_layout.split(batch, what))) \
            if self.batch_layout is not None else {}
        for name in stream_names:
            if name in sequence_names:
                tensor = _to_tensor(sample_values[name], name, what)
                self._check_steps(name, tensor, 0)
                shape = tuple(tensor.shape[1:])
            elif self.batch_layout is not None:
                tensor = _to_tensor(batch_values[name], name, f"collate_fn([{what}])")
                if tensor.dim() == 0 or tensor.shape[0] != 1:
                    raise DataError(f"stream {name!r}: collate_fn([{what}]) returned shape {list(tensor.shape)}; "
                                    f"expected [1, ...] (one row per sample)")
                shape = tuple(tensor.shape[1:])
            else:
                tensor = _to_tensor(sample_values[name], name, what)
                shape = tuple(tensor.shape)
            classes = None
            if name in num_classes:
                classes = check_int(f"num_classes[{name!r}]", num_classes[name], 1)
                check_id_dtype(name, tensor.dtype, classes, what)
            self.infos[name] = StreamInfo(name, shape, tensor.dtype, is_sequence=name in sequence_names,
                                          num_classes=classes)

    # -- reading --------------------------------------------------------------------------------------
    def sample(self, dataset, index: int):
        """``dataset[index]``; its exception as one DataError line (a DataError of the data set's own, which
        names what failed already, as it is)."""
        try:
            return dataset[index]
        except DataError:
            raise
        except Exception as error:  # noqa: BLE001 - any error of user code becomes the one-line DataError
            raise DataError(f"{self.type_name}[{index}] raised {type(error).__name__}: {one_line(error)}") from error

    def collate(self, dataset, samples: list, indices: list[int]):
        """``collate_fn(samples)``; its exception as one DataError line."""
        try:
            return self.collate_fn(samples)
        except Exception as error:  # noqa: BLE001
            raise DataError(f"collate_fn over {self._span(indices)} raised {type(error).__name__}: "
                            f"{one_line(error)}") from error

    def read_chunk(self, dataset, indices: np.ndarray) -> dict:
        """The samples ``indices`` collated: name -> tensor ``[n, ...]``, or for a sequence stream
        ``(values [total steps, ...], lengths int64 [n])`` (the caller pads, once for all chunks)."""
        indices = indices.tolist()
        samples = [self.sample(dataset, index) for index in indices]
        values = None
        if self.sample_layout is not None:
            columns = [self.sample_layout.split(sample, f"{self.type_name}[{index}]")
                       for sample, index in zip(samples, indices)]
            values = dict(zip(self.sample_layout.names, zip(*columns)))
        batch = None
        if self.batch_layout is not None:
            collated = self.collate(dataset, samples, indices)
            batch = dict(zip(self.batch_layout.names,
                             self.batch_layout.split(collated, f"collate_fn over {self._span(indices)}")))
        del samples
        out = {}
        for name, info in self.infos.items():
            if info.is_sequence:
                out[name] = self._pack(info, values[name], indices)
                ids = out[name][0]
            elif batch is not None:
                ids = out[name] = self._batch(info, batch[name], indices)
            else:
                ids = out[name] = self._stack(info, values[name], indices)
            if info.num_classes is not None:
                self._check_ids(info, ids, indices, out[name][1] if info.is_sequence else None)
        return out

    def scan_chunk(self, dataset, indices: np.ndarray, names: tuple[str, ...]) -> dict[str, np.ndarray]:
        """The steps of the sequence streams ``names`` of the samples ``indices`` (int64 arrays)."""
        lengths = {name: np.empty(len(indices), dtype=np.int64) for name in names}
        positions = [self.sample_layout.names.index(name) for name in names]
        for row, index in enumerate(indices.tolist()):
            values = self.sample_layout.split(self.sample(dataset, index), f"{self.type_name}[{index}]")
            for name, position in zip(names, positions):
                value = values[position]
                shape = getattr(value, "shape", None)
                if shape is None:
                    value = _to_tensor(value, name, f"{self.type_name}[{index}]")
                    shape = value.shape
                if len(shape) == 0:
                    raise DataError(f"stream {name!r}: {self.type_name}[{index}] is a single number; a sequence is an "
                                    f"array of steps [length, ...]")
                if shape[0] == 0:
                    raise DataError(f"stream {name!r}: {self.type_name}[{index}] is an empty sequence; every sequence "
                                    f"needs at least one step")
                lengths[name][row] = shape[0]
        return lengths

    def empty(self) -> dict[str, torch.Tensor | Sequences]:
        """The streams of no samples."""
        out: dict[str, torch.Tensor | Sequences] = {}
        for name, info in self.infos.items():
            data = torch.empty((0, 0, *info.shape) if info.is_sequence else (0, *info.shape), dtype=info.dtype)
            out[name] = Sequences(data, torch.zeros(0, dtype=torch.int64), _checked=True) if info.is_sequence else data
        return out

    # -- per stream -----------------------------------------------------------------------------------
    def _span(self, indices: list[int]) -> str:
        return f"{self.type_name}[{indices[0]}]" if len(indices) == 1 else \
            f"{self.type_name}[{indices[0]}..{indices[-1]}] ({len(indices)} samples)"

    def _cast(self, info: StreamInfo, tensor: torch.Tensor, what: str) -> torch.Tensor:
        if tensor.dtype == info.dtype:
            return tensor
        if torch.can_cast(tensor.dtype, info.dtype):
            return tensor.to(info.dtype)
        return _raise(DataError(f"stream {info.name!r}: {what} holds {str(tensor.dtype).replace('torch.', '')} values "
                                f"but sample 0 holds {str(info.dtype).replace('torch.', '')}; every sample of a stream "
                                f"needs one dtype (or one that converts to it without loss)"))

    def _stack(self, info: StreamInfo, values: tuple, indices: list[int]) -> torch.Tensor:
        """The default collation of a stream with one value per sample: the values stacked."""
        kind = type(values[0])
        if not info.shape and kind in _NUMBER_DTYPES and all(type(value) is kind for value in values):
            return self._cast(info, torch.tensor(values, dtype=_NUMBER_DTYPES[kind]), self._span(indices))
        tensors = []
        for value, index in zip(values, indices):
            what = f"{self.type_name}[{index}]"
            tensor = _to_tensor(value, info.name, what)
            if tensor.shape != info.shape:
                raise DataError(f"stream {info.name!r}: {what} has shape {list(tensor.shape)} but sample 0 has "
                                f"{list(info.shape)}; a stream with one value per sample needs one shape (give "
                                f"variable-length streams in sequences=[...])")
            tensors.append(self._cast(info, tensor, what))
        return self._collate(torch.stack, tensors, (len(tensors), *info.shape))

    def _collate(self, combine: Callable, tensors: list[torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
        """``combine(tensors, 0)`` (stack or cat); in a worker process a large result is written straight into
        the worker's shared-memory arena, which the reading process copies it out of (no other copy)."""
        out = self.arena(shape, tensors[0].dtype) if self.arena is not None else None
        return combine(tensors, 0) if out is None else combine(tensors, 0, out=out)

    def _check_steps(self, name: str, tensor: torch.Tensor, index: int) -> None:
        if tensor.dim() == 0:
            raise DataError(f"stream {name!r}: {self.type_name}[{index}] is a single number; a sequence is an array "
                            f"of steps [length, ...]")
        if tensor.shape[0] == 0:
            raise DataError(f"stream {name!r}: {self.type_name}[{index}] is an empty sequence; every sequence needs "
                            f"at least one step")

    def _pack(self, info: StreamInfo, values: tuple, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """A sequence stream's samples back to back, and their lengths."""
        tensors = []
        for value, index in zip(values, indices):
            what = f"{self.type_name}[{index}]"
            tensor = _to_tensor(value, info.name, what)
            self._check_steps(info.name, tensor, index)
            if tuple(tensor.shape[1:]) != info.shape:
                raise DataError(f"stream {info.name!r}: the steps of {what} have shape {list(tensor.shape[1:])} but "
                                f"those of sample 0 have {list(info.shape)}; every step of a sequence stream needs "
                                f"one shape")
            tensors.append(self._cast(info, tensor, what))
        lengths = torch.tensor([len(tensor) for tensor in tensors], dtype=torch.int64)
        return self._collate(torch.cat, tensors, (int(lengths.sum()), *info.shape)), lengths

    def _batch(self, info: StreamInfo, value: object, indices: list[int]) -> torch.Tensor:
        """A stream of ``collate_fn``'s batch, checked: ``[n, *shape]`` of the stream's dtype."""
        what = f"collate_fn over {self._span(indices)}"
        tensor = _to_tensor(value, info.name, what)
        if tuple(tensor.shape) != (len(indices), *info.shape):
            raise DataError(f"stream {info.name!r}: {what} returned shape {list(tensor.shape)}; expected "
                            f"{[len(indices), *info.shape]} (one row per sample, each like collate_fn([sample 0]))")
        return self._cast(info, tensor, what)

    def _check_ids(self, info: StreamInfo, ids: torch.Tensor, indices: list[int],
                   lengths: torch.Tensor | None) -> None:
        """Raises DataError naming the first sample with an id outside ``[0, num_classes)``."""
        if not ids.numel() or (int(ids.min()) >= 0 and int(ids.max()) < info.num_classes):
            return
        flat = ids.reshape(len(ids), -1)
        outside = (flat < 0) | (flat >= info.num_classes)
        first = int(outside.any(dim=1).nonzero()[0])
        value = int(flat[first][outside[first]][0])
        if lengths is not None:  # a position among the steps: find its sample
            first = int(np.searchsorted(np.cumsum(lengths.numpy()), first, side="right"))
        raise DataError(f"stream {info.name!r}: {self.type_name}[{indices[first]}] holds the id {value}, outside its "
                        f"vocabulary [0, {info.num_classes}) (num_classes={info.num_classes})")



# -- values -----------------------------------------------------------------------------------------------

def _to_tensor(value: object, name: str, what: str) -> torch.Tensor:
    """A sample's value as a CPU-side tensor (tensors as they are; see the class docstring)."""
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, (np.ndarray, np.generic)):
        return _from_numpy(np.asarray(value), name, what)
    kind = _NUMBER_DTYPES.get(type(value))
    if kind is None:
        kind = next((dtype for number, dtype in _NUMBER_DTYPES.items() if isinstance(value, number)), None)
    if kind is not None:
        try:
            return torch.tensor(value, dtype=kind)
        except (RuntimeError, OverflowError) as error:
            raise DataError(f"stream {name!r}: {what} holds {value!r}, which is no {kind}: {one_line(error)}") from None
    if isinstance(value, list):
        return _from_numpy(np.asarray(value), name, what)
    raise DataError(f"stream {name!r}: {what} is {_describe(value)}; expected a tensor, a numpy array or a number")


def _from_numpy(array: np.ndarray, name: str, what: str) -> torch.Tensor:
    if array.dtype.kind not in "biufc":
        raise DataError(f"stream {name!r}: {what} is an array of {array.dtype} values; expected numbers (a list of "
                        f"arrays of different shapes is a sequence stream's job, see sequences=)")
    if array.dtype == np.float64:
        array = array.astype(np.float32)
    elif not array.flags.writeable or not array.flags.c_contiguous:
        array = array.copy()
    try:
        return torch.from_numpy(array)
    except TypeError as error:
        raise DataError(f"stream {name!r}: {what}: {one_line(error)}") from None


def padded(values: torch.Tensor, lengths: torch.Tensor, info: StreamInfo) -> Sequences:
    """Sequences ``[n, longest, *step_shape]`` from steps stored back to back and their lengths."""
    longest = int(lengths.max()) if len(lengths) else 0
    data = torch.full((len(lengths), longest, *info.shape), PADDING_VALUE, dtype=values.dtype)
    if len(lengths):
        data[torch.arange(longest).unsqueeze(0) < lengths.unsqueeze(1)] = values  # row-major: sequence by sequence
    return Sequences(data, lengths, _checked=True)



def _describe(value: object) -> str:
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)} value{'' if len(value) == 1 else 's'}"
    if isinstance(value, Mapping):
        return f"a dict with the keys {', '.join(map(repr, value))}"
    if isinstance(value, (torch.Tensor, np.ndarray)):
        return f"a {type(value).__name__} of shape {list(value.shape)}"
    return f"a {type(value).__name__}"


def one_line(error: object) -> str:
    return " ".join(str(error).split()) or "(no message)"


def _raise(error: Exception):
    raise error




# -- putting chunks together ---------------------------------------------------------------------------------

class Merger:
    """Collects the chunks of one read as they arrive: rows of the streams with one value per sample are
    copied into their place in tensors ``[n, ...]`` made once (one chunk is kept as it is, unless it lies in
    a worker's arena), a sequence stream's steps are kept to be padded once at the end."""

    def __init__(self, streams: Mapping[str, StreamInfo], chunks: list[np.ndarray]):
        self.streams = streams
        self.bounds = np.cumsum([0] + [len(chunk) for chunk in chunks]).tolist()
        self.single = len(chunks) == 1
        self.fixed: dict[str, torch.Tensor] = {} if self.single else {
            name: torch.empty((self.bounds[-1], *info.shape), dtype=info.dtype)
            for name, info in streams.items() if not info.is_sequence}
        self.packed: dict[str, list] = {name: [None] * len(chunks) for name, info in streams.items() if info.is_sequence}

    def add(self, number: int, part: dict) -> None:
        """Takes chunk ``number``'s streams (copying what lies in an arena, which its worker reuses)."""
        for name, info in self.streams.items():
            value = part[name]
            if info.is_sequence:
                self.packed[name][number] = (_owned(value[0]), _owned(value[1]))
            elif self.single:
                self.fixed[name] = _owned(value)
            else:
                self.fixed[name][self.bounds[number]:self.bounds[number + 1]].copy_(_borrowed(value))

    def result(self) -> dict:
        """name -> tensor ``[n, ...]``, or ``(steps back to back, lengths)`` for a sequence stream."""
        out: dict = dict(self.fixed)
        for name, parts in self.packed.items():
            out[name] = (parts[0][0] if len(parts) == 1 else torch.cat([values for values, _ in parts]),
                         parts[0][1] if len(parts) == 1 else torch.cat([lengths for _, lengths in parts]))
        return out


class Borrowed:
    """A tensor that lies in a worker process's arena: valid until that worker's next task."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


def _borrowed(value) -> torch.Tensor:
    return value.tensor if isinstance(value, Borrowed) else value


def _owned(value) -> torch.Tensor:
    return value.tensor.clone() if isinstance(value, Borrowed) else value

