"""Metrics of generated sequences: the model decodes each source in the evaluation passes, and the
metric compares its output with every accepted reference.

A metric with ``decoded_counts(model, batch)`` returns, per name in ``names``, an error sum and what
it is averaged over; :func:`dtrain.session.evaluate.evaluate` calls it in the cross-validation and
test passes (the first name is the metric's value there, the others are reported beside it). In
training, where decoding every minibatch would cost more than the step, the metric's ``__call__``
measures the teacher-forced outputs instead.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch

from dtrain.checks import whole_number
from dtrain.data.streams import Sequences, StreamReference
from dtrain.session.evaluate import wrong_steps

__all__ = ["DecodingErrors", "GreedyDecodingErrors", "edit_distance"]


def edit_distance(hypothesis: list[int] | tuple[int, ...], reference: list[int] | tuple[int, ...]) -> int:
    """Levenshtein distance: the fewest insertions, deletions and substitutions turning one into the other."""
    previous = list(range(len(reference) + 1))
    for i, token in enumerate(hypothesis, 1):
        current = [i]
        for j, wanted in enumerate(reference, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (token != wanted)))
        previous = current
    return previous[-1]


class DecodingErrors:
    """Word error rate (``wer``: sequences whose decoded output matches no reference) and token error
    rate (``per``: edit distance to the closest reference over that reference's tokens, summed over
    sequences and divided by the summed reference lengths), from ``model.greedy_decode(source)``, or
    ``model.beam_decode(source, beam_size)`` when ``beam_size`` > 1.

    Args:
        source: the stream (or reference) the model decodes from, e.g. ``graphemes``.
        references: source ids (a tuple) -> every accepted output (tuples of ids); a word with several
            pronunciations is right if it matches any. ``None``: the target itself is the one reference.
        token_name: the name of the token error rate (``per`` for phonemes).
        max_steps: the longest output the decoder may produce (default: the model's limit).
        beam_size: hypotheses the decoder's beam search keeps; 1 decodes greedily.
        end: the id that ends a target sequence (``</s>``), left out of the reference when the target is it.

    In training (``__call__``) the value is the share of sequences with a wrong step under teacher
    forcing: what a decoder would get if every earlier step were right.
    """

    percent = True
    per = "sequence"

    def __init__(self, source: str, references: Mapping | None = None, name: str = "wer", token_name: str = "per",
                 max_steps: int | None = None, end: int | None = None, beam_size: int = 1) -> None:
        whole_number(f"metric {name}: beam_size", beam_size, 1, unit="hypotheses")
        self.source = StreamReference.parse(source) if isinstance(source, str) else source
        self.references = None if references is None else {tuple(k): [tuple(r) for r in v]
                                                           for k, v in references.items()}
        self.name, self.names = name, (name, token_name)
        self.max_steps, self.end, self.beam_size = max_steps, end, beam_size

    def __call__(self, output: torch.Tensor, target: Sequences) -> torch.Tensor:
        return wrong_steps(output, target).any(dim=1).sum()

    def decoded_counts(self, model: torch.nn.Module, batch, target: Sequences) -> torch.Tensor:
        """``[[wrong sequences, sequences], [token edits, reference tokens]]`` (float64) for one minibatch."""
        source = self.source.resolve(batch[self.source.name])
        outputs = self._decode(model, source)
        counts = torch.zeros(2, 2, dtype=torch.float64)
        for index, output in enumerate(outputs):
            references = self._references_of(source, target, index)
            distances = [edit_distance(output, reference) for reference in references]
            best = min(range(len(references)), key=lambda k: (distances[k] / max(len(references[k]), 1),
                                                             distances[k]))
            counts[0, 0] += float(distances[best] > 0)
            counts[0, 1] += 1
            counts[1, 0] += distances[best]
            counts[1, 1] += len(references[best])
        return counts

    def _decode(self, model: torch.nn.Module, source: Sequences) -> list[list[int]]:
        method = "greedy_decode" if self.beam_size == 1 else "beam_decode"
        decode = getattr(model, method, None)
        if decode is None:
            raise ValueError(f"metric {self.name}: the model {type(model).__name__} has no {method}(source); "
                             f"a decoding metric with beam_size={self.beam_size} needs one "
                             f"(see dtrain.models.Seq2SeqTransformer)")
        steps = {} if self.max_steps is None else {"max_steps": self.max_steps}
        return decode(source, **steps) if self.beam_size == 1 else decode(source, self.beam_size, **steps)

    def _references_of(self, source: Sequences, target: Sequences, index: int) -> list[tuple[int, ...]]:
        if self.references is not None:
            key = tuple(source.data[index, :int(source.lengths[index])].tolist())
            if key not in self.references:
                raise ValueError(f"metric {self.name}: a source sequence {key} has no reference; the metric's "
                                 f"references come from another split or data set than the evaluated one")
            return self.references[key]
        reference = target.data[index, :int(target.lengths[index])].tolist()
        if self.end is not None and self.end in reference:
            reference = reference[:reference.index(self.end)]
        return [tuple(reference)]

    def __repr__(self) -> str:
        return f"DecodingErrors(source={str(self.source)!r}, names={self.names}, beam_size={self.beam_size})"


GreedyDecodingErrors = DecodingErrors  # the name configs written before beam search use
