"""A stream deserializer over in-memory data: named arrays, and sequences as lists of arrays."""
from __future__ import annotations

from collections.abc import Mapping, Sequence as SequenceType

import numpy as np
import torch

from dtrain.data._checks import check_id_dtype, check_int, finite_once
from dtrain.data.errors import DataError
from dtrain.data.streams import PADDING_VALUE, Sequences, StreamInfo

__all__ = ["StreamArrays"]


class _PackedSequences:
    """Variable-length sequences stored back to back (``values``) with their ``offsets``: a minibatch of
    them is gathered with one index computation instead of a Python loop over sequences."""

    def __init__(self, name: str, sequences: SequenceType):
        tensors = []
        for index, sequence in enumerate(sequences):
            tensor = _as_tensor(f"{name}[{index}]", sequence)
            if tensor.dim() == 0:
                raise DataError(f"stream {name!r}: sequence {index} is a single number; a sequence is an array of "
                                f"steps [length, ...]")
            if len(tensor) == 0:
                raise DataError(f"stream {name!r}: sequence {index} is empty; every sequence needs at least one step")
            tensors.append(tensor)
        if not tensors:
            raise DataError(f"stream {name!r} has no sequences")
        shapes = {tuple(t.shape[1:]) for t in tensors}
        dtypes = {t.dtype for t in tensors}
        if len(shapes) > 1:
            raise DataError(f"stream {name!r}: the steps of its sequences have different shapes {sorted(shapes)}; "
                            f"every step must have one shape")
        if len(dtypes) > 1:
            raise DataError(f"stream {name!r}: its sequences have different dtypes {sorted(map(str, dtypes))}")
        self.lengths = np.array([len(t) for t in tensors], dtype=np.int64)
        self.offsets = np.zeros(len(tensors) + 1, dtype=np.int64)
        np.cumsum(self.lengths, out=self.offsets[1:])
        self.values = torch.cat(tensors)
        self.step_shape = tuple(tensors[0].shape[1:])

    @classmethod
    def from_flat(cls, values: torch.Tensor, lengths: np.ndarray) -> "_PackedSequences":
        """Sequences already stored back to back (``values``), ``lengths`` steps each (all >= 1)."""
        packed = cls.__new__(cls)
        packed.lengths = np.asarray(lengths, dtype=np.int64)
        packed.offsets = np.zeros(len(packed.lengths) + 1, dtype=np.int64)
        np.cumsum(packed.lengths, out=packed.offsets[1:])
        packed.values, packed.step_shape = values, tuple(values.shape[1:])
        return packed

    def gather(self, indices: np.ndarray) -> Sequences:
        lengths = self.lengths[indices]
        longest = int(lengths.max()) if len(lengths) else 0
        data = torch.full((len(indices), longest, *self.step_shape), PADDING_VALUE, dtype=self.values.dtype)
        if len(indices):
            steps = np.arange(longest)
            valid = steps[None, :] < lengths[:, None]
            source = (self.offsets[indices][:, None] + steps[None, :])[valid]
            data[torch.from_numpy(valid)] = self.values[torch.from_numpy(source)]
        return Sequences(data, torch.from_numpy(lengths), _checked=True)


