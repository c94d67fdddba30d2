"""One partition's share of a global minibatch: a mapping from stream name to data (CNTK's
``minibatch[stream]``), with the counts the training loop and the learners need.

Samples are counted in steps of the source's *defining stream* (``docs/data.md#samples-are-steps``):
for data without sequences a sample is a sample; for sequences it is one step (a token), so a
minibatch of 2,048 samples holds whole sequences totalling about 2,048 steps.
"""
from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping

import numpy as np
import torch

from dtrain.data.streams import Sequences

__all__ = ["Minibatch"]


class Minibatch(Mapping):
    """One partition's share of a global minibatch.

    ``minibatch[name]`` is a stream's data (``streams``, a dict the minibatch keeps as given): a tensor ``[n, ...]`` for a stream with one value per
    sequence, or :class:`~dtrain.data.streams.Sequences` (padded data and lengths) for a sequence
    stream. Data without sequences has the two streams ``features`` and ``labels``, also readable
    (and replaceable) as attributes.

    Attributes:
        streams: the mapping itself, as a dict.
        num_samples: samples in this share: steps of the defining stream (may be 0).
        global_num_samples: samples in the whole global minibatch (all partitions together).
        num_sequences: sequences in this share (equal to ``num_samples`` without sequences).
        global_num_sequences: sequences in the whole global minibatch.
        sweep_end: this global minibatch contains the last sequence of a sweep.
        first_position: timeline position (in sequences) of this share's first sequence. Without
            sequences the share is contiguous on the timeline; with sequences it holds the sequences
            dealt to this partition, in timeline order, and ``positions`` says where each lies.
        positions: int64 ``[num_sequences]`` timeline positions of the share's sequences, increasing
            (``[first_position, first_position + num_sequences)`` when not given, made when first asked for).
        owns_tensors: its streams' tensors are its own: the source made them for this minibatch (by indexing
            its data, not as views of a buffer it fills again), so they may be kept past the next read.
    """

    def __init__(self, streams: dict | None = None, *, features: torch.Tensor | None = None,
                 labels: torch.Tensor | None = None, global_num_samples: int, sweep_end: bool, first_position: int,
                 num_samples: int | None = None, num_sequences: int | None = None,
                 global_num_sequences: int | None = None, owns_tensors: bool = False,
                 positions: np.ndarray | None = None):
        self.streams: dict = streams if type(streams) is dict else (dict(streams) if streams is not None else {})
        if features is not None:
            self.streams["features"] = features
        if labels is not None:
            self.streams["labels"] = labels
        if num_sequences is None:
            num_sequences = _first_dimension(self.streams)
        self.num_sequences = num_sequences
        self.num_samples = num_sequences if num_samples is None else num_samples
        self.global_num_samples = global_num_samples
        self.global_num_sequences = global_num_samples if global_num_sequences is None else global_num_sequences
        self.sweep_end = sweep_end
        self.first_position = first_position
        self.owns_tensors = owns_tensors
        if positions is not None:
            self.positions = positions

    # -- the mapping -------------------------------------------------------------------------------
    def __getitem__(self, name: str):
        try:
            return self.streams[name]
        except KeyError:
            raise KeyError(f"this minibatch has no stream {name!r}; it has {', '.join(map(repr, self.streams))}") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self.streams)

    def __len__(self) -> int:
        return len(self.streams)

    # -- the two streams of data without sequences ---------------------------------------------------
    @property
    def features(self) -> torch.Tensor:
        """The ``features`` stream."""
        return self["features"]

    @features.setter
    def features(self, value: torch.Tensor) -> None:
        self.streams["features"] = value

    @property
    def labels(self) -> torch.Tensor:
        """The ``labels`` stream."""
        return self["labels"]

    @labels.setter
    def labels(self, value: torch.Tensor) -> None:
        self.streams["labels"] = value

    @functools.cached_property
    def positions(self) -> np.ndarray:
        """``[first_position, first_position + num_sequences)`` as int64 (timeline positions, in sequences); the
        positions given to the constructor instead, if any."""
        return np.arange(self.first_position, self.first_position + self.num_sequences, dtype=np.int64)

    @property
    def padding(self) -> tuple[int, int]:
        """``(padded positions, all positions)`` over this share's sequence streams (``(0, 0)`` without any)."""
        padded = total = 0
        for value in self.streams.values():
            if isinstance(value, Sequences):
                padded += value.padded_positions
                total += int(value.data.shape[0]) * int(value.data.shape[1])
        return padded, total

    def to(self, device: torch.device) -> Minibatch:
        """A minibatch with every stream on ``device``; itself when all are there already."""
        for value in self.streams.values():
            if (value.data if type(value) is Sequences else value).device != device:
                break
        else:
            return self  # the usual case on the CPU: a loop, no dict, no call into torch
        moved = {name: on_device(value, device) for name, value in self.streams.items()}
        return self._with_streams(moved, self.num_samples, self.num_sequences)

    def select(self, start: int, stop: int, num_samples: int) -> Minibatch:
        """Sequences ``[start, stop)`` of this share as a minibatch of ``num_samples`` samples (a micro-batch);
        the global counts stay the global minibatch's."""
        streams = {name: value.select(start, stop) if isinstance(value, Sequences) else _rows(value, start, stop)
                   for name, value in self.streams.items()}
        selected = self._with_streams(streams, num_samples, stop - start)
        positions = self.__dict__.get("positions")  # given, or made already
        if positions is None:
            selected.first_position = self.first_position + start
        else:
            selected.positions = positions[start:stop]
            selected.first_position = int(positions[start]) if stop > start else self.first_position + start
        return selected

    def _with_streams(self, streams: dict, num_samples: int, num_sequences: int) -> Minibatch:
        return Minibatch(streams, global_num_samples=self.global_num_samples, sweep_end=self.sweep_end,
                         first_position=self.first_position, num_samples=num_samples, num_sequences=num_sequences,
                         global_num_sequences=self.global_num_sequences, owns_tensors=self.owns_tensors,
                         positions=self.__dict__.get("positions"))

    def __repr__(self) -> str:
        shapes = ", ".join(f"{name}: {value!r}" if isinstance(value, Sequences) else
                           f"{name}: {list(value.shape)} {str(value.dtype).replace('torch.', '')}"
                           for name, value in self.streams.items())
        return (f"Minibatch({self.num_samples} of {self.global_num_samples} samples, {self.num_sequences} sequences; "
                f"{shapes})")


def on_device(value, device: torch.device):
    """A stream's value (tensor or Sequences) on ``device``; the value itself, without a call into torch,
    when it is there already (a call costs microseconds in a loop measured against a bare one)."""
    if isinstance(value, Sequences):
        return value.to(device)
    return value if value.device == device else value.to(device)


def _rows(value: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Rows ``[start, stop)`` of a stream's tensor; a sparse one (which cannot be sliced) by index_select."""
    if value.is_sparse:
        return value.index_select(0, torch.arange(start, stop, device=value.device))
    return value[start:stop]


def _first_dimension(streams: dict) -> int:
    """Sequences in a minibatch: the first dimension of its streams (0 without any)."""
    for value in streams.values():
        return len(value) if isinstance(value, Sequences) else int(value.shape[0])
    return 0
