"""Named streams: what a deserializer declares (:class:`StreamInfo`), how a batch of variable-length
sequences travels (:class:`Sequences`), and how a config names a stream or a view of one
(:class:`StreamReference`: ``text``, ``text[1:]``, ``text[:-1].mask``).

CNTK's model (``docs/data.md``): a minibatch maps stream names to data; a *sequence stream*
holds, per sequence, a variable number of *steps*, and a sample of sequence data is one step. A
non-sequence stream holds one value per sequence (a class label, an image).

Conventions, used everywhere in dtrain:

* a sequence batch is padded: ``data`` is ``[n, T, *step_shape]`` with ``T`` the longest length,
  and every position at or after a sequence's length holds ``padding_value`` (0);
* ``lengths`` is an int64 tensor ``[n]`` kept on the CPU (``torch.nn.utils.rnn.pack_padded_sequence``
  wants it there, and counting steps then never waits for a device);
* ``mask`` is a bool ``[n, T]`` on the data's device, **True at real steps** (the opposite of
  ``torch.nn.MultiheadAttention``'s ``key_padding_mask``, which is ``~mask``).
"""
from __future__ import annotations

import re
from collections.abc import Sequence as SequenceType
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["PADDING_VALUE", "Sequences", "StreamInfo", "StreamReference", "step_counts"]

#: the value at every padded position of a sequence batch
PADDING_VALUE = 0


@dataclass(frozen=True)
class StreamInfo:
    """What one stream of a deserializer holds.

    Attributes:
        name: the stream's name (the key in every minibatch).
        shape: the shape of one sample, or of one step of a sequence stream (``()`` for a token id).
        dtype: the torch dtype the stream is served in.
        is_sequence: a variable number of steps per sequence (else one value per sequence).
        num_classes: for integer streams, the ids lie in ``[0, num_classes)`` (class labels, a
            vocabulary); ``None`` when not declared.
    """

    name: str
    shape: tuple[int, ...] = ()
    dtype: torch.dtype = torch.float32
    is_sequence: bool = False
    num_classes: int | None = None

    def describe(self) -> str:
        """``text: sequences of int64 steps, vocabulary 65`` for start-up lines and errors."""
        kind = "sequences of " if self.is_sequence else ""
        unit = "steps" if self.is_sequence else "values"
        shape = f"{list(self.shape)} " if self.shape else ""
        classes = f", {self.num_classes} classes" if self.num_classes is not None else ""
        return f"{self.name}: {kind}{shape}{str(self.dtype).replace('torch.', '')} {unit}{classes}"


