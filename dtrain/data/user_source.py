"""UserMinibatchSource: what the training session reads of a source, declared once (CNTK's ``UserMinibatchSource``).

A source of one's own subclasses it, implements ``next_minibatch`` (and ``get_checkpoint_state`` /
``restore_from_checkpoint`` for checkpoints and evaluations), and overrides the facts it has; the defaults
say "not known", and the session then checks and derives nothing from them. ``MinibatchSource`` is one.
An object that only has the methods (no base) is wrapped once when the session starts (:func:`as_source`),
so the session never asks a source whether it has an attribute.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from dtrain.data.deserializer import deserializer_identity
from dtrain.data.minibatch import Minibatch
from dtrain.data.streams import StreamInfo

__all__ = ["UserMinibatchSource", "as_source"]


class UserMinibatchSource:
    """The interface of a training, cross-validation or test source (sizes global, in samples).

    Implement :meth:`next_minibatch`; :meth:`get_checkpoint_state` and :meth:`restore_from_checkpoint` where
    the run writes checkpoints or evaluates (a source that cannot say where it is refuses them in one line
    rather than restart from the beginning unseen). Override the facts the source knows:

    - ``streams``: name -> :class:`~dtrain.data.StreamInfo` of every minibatch; empty (the default): the
      session checks no stream name or id range against it.
    - ``has_sequences``: whether a stream holds sequences (samples are then steps of ``defining_stream``);
      False by default. A source with sequences also gives ``defining_stream``, ``sequences_per_sweep``
      and :meth:`sequence_lengths`, and :meth:`use_defining_stream` if the session may choose that stream.
    - ``defining_stream_is_explicit``: True by default (the source counts its own samples).
    - ``samples_per_sweep``: samples in one pass over the data, or None (the default: unknown; then
      schedules that change once per sweep need ``epoch_size``).
    - ``deserializer``: what the source reads, for the checkpoint's identity; None by default.
    - ``repeats_forever``: whether reading never ends (no limit on samples or sweeps); False by default. An
      evaluation reads its source to the end, so such a source needs a limit there.
    """

    #: (see the class docstring: what the session reads, and each default's meaning)
    has_sequences: bool = False
    defining_stream: str | None = None
    defining_stream_is_explicit: bool = True
    samples_per_sweep: int | None = None
    sequences_per_sweep: int | None = None
    deserializer: Any = None
    repeats_forever: bool = False

    @property
    def streams(self) -> Mapping[str, StreamInfo]:
        """The streams every minibatch has, by name; empty: not declared."""
        return {}

    def next_minibatch(self, minibatch_size_in_samples: int, num_data_partitions: int = 1,
                       partition_index: int = 0) -> Minibatch:
        """This partition's share of the next global minibatch of ``minibatch_size_in_samples`` samples."""
        raise NotImplementedError(f"{type(self).__name__}.next_minibatch(minibatch_size_in_samples, "
                                  f"num_data_partitions, partition_index) is not implemented; a source implements it")

    def get_checkpoint_state(self) -> dict[str, Any]:
        """Where the source is, for a checkpoint or to come back after an evaluation."""
        raise NotImplementedError(f"{type(self).__name__} does not say where it is (get_checkpoint_state); "
                                  f"implement get_checkpoint_state() and restore_from_checkpoint(state) for "
                                  f"checkpoints and evaluations")

    def restore_from_checkpoint(self, state: dict[str, Any]) -> None:
        """Goes back to where :meth:`get_checkpoint_state` said it was."""
        raise NotImplementedError(f"{type(self).__name__} cannot go back to a position (restore_from_checkpoint); "
                                  f"implement get_checkpoint_state() and restore_from_checkpoint(state) for "
                                  f"checkpoints and evaluations")

    def check_pending_values(self) -> None:
        """Raises DataError for a sample handed out whose values (NaN, inf) are still being checked, after waiting
        for the check: a source that checks streams on an accelerator without waiting for the device
        (``MinibatchSource``) does it here; the session asks before it judges or keeps anything. Nothing here."""

    def sequence_lengths(self, reference: str) -> np.ndarray | None:
        """Steps of every sequence of a sequence stream or step slice (``text[:-1]``); None: not known, or a
        stream with one value per sample."""
        return None

    def use_defining_stream(self, text: str, what: str = "defining_stream") -> None:
        """Counts samples in steps of ``text`` (the session's target) where ``defining_stream_is_explicit`` is
        False; a source that lets the session choose implements it."""
        raise NotImplementedError(f"{type(self).__name__} leaves its defining stream to the session "
                                  f"(defining_stream_is_explicit is False) but does not implement use_defining_stream")

    def checkpoint_identity(self) -> dict[str, Any] | None:
        """What a checkpoint of this source must match to be restored. The default derives it from
        :attr:`deserializer` and :attr:`streams` (their types and sizes, not where the files lie); None, without
        a deserializer: the session then names the source's type."""
        return None if self.deserializer is None else deserializer_identity(self.deserializer, self.streams)


def _fact(name: str, default: Any) -> property:
    """A fact :class:`_Declared` reads from the object it wraps, or ``default`` where it has none."""
    return property(lambda self: getattr(self.source, name, default),
                    doc=f"The wrapped source's ``{name}``, else {default!r} (:class:`UserMinibatchSource`).")


class _Declared(UserMinibatchSource):
    """A source of one's own that does not subclass :class:`UserMinibatchSource`: its methods called, and each
    fact read from it where it has one, else the base's default. The only place a source is asked what it has."""

    has_sequences = _fact("has_sequences", False)
    defining_stream = _fact("defining_stream", None)
    defining_stream_is_explicit = _fact("defining_stream_is_explicit", True)
    samples_per_sweep = _fact("samples_per_sweep", None)
    sequences_per_sweep = _fact("sequences_per_sweep", None)
    deserializer = _fact("deserializer", None)
    streams = _fact("streams", {})

    def __init__(self, source: Any):
        self.source = source
        self.next_minibatch = source.next_minibatch  # bound once: nothing in between per step
        for method in ("get_checkpoint_state", "restore_from_checkpoint", "sequence_lengths", "use_defining_stream",
                       "check_pending_values"):
            if callable(getattr(source, method, None)):
                setattr(self, method, getattr(source, method))

    def checkpoint_identity(self) -> dict[str, Any] | None:
        """The wrapped source's own, else (without a deserializer) its type, as its checkpoints always named it."""
        own = getattr(self.source, "checkpoint_identity", None)
        if callable(own):
            return own()
        if self.deserializer is None:
            return {"source": f"{type(self.source).__module__}.{type(self.source).__qualname__}"}
        return super().checkpoint_identity()

    def __repr__(self) -> str:
        return repr(self.source)


def as_source(source: Any) -> UserMinibatchSource | None:
    """``source`` as the session reads it: itself when it is a :class:`UserMinibatchSource` (``MinibatchSource``
    is), else wrapped once so that every fact it does not have reads as the base's default. None stays None.

    Raises:
        TypeError: ``source`` has no ``next_minibatch``.
    """
    if source is None or isinstance(source, UserMinibatchSource):
        return source
    if not callable(getattr(source, "next_minibatch", None)):
        raise TypeError(f"a minibatch source must have next_minibatch(minibatch_size_in_samples, num_data_partitions, "
                        f"partition_index) (e.g. dtrain.data.MinibatchSource, or a subclass of "
                        f"dtrain.data.UserMinibatchSource), got {type(source).__name__}")
    return _Declared(source)
