"""Which streams of a minibatch feed the model's ``forward``, and which one is the loss's and the
metric's target (CNTK's ``model_inputs_to_streams``; ``docs/data.md#streams-to-the-model``).

``inputs`` is a list of stream references passed positionally (``[features]``, the default), a
mapping ``argument name -> reference`` passed by keyword (``{src: graphemes, tgt: "phonemes[:-1]"}``),
or ``minibatch`` (the model takes the whole :class:`~dtrain.data.Minibatch`). ``target`` is one
reference (``labels``, the default; ``text[1:]``) or ``minibatch``. A reference is a stream name,
optionally with a step slice and ``.data``, ``.lengths`` or ``.mask`` (``dtrain.data.streams``).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from dtrain.data.minibatch import Minibatch
from dtrain.data.streams import WHOLE_MINIBATCH, Sequences, StreamReference

__all__ = ["StreamBinding", "count_steps"]


def count_steps(target) -> tuple[int, int]:
    """``(steps, sequences)`` of a target: a tensor counts its first dimension as both (one step per
    sample), Sequences its real steps and its sequences, a whole minibatch its own counts."""
    if isinstance(target, torch.Tensor):
        count = int(target.shape[0]) if target.dim() else 1
        return count, count
    if isinstance(target, Sequences):
        return target.num_steps, target.num_sequences
    if isinstance(target, Minibatch):
        return target.num_samples, target.num_sequences
    raise TypeError(f"a target is a tensor, Sequences or a Minibatch, got {type(target).__name__}")


class StreamBinding:
    """The streams a model, loss and metric take, parsed once; reads them from each minibatch.

    Args:
        inputs: references passed to ``forward`` positionally (a list, or one string), by keyword
            (a mapping), or ``"minibatch"`` for the whole minibatch.
        target: the reference the loss and the metric take as their second argument, or ``"minibatch"``.

    Raises:
        ValueError: a reference that does not parse, or an empty ``inputs``.
        TypeError: ``inputs`` or ``target`` of the wrong type.
    """

    def __init__(self, inputs: str | Sequence[str] | Mapping[str, str] = ("features",), target: str = "labels"):
        self.whole_minibatch_input = inputs == WHOLE_MINIBATCH
        self.positional: list[StreamReference] = []
        self.keyword: dict[str, StreamReference] = {}
        if not self.whole_minibatch_input:
            if isinstance(inputs, str):
                inputs = [inputs]
            if isinstance(inputs, Mapping):
                if not inputs:
                    raise ValueError("session.inputs={}: expected at least one stream for the model")
                self.keyword = {str(key): StreamReference.parse(value, f"session.inputs.{key}") for key, value in inputs.items()}
            elif isinstance(inputs, Sequence):
                if not inputs:
                    raise ValueError("session.inputs=[]: expected at least one stream for the model")
                self.positional = [StreamReference.parse(value, f"session.inputs[{index}]") for index, value in enumerate(inputs)]
            else:
                raise TypeError(f"session.inputs must be a list of streams, a mapping argument -> stream, or "
                                f"{WHOLE_MINIBATCH!r}; got {type(inputs).__name__}")
        self.whole_minibatch_target = target == WHOLE_MINIBATCH
        self.target = None if self.whole_minibatch_target else StreamReference.parse(target, "session.target")
        # the usual case reads two dict entries and nothing else (the training loop's hot path)
        self._plain_single_input = (len(self.positional) == 1 and not self.keyword and not self.positional[0].is_view
                                    and self.positional[0].part is None)
        self._plain_target = self.target is not None and not self.target.is_view and self.target.part is None

    @property
    def references(self) -> list[tuple[str, StreamReference]]:
        """Every reference with the name a message gives it (``inputs[0]``, ``inputs.src``, ``target``)."""
        named = [(f"inputs[{index}]", reference) for index, reference in enumerate(self.positional)]
        named += [(f"inputs.{key}", reference) for key, reference in self.keyword.items()]
        if self.target is not None:
            named.append(("target", self.target))
        return named

    @property
    def input_references(self) -> list[StreamReference]:
        """The references the model's ``forward`` takes (none for a whole-minibatch input)."""
        return [*self.positional, *self.keyword.values()]

    @property
    def is_default(self) -> bool:
        """Whether this is the two-stream default: ``model(features)``, loss and metric against ``labels``."""
        return ([reference.text for reference in self.positional] == ["features"] and not self.keyword
                and self.target is not None and self.target.text == "labels")

    def check(self, streams: Mapping, data: str = "the data") -> None:
        """Raises ValueError when a reference names no stream of ``streams`` (name -> StreamInfo; the
        message names the ``data`` and lists the streams it has) or slices a stream without steps."""
        for what, reference in self.references:
            reference.check_against(streams.get(reference.name), list(streams), f"session.{what}", data)
        if self.target is not None and self.target.part is not None:
            raise ValueError(f"session.target={self.target.text!r}: the loss's target is a stream or a step slice of "
                             f"one, not its {self.target.part}")

    def describe(self) -> str:
        """``model(graphemes, phonemes[:-1]), loss and metric against phonemes[1:]`` for the start-up lines."""
        if self.whole_minibatch_input:
            arguments = WHOLE_MINIBATCH
        else:
            arguments = ", ".join([r.text for r in self.positional] + [f"{k}={r.text}" for k, r in self.keyword.items()])
        target = WHOLE_MINIBATCH if self.target is None else self.target.text
        return f"model({arguments}), loss and metric against {target}"

    # -- reading a minibatch -----------------------------------------------------------------------
    def forward(self, model, minibatch: Minibatch):
        """``model``'s output for ``minibatch`` (its inputs read from their streams)."""
        if self._plain_single_input:
            return model(minibatch.streams[self.positional[0].name])
        if self.whole_minibatch_input:
            return model(minibatch)
        streams = minibatch.streams
        args = [reference.resolve(streams[reference.name]) for reference in self.positional]
        kwargs = {key: reference.resolve(streams[reference.name]) for key, reference in self.keyword.items()}
        return model(*args, **kwargs)

    def target_and_counts(self, minibatch: Minibatch) -> tuple[object, int, int]:
        """``(target, its samples, its sequences)`` in ``minibatch`` (:func:`count_steps` of the target)."""
        if self._plain_target:
            target = minibatch.streams[self.target.name]
            if type(target) is torch.Tensor:  # one value per sequence: the minibatch's own count, no call
                return target, minibatch.num_sequences, minibatch.num_sequences
            return (target, *count_steps(target))
        target = self.target_of(minibatch)
        return (target, *count_steps(target))

    def target_of(self, minibatch: Minibatch):
        """The loss's and the metric's target in ``minibatch``."""
        if self._plain_target:
            return minibatch.streams[self.target.name]
        if self.target is None:
            return minibatch
        return self.target.resolve(minibatch.streams[self.target.name])