class Sequences:
    """A batch of variable-length sequences: padded ``data`` and per-sequence ``lengths``.

    Args:
        data: ``[n, T, *step_shape]``; positions at or after a sequence's length hold
            ``PADDING_VALUE`` (:meth:`from_list` and dtrain's deserializers make sure of it).
        lengths: int64 ``[n]`` (moved to the CPU if it is not there), each in ``[0, T]``.

    Attributes:
        num_steps: the real steps of all sequences together (a Python int).

    Raises:
        ValueError: shapes that do not fit (``lengths`` not ``[n]``, a length above ``T``, a negative one).
    """

    __slots__ = ("data", "lengths", "num_steps", "_mask")

    def __init__(self, data: torch.Tensor, lengths: torch.Tensor, *, _checked: bool = False):
        if not _checked:
            if not isinstance(data, torch.Tensor) or data.dim() < 2:
                raise ValueError(f"Sequences data must be a tensor [n, T, ...], got "
                                 f"{tuple(data.shape) if isinstance(data, torch.Tensor) else type(data).__name__}")
            lengths = torch.as_tensor(lengths, dtype=torch.int64, device="cpu")
            if lengths.shape != (data.shape[0],):
                raise ValueError(f"Sequences lengths must have shape [{data.shape[0]}] (one per sequence), got "
                                 f"{tuple(lengths.shape)}")
            if len(lengths) and (int(lengths.min()) < 0 or int(lengths.max()) > data.shape[1]):
                raise ValueError(f"Sequences lengths must lie in [0, {data.shape[1]}] (the padded length), got "
                                 f"[{int(lengths.min())}, {int(lengths.max())}]")
        self.data = data
        self.lengths = lengths
        self.num_steps = int(lengths.sum()) if len(lengths) else 0
        self._mask: torch.Tensor | None = None

    @classmethod
    def from_list(cls, sequences: SequenceType[torch.Tensor], dtype: torch.dtype | None = None) -> Sequences:
        """Pads a list of ``[L_i, *step_shape]`` tensors (or arrays) into one batch.

        Raises:
            ValueError: the steps of two sequences have different shapes.
        """
        tensors = [torch.as_tensor(sequence) for sequence in sequences]
        if dtype is not None:
            tensors = [tensor.to(dtype) for tensor in tensors]
        lengths = torch.tensor([len(tensor) for tensor in tensors], dtype=torch.int64)
        if not tensors:
            return cls(torch.zeros(0, 0, dtype=dtype or torch.float32), lengths, _checked=True)
        step_shapes = {tuple(tensor.shape[1:]) for tensor in tensors}
        if len(step_shapes) > 1:
            raise ValueError(f"the steps of these sequences have different shapes {sorted(step_shapes)}; every step "
                             f"of a sequence stream must have one shape")
        data = torch.nn.utils.rnn.pad_sequence(tensors, batch_first=True, padding_value=PADDING_VALUE)
        return cls(data, lengths, _checked=True)

    # -- what a model reads ------------------------------------------------------------------------
    @property
    def num_sequences(self) -> int:
        """Sequences in the batch (``n``)."""
        return int(self.lengths.shape[0])

    @property
    def max_length(self) -> int:
        """The padded length ``T``."""
        return int(self.data.shape[1])

    @property
    def mask(self) -> torch.Tensor:
        """bool ``[n, T]`` on the data's device: True at real steps, False at padding (made once)."""
        if self._mask is None:
            steps = torch.arange(self.data.shape[1], device=self.data.device)
            self._mask = steps.unsqueeze(0) < self.lengths.to(self.data.device).unsqueeze(1)
        return self._mask

    @property
    def padded_positions(self) -> int:
        """Positions of the padded batch that are padding (``n * T - num_steps``)."""
        return int(self.data.shape[0]) * int(self.data.shape[1]) - self.num_steps

    def unpadded(self) -> list[torch.Tensor]:
        """Each sequence's real steps, ``[L_i, *step_shape]``."""
        return [self.data[index, :length] for index, length in enumerate(self.lengths.tolist())]

    # -- moving and cutting ------------------------------------------------------------------------
    def to(self, device: torch.device | str, non_blocking: bool = False) -> Sequences:
        """The batch with ``data`` on ``device`` (``lengths`` stay on the CPU); itself when already there."""
        device = torch.device(device)
        if self.data.device == device:
            return self
        moved = Sequences(self.data.to(device, non_blocking=non_blocking), self.lengths, _checked=True)
        return moved

    def __len__(self) -> int:
        return self.num_sequences

    def select(self, start: int, stop: int) -> Sequences:
        """Sequences ``[start, stop)`` of the batch, trimmed to their own longest length."""
        lengths = self.lengths[start:stop]
        longest = int(lengths.max()) if len(lengths) else 0
        return Sequences(self.data[start:stop, :longest], lengths, _checked=True)

    def steps(self, start: int = 0, stop: int | None = None) -> Sequences:
        """Each sequence's steps ``[start:stop]``, with Python's meaning per sequence: ``steps(1)`` drops
        the first step of every sequence, ``steps(0, -1)`` the last (a target shifted against its input).

        ``start`` must be >= 0 (a fixed step of every sequence); ``stop`` may be negative (counted from
        each sequence's own end) or None. Positions past the new lengths are reset to the padding value.
        """
        if start < 0:
            raise ValueError(f"a step slice starts at a fixed step (>= 0), got {start}")
        new_lengths = torch.from_numpy(step_counts(self.lengths.numpy(), start, stop))
        longest = int(new_lengths.max()) if len(new_lengths) else 0
        data = self.data[:, start:start + longest]
        sliced = Sequences(data, new_lengths, _checked=True)
        if sliced.padded_positions and bool((new_lengths < longest).any()):
            padding = ~sliced.mask
            data = data.masked_fill(padding.view(*padding.shape, *([1] * (data.dim() - 2))), PADDING_VALUE)
            sliced = Sequences(data, new_lengths, _checked=True)
        return sliced

    def __repr__(self) -> str:
        return (f"Sequences({self.num_sequences} sequences, {self.num_steps} steps, padded to {self.max_length}, "
                f"step shape {list(self.data.shape[2:])}, {str(self.data.dtype).replace('torch.', '')})")


