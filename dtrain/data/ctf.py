"""CNTK Text Format (CTF) deserializer: ``[seqId] |name v v ... |sparse i:v ... |# comment``.

Format (``docs/semantics.md#data-formats``, CNTK ``articles/BrainScript-CNTKTextFormat-Reader.md``):
  * an optional leading sequence id; consecutive lines with the same id form one sequence, and a
    line without an id is a sequence of its own;
  * ``|name`` starts an input's values: dense ``v v ...`` (exactly ``dim`` numbers) or sparse
    ``i:v ...`` (0-based indices below ``dim``); each input at most once per line;
  * ``|#`` starts a comment, which runs to the next ``|`` or the end of the line.

Two ways of reading, chosen by the stream specs:

* **Without sequences** (no spec says ``sequence: true``): one sample per sequence, served as the
  two streams ``features`` (float32) and ``labels`` (int64 class ids) of an
  :class:`~dtrain.data.arrays.ArrayDeserializer`; an input given on several lines of one sequence
  is an error.
* **With sequences** (some spec says ``sequence: true``), as CNTK's reader reads them: a
  :class:`~dtrain.data.deserializer.StreamDeserializer` with one stream per spec, under the spec's
  name. A sequence stream has one step per line of the sequence on which its input appears, so the
  streams of one sequence may differ in length (graphemes and their phonemes); a stream that is not
  a sequence holds one value per sequence (the class of a sequence). A sample is one step of the
  defining stream (``docs/data.md#samples-are-steps``).

Values are float32 vectors of the spec's ``shape`` (sparse inputs made dense), or with ``ids: true``
int64 ids: a sparse input whose every value is one ``i:1`` entry (a token, a class), which an
embedding or a cross-entropy takes directly. Everything is parsed in one pass into memory at
construction; every error is one line naming ``file:line`` and what was expected.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import numpy as np
import torch

from dtrain.data._checks import check_bool, check_int
from dtrain.data.arrays import ArrayDeserializer
from dtrain.data.errors import DataError
from dtrain.data.stream_arrays import StreamArrays
from dtrain.data.streams import Sequences, StreamInfo

__all__ = ["CTFDeserializer"]

_FORMATS = ("dense", "sparse")
_SPEC_KEYS = ("dim", "format", "shape", "sequence", "field", "ids")


def _check_streams(streams: Mapping) -> dict[str, dict]:
    """The stream specs, checked and completed with their defaults (one line per error)."""
    if not isinstance(streams, Mapping) or not streams:
        raise TypeError(f"streams must be a non-empty mapping name -> {{dim, format}}, got {streams!r}")
    checked: dict[str, dict] = {}
    fields: dict[str, str] = {}
    for name, spec in streams.items():
        if not isinstance(spec, Mapping) or "dim" not in spec:
            raise ValueError(f"streams[{name!r}] must be a mapping with 'dim' (and 'format'), got {spec!r}")
        unknown = set(spec) - set(_SPEC_KEYS)
        if unknown:
            raise ValueError(f"streams[{name!r}] has unknown keys {sorted(unknown)}; expected {', '.join(_SPEC_KEYS)}")
        dim = check_int(f"streams[{name!r}]['dim']", spec["dim"], 1)
        fmt = spec.get("format", "dense")
        if fmt not in _FORMATS:
            raise ValueError(f"streams[{name!r}]['format'] must be 'dense' or 'sparse', got {fmt!r}")
        sequence = check_bool(f"streams[{name!r}]['sequence']", spec.get("sequence", False))
        ids = check_bool(f"streams[{name!r}]['ids']", spec.get("ids", False))
        field = spec.get("field", str(name))
        if not isinstance(field, str) or not field or any(c.isspace() or c == "|" for c in field):
            raise ValueError(f"streams[{name!r}]['field'] must be the input's name in the file (one token without "
                             f"'|', e.g. 'S0'), got {field!r}")
        if field in fields:
            raise ValueError(f"streams {fields[field]!r} and {name!r} both read the input {field!r}; give each "
                             f"stream its own field")
        fields[field] = str(name)
        if ids:
            if fmt != "sparse":
                raise ValueError(f"streams[{name!r}] has ids: true, which reads one sparse 'index:1' entry per value; "
                                 f"add format: sparse")
            if spec.get("shape") is not None:
                raise ValueError(f"streams[{name!r}] has ids: true, whose values are single int64 ids (shape []); "
                                 f"leave out shape")
        shape = tuple(spec.get("shape") or (dim,))
        if int(np.prod(shape)) != dim:
            raise ValueError(f"streams[{name!r}]['shape'] {list(shape)} must hold dim={dim} values")
        checked[str(name)] = {"dim": dim, "format": fmt, "shape": shape, "sequence": sequence, "field": field,
                              "ids": ids}
    return checked


def _read_lines(path: str) -> list[str]:
    try:
        with open(path, encoding="utf-8") as file:
            return file.read().splitlines()
    except FileNotFoundError:
        raise DataError(f"CTF file {path} not found; expected '[seqId] |name v v ...' lines") from None
    except (OSError, UnicodeDecodeError) as error:
        raise DataError(f"CTF file {path} could not be read ({error}); expected UTF-8 text") from error


class CTFDeserializer(ArrayDeserializer):
    """A CTF file as a deserializer, without sequences (features and labels) or with them (named streams).

    **Without sequences** (no spec has ``sequence: true``): float32 features and int64 class labels,
    one per sequence, served (``get``, ``num_samples``, ``mean_image``) as an
    :class:`ArrayDeserializer` over those arrays.

    **With sequences** (any spec has ``sequence: true``): a stream deserializer (``streams`` name ->
    :class:`~dtrain.data.streams.StreamInfo`, ``num_sequences``, ``sequence_lengths``, ``read``,
    ``defining_stream``) over the streams as named in ``streams``. A sequence stream has one step per
    line of the sequence on which its input appears (at least one); a non-sequence stream exactly
    one value per sequence. Sequence streams are read as :class:`~dtrain.data.streams.Sequences`.

    Args:
        path: the CTF text file.
        streams: ``{name: spec}`` for every input read (inputs in the file but not listed are
            ignored). Spec keys: ``dim`` (values per line, or the vocabulary of ``ids``),
            ``format`` (``dense`` default, or ``sparse``: made dense), ``shape`` (optional, reshapes
            a float value, e.g. ``[1, 28, 28]``), ``sequence`` (bool, default false: one step per
            line), ``field`` (the input's name in the file when it is not ``name``, CNTK's
            ``StreamDef(field='S0')``) and ``ids`` (bool, default false: a sparse input of one
            ``i:1`` entry per value, served as the int64 id ``i`` with ``num_classes=dim``).
        features: without sequences, the stream used as features (with sequences: not used).
        labels: without sequences, the stream used as labels: one-hot (dense, exactly one 1, rest 0)
            or one sparse ``index:1`` entry; its ``dim`` is ``num_classes`` (with sequences: not used).
        defining_stream: with sequences, the stream whose steps count samples when the source is not
            told; default the first sequence stream of ``streams`` (CNTK counts a sequence's lines,
            the same whenever that input is on every line of a sequence).

    Attributes:
        specs: the checked stream specs, with their defaults filled in.
        streams: without sequences, ``specs`` (as before sequences were read); with them, the
            ``StreamInfo`` of each stream.

    Raises:
        TypeError / ValueError: bad ``streams`` (an unknown key, a bad value, two streams of one
            field), unknown ``features``/``labels``, ``features``/``labels`` given with sequence
            streams, or ``defining_stream`` without them.
        DataError: the file is missing or malformed (a wrong value count, an index out of range, an
            input twice in a line, a non-sequence input twice in a sequence, a missing input or an
            empty sequence, a label that is not one-hot, an ``ids`` value that is not one ``i:1``);
            the message names the file and line.
    """

    def __init__(self, path: str | os.PathLike, streams: Mapping, features: str = "features",
                 labels: str = "labels", defining_stream: str | None = None) -> None:
        self.specs = _check_streams(streams)
        self._sequence_mode = any(spec["sequence"] for spec in self.specs.values())
        self.path = os.fspath(path)
        if self._sequence_mode:
            self._init_streams(features, labels, defining_stream)
            return
        self.streams = self.specs
        for role, name in (("features", features), ("labels", labels)):
            if name not in self.streams:
                raise ValueError(f"{role}={name!r} is not in streams {sorted(self.streams)}; add it or rename")
        if defining_stream is not None:
            raise ValueError(f"defining_stream={defining_stream!r} counts the steps of a sequence stream, and no "
                             f"stream here has sequence: true; leave it out")
        if self.specs[features]["ids"]:
            raise ValueError(f"streams[{features!r}] has ids: true, but the features of data without sequences are "
                             f"float32 values; leave ids out (or declare the sequence streams with sequence: true to "
                             f"read named streams)")
        self._features_name, self._labels_name = features, labels
        values = self._parse()
        super().__init__(self._stack(features, values[features]), self._class_ids(values[labels]),
                         num_classes=self.streams[labels]["dim"])

    def _init_streams(self, features: str, labels: str, defining_stream: str | None) -> None:
        if features != "features" or labels != "labels":
            raise ValueError(f"features={features!r} / labels={labels!r} pick the two streams of data without "
                             f"sequences; with sequence streams every stream is served by its own name "
                             f"({', '.join(self.specs)}), so leave them out")
        if defining_stream is None:
            defining_stream = next(name for name, spec in self.specs.items() if spec["sequence"])
        values = self._parse()
        arrays: dict[str, object] = {}
        for name, spec in self.specs.items():
            stacked = self._stack(name, values[name])
            arrays[name] = np.split(stacked, np.cumsum(self._lengths[name])[:-1]) if spec["sequence"] else stacked
        self._arrays = StreamArrays(arrays, num_classes={name: spec["dim"] for name, spec in self.specs.items()
                                                         if spec["ids"]}, defining_stream=defining_stream)
        self.streams: dict[str, StreamInfo] = self._arrays.streams
        self.num_sequences = self._arrays.num_sequences
        self.defining_stream = self._arrays.defining_stream

    # -- the stream protocol (with sequences) --------------------------------------------------------
    def sequence_lengths(self, name: str) -> np.ndarray:
        """int64 ``[num_sequences]``: the steps of every sequence of the sequence stream ``name``.

        Raises:
            TypeError: this file is read without sequences.
            KeyError: ``name`` is not a sequence stream.
        """
        self._require_streams("sequence_lengths")
        return self._arrays.sequence_lengths(name)

    def read(self, indices: np.ndarray) -> dict[str, torch.Tensor | Sequences]:
        """The streams of sequences ``indices``: a tensor ``[n, ...]`` per non-sequence stream and
        :class:`Sequences` per sequence stream.

        Raises:
            TypeError: this file is read without sequences (use ``get``).
        """
        self._require_streams("read")
        return self._arrays.read(indices)

    def _require_streams(self, what: str) -> None:
        if not self._sequence_mode:
            raise TypeError(f"CTFDeserializer.{what} reads sequence streams; {self.path} is read without sequences "
                            f"(no stream has sequence: true), use get()")

    # -- the two-stream protocol (without sequences) ---------------------------------------------------
    def _require_two_streams(self, what: str, error: type[Exception] = TypeError) -> None:
        if self._sequence_mode:
            raise error(f"CTFDeserializer.{what} is for data without sequences; {self.path} is read as the named "
                        f"streams {', '.join(self.specs)} (num_sequences, read)")

    @property
    def num_samples(self) -> int:
        """Number of samples (one sweep), without sequences."""
        self._require_two_streams("num_samples", AttributeError)
        return ArrayDeserializer.num_samples.fget(self)

    @property
    def feature_shape(self) -> tuple[int, ...]:
        """Shape of one sample's features, without sequences."""
        self._require_two_streams("feature_shape", AttributeError)
        return ArrayDeserializer.feature_shape.fget(self)

    def get(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Features and int64 labels of ``indices``, without sequences (TypeError with them: use ``read``)."""
        self._require_two_streams("get")
        return super().get(indices)

    def take(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`get` for an int64 index tensor, without sequences (TypeError with them)."""
        self._require_two_streams("take")
        return super().take(index)

    def mean_image(self) -> torch.Tensor:
        """float32 per-element mean of the features, without sequences (TypeError with them)."""
        self._require_two_streams("mean_image")
        return super().mean_image()

    # -- parsing ----------------------------------------------------------------------------------
    def _input(self, name: str) -> str:
        """How messages name the input of stream ``name``: its field, and the stream when they differ."""
        field = self.specs[name]["field"]
        return repr(field) if field == name else f"{field!r} (stream {name!r})"

    def _parse(self) -> dict[str, list]:
        """One pass over the file: each stream's values in file order (ids or float32 vectors), and in
        ``self._lengths`` the steps of every sequence of each sequence stream."""
        lines = _read_lines(self.path)
        by_field = {spec["field"]: name for name, spec in self.specs.items()}
        values: dict[str, list] = {name: [] for name in self.specs}
        self._lengths: dict[str, list[int]] = {name: [] for name, spec in self.specs.items() if spec["sequence"]}
        self._value_lines: dict[str, list[str]] = {name: [] for name in self.specs}  # "file:line" of each value
        seen: dict[str, int] = {}  # stream -> first line that gave it, in the current sequence
        steps: dict[str, int] = {}  # sequence stream -> its steps in the current sequence
        current_id: str | None = None
        first_line, last_line, started = 0, 0, False

        def close_sequence() -> None:
            missing = [name for name in self.specs if name not in seen]
            if missing and not self._sequence_mode:
                raise DataError(f"{self.path}:{first_line}: sequence {current_id!r} has no value for input(s) "
                                f"{missing}; every sample needs all of {sorted(self.streams)}")
            if missing:
                lines_text = f"line {first_line}" if first_line == last_line else f"lines {first_line}-{last_line}"
                raise DataError(f"{self.path}:{first_line}: sequence {current_id!r} ({lines_text}) has no value for "
                                f"{', '.join(self._input(name) for name in missing)}; every sequence needs at least "
                                f"one step of each sequence stream and one value of each other stream (an empty "
                                f"sequence cannot be read)")
            for name, counts in self._lengths.items():
                counts.append(steps[name])

        for line_number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            where = f"{self.path}:{line_number}"
            head, bar, rest = line.partition("|")
            if not bar:
                raise DataError(f"{where}: no '|name' input in {line.strip()[:60]!r}; expected '[seqId] |name v v ...'")
            sequence_id = head.strip() or None
            if sequence_id is not None and len(sequence_id.split()) > 1:
                raise DataError(f"{where}: sequence id {sequence_id!r} must be one token before the first '|'")
            if not started or sequence_id is None or sequence_id != current_id:
                if started:
                    close_sequence()
                seen, steps = {}, dict.fromkeys(self._lengths, 0)
                current_id, first_line, started = sequence_id, line_number, True
            last_line = line_number
            seen_in_line: set[str] = set()
            for segment in ("|" + rest).split("|")[1:]:
                if segment.startswith("#"):
                    continue
                tokens = segment.split()
                if not tokens:
                    raise DataError(f"{where}: empty '|' with no input name; expected '|name v v ...'")
                field, tokens = tokens[0], tokens[1:]
                if field in seen_in_line:
                    raise DataError(f"{where}: input {field!r} appears twice in one line; CTF allows each input once per line")
                seen_in_line.add(field)
                name = by_field.get(field)
                if name is None:
                    continue
                spec = self.specs[name]
                if name in seen and not spec["sequence"]:
                    self._raise_repeated(name, where, seen[name])
                seen.setdefault(name, line_number)
                if spec["sequence"]:
                    steps[name] += 1
                values[name].append(self._value(name, tokens, where))
                self._value_lines[name].append(where)
        if started:
            close_sequence()
        if not started or not any(values.values()):
            raise DataError(f"CTF file {self.path} has no samples; expected '[seqId] |name v v ...' lines")
        return values

    def _raise_repeated(self, name: str, where: str, first: int) -> None:
        field = self.specs[name]["field"]
        if not self._sequence_mode:
            raise DataError(f"{where}: input {field!r} already has a value in this sequence (line {first}); this "
                            f"reader takes one sample per sequence unless told otherwise: declare the inputs that "
                            f"are sequences with sequence: true in their stream spec (or give each line its own "
                            f"sequence id)")
        raise DataError(f"{where}: input {self._input(name)} already has a value in this sequence (line {first}); "
                        f"it is not a sequence stream, so it takes one value per sequence (declare it with "
                        f"sequence: true to read one step per line)")

    def _value(self, name: str, tokens: list[str], where: str) -> np.ndarray | int:
        """One line's value of stream ``name``: a float32 vector of ``dim``, or an int id for ``ids``."""
        spec = self.specs[name]
        if spec["ids"]:
            if len(tokens) != 1:
                raise DataError(f"{where}: ids input {self._input(name)} has {len(tokens)} entries; expected exactly "
                                f"one 'index:1' per line")
            index, value = self._sparse_entry(name, tokens[0], where)
            if value != 1.0:
                raise DataError(f"{where}: ids input {self._input(name)} has {tokens[0]!r}; expected 'index:1' (an id "
                                f"has the value 1)")
            return index
        dense = np.zeros(spec["dim"], dtype=np.float32)
        if spec["format"] == "dense":
            if len(tokens) != spec["dim"]:
                raise DataError(f"{where}: input {self._input(name)} has {len(tokens)} values; expected "
                                f"dim={spec['dim']} dense values (or declare format: sparse)")
            try:
                dense[:] = [float(token) for token in tokens]
            except ValueError:
                raise DataError(f"{where}: input {self._input(name)} has a value that is not a number in "
                                f"{' '.join(tokens)[:60]!r}") from None
        else:
            for token in tokens:
                index, value = self._sparse_entry(name, token, where)
                dense[index] = value
        return dense

    def _sparse_entry(self, name: str, token: str, where: str) -> tuple[int, float]:
        index_text, colon, value_text = token.partition(":")
        try:
            index, value = int(index_text), float(value_text)
        except ValueError:
            index = None
        if not colon or index is None:
            raise DataError(f"{where}: sparse input {self._input(name)} has {token!r}; expected 'index:value'")
        dim = self.specs[name]["dim"]
        if not 0 <= index < dim:
            raise DataError(f"{where}: sparse input {self._input(name)} index {index} is outside [0, {dim})")
        return index, value

    def _stack(self, name: str, values: list) -> np.ndarray:
        """A stream's values as one array: int64 ids ``[n]`` or float32 ``[n, *shape]``."""
        spec = self.specs[name]
        if spec["ids"]:
            return np.asarray(values, dtype=np.int64)
        return np.stack(values).reshape(len(values), *spec["shape"])

    def _class_ids(self, rows: list) -> np.ndarray:
        """Without sequences: the labels stream's class ids (ids as read, or checked one-hot rows)."""
        if self.specs[self._labels_name]["ids"]:
            return np.asarray(rows, dtype=np.int64)
        return np.asarray([self._class(row, where) for row, where in
                           zip(rows, self._value_lines[self._labels_name])], dtype=np.int64)

    def _class(self, row: np.ndarray, where: str) -> int:
        nonzero = np.flatnonzero(row)
        if len(nonzero) != 1 or row[nonzero[0]] != 1.0:
            raise DataError(f"{where}: labels {self._labels_name!r} must be one-hot (a single 1) or one sparse "
                            f"'index:1'; got {len(nonzero)} non-zero value(s)")
        return int(nonzero[0])