class StreamArrays:
    """Named streams held in memory: an array ``[n, ...]`` per stream with one value per sequence, a
    list of ``n`` arrays ``[L_i, ...]`` per sequence stream.

    ``StreamArrays({"text": token_lists})`` is a language model's corpus;
    ``StreamArrays({"graphemes": words, "phonemes": pronunciations})`` a sequence-to-sequence pair
    (the two streams of one sequence may differ in length).

    Args:
        streams: name -> a numpy array or tensor (one value per sequence; a sparse COO tensor is
            served sparse) or a list of them (a sequence stream). Every stream has the same number
            of sequences.
        num_classes: name -> the number of classes or the vocabulary of an integer stream (its
            values must lie in ``[0, num_classes)``); other integer streams are not checked.
        defining_stream: the stream whose steps count samples, when the source is not told.

    Raises:
        DataError: streams of different sizes, an empty sequence, steps of different shapes, or an
            id outside its stream's ``num_classes``.
        TypeError / ValueError: bad arguments.
    """

    def __init__(self, streams: Mapping[str, object], num_classes: Mapping[str, int] | None = None,
                 defining_stream: str | None = None):
        if not isinstance(streams, Mapping) or not streams:
            raise TypeError(f"streams must be a non-empty mapping name -> array or list of arrays, got "
                            f"{type(streams).__name__}")
        num_classes = dict(num_classes or {})
        unknown = sorted(set(num_classes) - set(streams))
        if unknown:
            raise ValueError(f"num_classes names streams {unknown} that are not in streams {sorted(streams)}")
        self._fixed: dict[str, torch.Tensor] = {}
        self._sequences: dict[str, _PackedSequences] = {}
        self.streams: dict[str, StreamInfo] = {}
        sizes = {}
        for name, value in streams.items():
            name = str(name)
            classes = None if name not in num_classes else check_int(f"num_classes[{name!r}]", num_classes[name], 1)
            if isinstance(value, (list, tuple)):
                packed = self._sequences[name] = _PackedSequences(name, value)
                sizes[name] = len(packed.lengths)
                dtype, shape, values = packed.values.dtype, packed.step_shape, packed.values
            else:
                tensor = self._fixed[name] = _as_tensor(name, value)
                if tensor.dim() == 0:
                    raise DataError(f"stream {name!r} is a single number; expected one value per sequence [n, ...]")
                sizes[name] = len(tensor)
                dtype, shape, values = tensor.dtype, tuple(tensor.shape[1:]), tensor
            if classes is not None:
                _check_ids(name, values, classes)
            self.streams[name] = StreamInfo(name, shape, dtype, is_sequence=name in self._sequences,
                                            num_classes=classes)
        if len(set(sizes.values())) > 1:
            raise DataError(f"streams hold different numbers of sequences: "
                            f"{', '.join(f'{name} {size}' for name, size in sizes.items())}; every stream needs one "
                            f"entry per sequence")
        self.num_sequences = next(iter(sizes.values()))
        if defining_stream is not None and defining_stream not in self.streams:
            raise ValueError(f"defining_stream={defining_stream!r} is not a stream; streams are {sorted(self.streams)}")
        self.defining_stream = defining_stream
        # checked once here, so the source need not check every minibatch it reads (a memory-mapped file is not
        # read whole for it: its minibatches are checked as read)
        mapped = any(isinstance(value, np.memmap) for value in streams.values())
        self.values_finite = None if mapped else \
            finite_once(*self._fixed.values(), *(packed.values for packed in self._sequences.values()))

    def sequence_lengths(self, name: str) -> np.ndarray:
        """Steps of every sequence of the sequence stream ``name``."""
        return self._sequences[name].lengths

    def read(self, indices: np.ndarray) -> dict[str, torch.Tensor | Sequences]:
        """The streams of sequences ``indices``: tensors, and Sequences for sequence streams."""
        indices = np.asarray(indices, dtype=np.int64)
        index = torch.from_numpy(indices)
        out: dict[str, torch.Tensor | Sequences] = {name: tensor.index_select(0, index) if tensor.is_sparse
                                                    else tensor[index] for name, tensor in self._fixed.items()}
        out.update((name, packed.gather(indices)) for name, packed in self._sequences.items())
        return out


def _as_tensor(name: str, value: object) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    array = np.asarray(value)
    if array.dtype == object:
        raise DataError(f"stream {name!r} could not be read as one array (its entries differ in shape); a sequence "
                        f"stream is a list of arrays")
    if array.dtype == np.float64:
        array = array.astype(np.float32)
    if array.ndim == 0:  # np.ascontiguousarray would make it one-dimensional
        return torch.from_numpy(array.copy())
    return torch.from_numpy(np.ascontiguousarray(array))