def step_counts(lengths: np.ndarray, start: int = 0, stop: int | None = None) -> np.ndarray:
    """The lengths of ``sequence[start:stop]`` for sequences of ``lengths`` (Python slicing, per sequence).

    Vectorised over a numpy int array; ``start >= 0``. Used both to count a view's steps without
    reading data (minibatch budgets) and to cut a batch (:meth:`Sequences.steps`).
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if stop is None:
        ends = lengths
    elif stop >= 0:
        ends = np.minimum(lengths, stop)
    else:
        ends = np.maximum(lengths + stop, 0)
    return np.maximum(ends - start, 0)


# -- naming a stream, a view of it, or a part -----------------------------------------------------

_REFERENCE = re.compile(r"^(?P<name>[A-Za-z0-9_]+)(?:\[(?P<start>-?\d*):(?P<stop>-?\d*)\])?"
                        r"(?:\.(?P<part>data|lengths|mask))?$")

#: the reference that stands for the whole minibatch (a model, loss or metric that takes all streams)
WHOLE_MINIBATCH = "minibatch"


@dataclass(frozen=True)
class StreamReference:
    """A stream as a config or an API call names it: ``name``, ``name[start:stop]`` (a step slice of a
    sequence stream, per sequence), optionally followed by ``.data``, ``.lengths`` or ``.mask``.

    ``text[:-1]`` is every sequence of ``text`` without its last step (a language model's input) and
    ``text[1:]`` without its first (its target); ``src.mask`` is the bool mask of ``src``.
    """

    text: str
    name: str
    start: int = 0
    stop: int | None = None
    sliced: bool = False
    part: str | None = None

    @classmethod
    def parse(cls, text: object, what: str = "stream") -> StreamReference:
        """Parses ``text``.

        Raises:
            ValueError: not a stream name, slice or part (names ``what``, e.g. ``session.inputs[0]``).
        """
        match = _REFERENCE.match(text) if isinstance(text, str) else None
        if match is None:
            raise ValueError(f"{what}={text!r}: expected a stream name, optionally with a step slice and a part, "
                             f"e.g. text, text[1:], text[:-1], src.mask (or {WHOLE_MINIBATCH!r} for the whole "
                             f"minibatch)")
        start_text, stop_text = match.group("start"), match.group("stop")
        sliced = start_text is not None
        start = int(start_text) if start_text else 0
        stop = int(stop_text) if stop_text else None
        if start < 0:
            raise ValueError(f"{what}={text!r}: a step slice starts at a fixed step (>= 0), e.g. {match.group('name')}"
                             f"[1:] or {match.group('name')}[:-1]")
        return cls(text=text, name=match.group("name"), start=start, stop=stop, sliced=sliced, part=match.group("part"))

    @property
    def is_view(self) -> bool:
        """Whether this names a step slice (``text[1:]``) rather than the stream as stored."""
        return self.sliced and (self.start != 0 or self.stop is not None)

    def step_counts(self, lengths: np.ndarray) -> np.ndarray:
        """Steps of this view for sequences of ``lengths`` (the stream's own lengths when not sliced)."""
        return step_counts(lengths, self.start, self.stop) if self.is_view else np.asarray(lengths, dtype=np.int64)

    def check_keeps_steps(self, lengths: np.ndarray, what: str, data: str, consequence: str) -> None:
        """Raises ValueError when this view keeps no step of any sequence of ``lengths`` (every sequence of
        ``data`` too short for the slice): ``consequence`` says what that would mean (no sample to count,
        nothing for the model), and the line what length the sequences need."""
        if self.step_counts(lengths).any():
            return
        longest = int(np.max(lengths)) if len(lengths) else 0
        shortest = self._shortest_with_a_step()
        expected = (f"sequences of at least {shortest} steps of {self.name!r}" if shortest is not None
                    else "a slice that keeps some steps")
        raise ValueError(f"{what}={self.text!r}: no sequence of {data} has a step in {self.text!r} (the longest has "
                         f"{longest} step{'s' if longest != 1 else ''} of {self.name!r}), so {consequence}; "
                         f"expected {expected}")

    def _shortest_with_a_step(self) -> int | None:
        """The fewest steps a sequence needs for this view to keep one; None when no length does."""
        if not self.is_view:
            return 1
        if self.stop is None:
            return self.start + 1
        if self.stop >= 0:
            return self.start + 1 if self.stop > self.start else None
        return self.start - self.stop + 1

    def check_against(self, info: StreamInfo | None, streams: SequenceType[str], what: str,
                      data: str = "the data") -> None:
        """Raises ValueError when the stream does not exist in ``data`` (listing those that do) or a slice or
        part is asked of a stream that has no steps."""
        if info is None:
            raise ValueError(f"{what}={self.text!r}: {data} has no stream {self.name!r}; it has "
                             f"{', '.join(repr(name) for name in streams)}")
        if (self.sliced or self.part is not None) and not info.is_sequence:
            if info.shape:  # values with a first dimension: steps, if the deserializer was not told they vary
                raise ValueError(
                    f"{what}={self.text!r}: {self.name!r} is declared with one value of shape {list(info.shape)} per "
                    f"sample, so it has no steps to slice and no lengths or mask; if its first dimension is steps "
                    f"(samples of different lengths), declare it a sequence stream (sequences=[{self.name!r}] of "
                    f"DatasetDeserializer or NpzStreams, sequences: [{self.name}] in a config), else name it as "
                    f"{self.name!r}")
            raise ValueError(f"{what}={self.text!r}: {self.name!r} is not a sequence stream (one value per sample), "
                             f"so it has no steps to slice and no lengths or mask; name it as {self.name!r}")

    def resolve(self, value):
        """This reference's value from the stream's value (a tensor, or :class:`Sequences`)."""
        if self.is_view:
            value = value.steps(self.start, self.stop)
        if self.part is None:
            return value
        return getattr(value, self.part)
