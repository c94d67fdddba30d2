"""Checks of the streams a session uses against its data and its model, made before training:
every stream named exists, samples are counted in the target's steps, no sequence is longer
than the model's context, and the first minibatch's ids lie within their vocabularies.

Each problem is one line naming the setting (``session.inputs[0]``, ``session.target``) or the
stream, and what was expected (``docs/data.md#checks``). Ids past the model's size in data that
declares no ``num_classes`` are found where torch's embedding or loss fails on them (``ids_past_the_model``).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np
import torch

from dtrain.data.errors import DataError
from dtrain.data.streams import Sequences
from dtrain.data.user_source import UserMinibatchSource
from dtrain.session.binding import StreamBinding

__all__ = ["bind_sources", "check_loss_takes_target", "check_model_against_data", "check_target_steps",
           "first_minibatch_check", "ids_past_the_model"]


def bind_sources(binding: StreamBinding, sources: Mapping[str, UserMinibatchSource | None]) -> str:
    """Checks ``binding`` against every source's streams, and counts samples in the target's steps in
    each source with sequences that names no defining stream of its own (``use_defining_stream``).

    ``sources``: ``what -> source or None`` (``what`` names it in messages, e.g. "the training data";
    the first is the training source). A source that declares no ``streams`` (your own) is not checked.
    Returns the start-up note on how the training source counts samples ("" without sequences).

    Raises:
        ValueError: a stream that does not exist (the message lists those that do), a slice of a stream
            without steps, a slice that every sequence is too short for (``text[1:]`` of one-step sequences),
            or sequence data whose samples cannot be counted (several sequence streams and a
            whole-minibatch target).
    """
    for what, source in sources.items():
        streams = source.streams if source is not None else None
        if not streams:
            continue
        binding.check(streams, what)
        for key, reference in binding.references:  # a step slice that every sequence is too short for
            if not (reference.is_view and streams[reference.name].is_sequence):
                continue
            lengths = source.sequence_lengths(reference.name)
            if lengths is not None:
                reference.check_keeps_steps(lengths, f"session.{key}", what,
                                            "the model would read no step" if key != "target" else
                                            "the loss would have no target")
        if source.has_sequences and not source.defining_stream_is_explicit and binding.target is not None:
            source.use_defining_stream(binding.target.text, "session.target")
        if source.has_sequences:
            source.samples_per_sweep  # noqa: B018 - raises now when the samples cannot be counted
    train = next(iter(sources.values()), None)
    if train is None or not train.has_sequences:
        return ""
    note = (f"samples are steps of {train.defining_stream} ({train.sequences_per_sweep:,} sequences, "
            f"{train.samples_per_sweep:,} samples per sweep)")
    if binding.target is not None and binding.target.text != train.defining_stream:
        note += (f"; the loss averages over {binding.target.text}, so with several ranks each is weighted by its "
                 f"steps of {train.defining_stream}, not by the loss's (set defining_stream to the target for "
                 f"an exact data-parallel mean)")
    return note


def check_model_against_data(model: torch.nn.Module, binding: StreamBinding,
                             sources: Mapping[str, UserMinibatchSource | None]) -> None:
    """Refuses sequences longer than the model's ``context_length`` and input vocabularies larger than
    its ``vocab_size``, where the model declares them (dtrain's language models do).

    Raises:
        ValueError: one line naming the stream, the longest sequence (or the vocabulary) and the model's limit.
    """
    context = getattr(model, "context_length", None)
    vocabulary = getattr(model, "vocab_size", None)
    for what, source in sources.items():
        streams = source.streams if source is not None else {}
        for reference in binding.input_references:
            info = streams.get(reference.name)
            lengths = source.sequence_lengths(reference.text) if info is not None and info.is_sequence else None
            if context is not None and lengths is not None:
                longest = int(np.argmax(lengths))
                if int(lengths[longest]) > int(context):
                    raise ValueError(
                        f"session.inputs={reference.text!r}: sequence {longest} of {what} has {int(lengths[longest])} "
                        f"steps but the model's context_length is {int(context)}; expected sequences of at most "
                        f"{int(context)} steps (cut the data shorter, or give the model a longer context)")
            if vocabulary is not None and info is not None and info.num_classes is not None \
                    and not info.dtype.is_floating_point and info.num_classes > int(vocabulary):
                raise ValueError(
                    f"session.inputs={reference.text!r}: stream {reference.name!r} of {what} has a vocabulary of "
                    f"{info.num_classes} ids but the model's vocab_size is {int(vocabulary)}; expected a model with "
                    f"vocab_size >= {info.num_classes}")


def first_minibatch_check(source: UserMinibatchSource) -> Callable | None:
    """A check of the first training minibatch: every integer stream with a declared ``num_classes`` holds
    ids in ``[0, num_classes)`` (a token outside the vocabulary fails here, with its stream named, instead
    of deep inside an embedding). None when the source declares no such stream."""
    streams = source.streams
    bounded = {name: info.num_classes for name, info in streams.items()
               if info.num_classes is not None and not info.dtype.is_floating_point}
    if not bounded:
        return None

    def check(minibatch) -> None:
        for name, classes in bounded.items():
            value = minibatch.streams.get(name)
            if value is None:
                continue
            values = value.data[value.mask] if isinstance(value, Sequences) else value
            if values.numel() == 0:
                continue
            low, high = int(values.min()), int(values.max())
            if low < 0 or high >= classes:
                bad = low if low < 0 else high
                raise DataError(f"stream {name!r} has the id {bad} in the first minibatch, outside its vocabulary "
                                f"[0, {classes}); expected ids below num_classes={classes} (the data and the vocabulary "
                                f"it was encoded with disagree)")
    return check


def check_loss_takes_target(loss, metric, binding: StreamBinding, source: UserMinibatchSource) -> None:
    """Refuses one of torch's own losses (or metrics) with a sequence target: they take tensors, and
    would fail at the first step with a message about a ``Sequences`` argument; and a loss or metric
    of class ids with a target of one float per sample (a regression target, such as a CTF numeric
    label column), which would fail at the first step or measure nothing.

    Raises:
        ValueError: naming the loss, the target and the loss to use instead.
    """
    streams = source.streams
    if binding.target is None or binding.target.name not in streams:
        return
    if not streams[binding.target.name].is_sequence:
        _check_class_ids_target(loss, metric, binding, streams[binding.target.name])
        return
    for what, function in (("loss", loss), ("metric", metric)):
        module = getattr(function, "__module__", None) or type(function).__module__
        if isinstance(function, torch.nn.modules.loss._Loss) or module == "torch.nn.functional":
            name = type(function).__name__ if isinstance(function, torch.nn.Module) else function.__name__
            raise ValueError(
                f"{what} {name}: torch's {what}es take tensors, but the target {binding.target.text!r} is a sequence "
                f"stream (dtrain.data.Sequences: padded data and lengths); use loss=sequence_cross_entropy "
                f"(dtrain.session.SequenceCrossEntropy) or a {what} of your own that reads target.data and target.mask")


def _takes_class_ids(function) -> bool:
    """Whether a loss or metric reads its target as class ids: torch's cross-entropy and NLL, and what declares
    ``takes_class_ids = True`` (dtrain's classification and top-k errors)."""
    return (isinstance(function, (torch.nn.CrossEntropyLoss, torch.nn.NLLLoss))
            or function in (torch.nn.functional.cross_entropy, torch.nn.functional.nll_loss)
            or getattr(function, "takes_class_ids", False) is True)  # dtrain's own declare it


def _check_class_ids_target(loss, metric, binding: StreamBinding, info) -> None:
    """A target of one float number per sample is a regression target, never class ids (a float target of
    several numbers may be class probabilities, which torch's cross-entropy takes)."""
    if not info.dtype.is_floating_point or tuple(info.shape) not in ((), (1,)) or binding.target.part is not None:
        return
    for what, function in (("loss", loss), ("metric", metric)):
        if _takes_class_ids(function):
            name = type(function).__name__ if not hasattr(function, "__name__") else function.__name__
            raise ValueError(
                f"{what} {name} takes class ids, but the target {binding.target.text!r} holds one {info.dtype} "
                f"number per sample (a regression target, such as a CTF numeric label column); use loss=mse and "
                f"metric=mean_abs_error for regression, or give the labels as class ids (integers, one-hot, or in "
                f"CTF one sparse 'index:1' entry)")


def ids_past_the_model(model: torch.nn.Module, binding: StreamBinding, minibatch, output=None) -> str | None:
    """Why the forward or the loss raised IndexError on ``minibatch``, when its ids do not fit the model: a
    target id at or past the model's outputs (``output``'s last dimension), or an input id at or past its
    token embedding (``model.vocab_size``, else its first ``nn.Embedding``); one line naming the value, the
    stream and the size. ``None`` when the ids fit (the IndexError is the model's own)."""
    embeddings = [module.num_embeddings for module in model.modules() if isinstance(module, torch.nn.Embedding)]
    vocabulary = getattr(model, "vocab_size", None) or (embeddings[0] if embeddings else None)
    checks = [(f"session.inputs={reference.text!r}", reference, vocabulary, "the model's token embedding takes")
              for reference in binding.input_references]
    if binding.target is not None and isinstance(output, torch.Tensor) and output.dim():
        checks.append((f"session.target={binding.target.text!r}", binding.target, int(output.shape[-1]),
                       "the model has"))
    for setting, reference, size, model_has in checks:
        value = minibatch.streams.get(reference.name)
        if size is None or value is None:
            continue
        value = reference.resolve(value)
        ids = value.data[value.mask] if isinstance(value, Sequences) else value
        if not isinstance(ids, torch.Tensor) or ids.is_floating_point() or ids.dtype == torch.bool or not ids.numel():
            continue
        low, high = int(ids.min()), int(ids.max())
        if low >= 0 and high < int(size):
            continue
        bad = low if low < 0 else high
        outputs = "outputs" if model_has == "the model has" else "ids"
        return (f"{setting}: stream {reference.name!r} holds the id {bad}, but {model_has} {int(size)} {outputs}; "
                f"expected ids in [0, {int(size)}) (declare the stream's num_classes to have every read checked, or "
                f"give the model {max(high + 1, int(size))} {outputs})")
    return None


def check_target_steps(output, target: Sequences, minibatch, binding: StreamBinding) -> None:
    """Refuses a per-step target that does not cover the model's per-step output: ``output`` ``[n, T', ...]``
    longer than the target's ``T`` steps, or, where inputs with ``T'`` steps fed the model, a sequence whose
    target is shorter than each of those inputs (its last outputs would silently go untrained).

    Raises:
        DataError: one line naming the target, the steps and the input it falls short of.
    """
    if not isinstance(output, torch.Tensor) or output.dim() < 3:
        return
    steps = int(output.shape[1])
    if steps > int(target.data.shape[1]):
        raise DataError(
            f"session.target={binding.target.text!r}: the model outputs {steps} steps per sequence but the target has "
            f"at most {int(target.data.shape[1])}; expected a target step for every output step (a step slice that "
            f"matches the inputs', e.g. inputs text[:-1] with target text[1:])")
    shorter = None
    wanted = target.lengths.numpy()
    for reference in binding.input_references:
        value = minibatch.streams.get(reference.name)
        if not isinstance(value, Sequences) or reference.part is not None:
            continue
        lengths = reference.step_counts(value.lengths.numpy())  # a slice's, without cutting its data
        width = (int(lengths.max()) if len(lengths) else 0) if reference.is_view else int(value.data.shape[1])
        if width != steps:
            continue  # not an input whose steps the output follows
        if np.array_equal(lengths, wanted):
            return  # the target has a step for every step of this input
        if shorter is None:
            shorter = (reference, lengths)
    if shorter is not None:
        reference, lengths = shorter
        row = int(np.flatnonzero(wanted != lengths)[0])
        raise DataError(
            f"session.target={binding.target.text!r}: sequence {row} of the minibatch has {int(wanted[row])} "
            f"target steps but {int(lengths[row])} steps of the input {reference.text!r}; expected a target step for "
            f"every input step (a target stream of the inputs' lengths, or a step slice that matches theirs)")


def check_evaluations_end(*, cv_config, test_config, sources: Mapping[str, UserMinibatchSource | None]) -> None:
    """An evaluation reads its source to the end (or to its ``max_samples``): one over a source that repeats
    forever would never end.

    Raises:
        ValueError: such a source without ``max_samples`` in its config (one line naming it and the fixes).
    """
    for config, what, name in ((cv_config, "the cross-validation data", "CrossValidationConfig"),
                               (test_config, "the test data", "TestConfig")):
        source = sources.get(what)
        if config is not None and source is not None and source.repeats_forever and config.max_samples is None:
            raise ValueError(f"{what} repeats forever (its source has neither max_samples nor max_sweeps), so its "
                             f"evaluation, which reads to the end, would never end; give the source max_sweeps=1, or "
                             f"{name}(max_samples=...)")