def _check_ids(name: str, values: torch.Tensor, num_classes: int) -> None:
    """In-memory ids of a stream that declares ``num_classes``: integers, inside ``[0, num_classes)``."""
    check_id_dtype(name, values.dtype, num_classes)
    if values.numel() and (int(values.min()) < 0 or int(values.max()) >= num_classes):
        raise DataError(f"stream {name!r} holds ids in [{int(values.min())}, {int(values.max())}], outside its "
                        f"vocabulary [0, {num_classes})")


class NpzStreams(StreamArrays):
    """Named streams from a NumPy ``.npz`` file (``numpy.savez``): each array is a stream with one value per
    sequence, except the streams named in ``sequences``, stored flat (all steps back to back) beside an
    int array ``<name>_lengths`` of the steps of each sequence.

    ``np.savez("train.npz", features=x, labels=y)`` is data without sequences that trains with the
    defaults (``inputs: [features]``, ``target: labels``); ``np.savez("corpus.npz",
    text=np.concatenate(token_lists), text_lengths=[len(t) for t in token_lists])`` with
    ``sequences=[text]`` is a corpus of variable-length token sequences. Loaded without pickle.

    Args:
        path: the ``.npz`` file.
        sequences: names of the sequence streams.
        num_classes, defining_stream: as :class:`StreamArrays`.

    Raises:
        DataError: the file is missing or not an ``.npz``, a sequence stream without its lengths, or
            lengths that do not add up to its steps (plus every check of :class:`StreamArrays`).
    """

    def __init__(self, path: str, sequences: SequenceType[str] = (), num_classes: Mapping[str, int] | None = None,
                 defining_stream: str | None = None):
        self.path = str(path)
        try:
            with np.load(self.path, allow_pickle=False) as archive:
                arrays = {name: archive[name] for name in archive.files}
        except FileNotFoundError:
            raise DataError(f"{self.path}: no such file; expected an .npz file written by numpy.savez") from None
        except (OSError, ValueError) as error:
            raise DataError(f"{self.path}: not a readable .npz file ({error}); expected one written by numpy.savez "
                            f"(arrays only, no pickled objects)") from None
        streams: dict[str, object] = {}
        for name in sequences:
            lengths_name = f"{name}_lengths"
            if name not in arrays or lengths_name not in arrays:
                raise DataError(f"{self.path}: sequence stream {name!r} needs the arrays {name!r} (all steps back to "
                                f"back) and {lengths_name!r} (steps per sequence); the file has {sorted(arrays)}")
            values, lengths = arrays.pop(name), arrays.pop(lengths_name).astype(np.int64)
            if lengths.ndim != 1 or int(lengths.sum()) != len(values):
                raise DataError(f"{self.path}: {lengths_name} adds up to {int(lengths.sum())} steps but {name!r} has "
                                f"{len(values)}; expected one length per sequence, summing to the steps")
            streams[name] = np.split(values, np.cumsum(lengths)[:-1])
        _check_undeclared_sequences(self.path, arrays)
        streams.update(arrays)
        super().__init__(streams, num_classes=num_classes, defining_stream=defining_stream)


def _check_undeclared_sequences(path: str, arrays: dict[str, np.ndarray]) -> None:
    """Raises DataError for a sequence stream stored flat (``name`` beside ``name_lengths`` that adds up to its
    steps) but not named in ``sequences``: read as streams of one value per sequence, their sizes would
    disagree, and the line would not say why."""
    for name, values in arrays.items():
        lengths = arrays.get(f"{name}_lengths")
        if lengths is None or lengths.ndim != 1 or not np.issubdtype(lengths.dtype, np.integer) \
                or len(lengths) == len(values) or int(lengths.sum()) != len(values):
            continue
        raise DataError(f"{path}: {name!r} holds {len(values)} steps that {name}_lengths splits into {len(lengths)} "
                        f"sequences, a sequence stream stored flat; expected it declared as one: "
                        f"sequences=[{name!r}] (sequences: [{name}] in a config)")
