"""CNTK Text Format (CTF) deserializer: ``[seqId] |name v v ... |sparse i:v ... |# comment``.

Format (``docs/semantics.md#data-formats``, CNTK ``articles/BrainScript-CNTKTextFormat-Reader.md``):
  * an optional leading sequence id; consecutive lines with the same id form one sequence, and a
    line without an id is a sequence of its own;
  * ``|name`` starts an input's values: dense ``v v ...`` (exactly ``dim`` numbers) or sparse
    ``i:v ...`` (0-based indices below ``dim``); each input at most once per line;
  * ``|#`` starts a comment, which runs to the next ``|`` or the end of the line.

Two ways of reading, chosen by the stream specs:

* **Features and labels**: no spec says ``sequence: true`` and the specs hold the two streams
  ``features`` and ``labels`` (or the two named by ``features=`` / ``labels=``). One sample per
  sequence, served as the two streams ``features`` (float32) and ``labels`` of an
  :class:`~dtrain.data.arrays.ArrayDeserializer`: int64 class ids of one-hot or ``i:1`` labels, or
  float32 targets of a numeric label column (dense, ``dim: 1``: ``|labels 3.5``); an input given on
  several lines of one sequence is an error.
* **Named streams**, as CNTK's reader reads every file: any other specs (a spec with
  ``sequence: true``, a single stream, inputs of other names, or ``labels=None``). A
  :class:`~dtrain.data.deserializer.StreamDeserializer` with one stream per spec, under the spec's
  name. A sequence stream has one step per line of the sequence on which its input appears, so the
  streams of one sequence may differ in length (graphemes and their phonemes); a stream that is not
  a sequence holds one value per sequence (the class of a sequence). With sequence streams a sample
  is one step of the defining stream (``docs/data.md#samples-are-steps``), without them a sequence.

Values are float32 vectors of the spec's ``shape`` (CNTK's dense value: a numeric column is a
vector of one number), or with ``ids: true`` int64 ids: a sparse input whose every value is one
``i:1`` entry (a token, a class), which an embedding or a cross-entropy takes directly. A sparse
input is made dense unless its spec says ``layout: sparse``: then it stays sparse, as in CNTK, as a
torch sparse COO tensor ``[n, dim]`` that ``torch.nn.Linear`` and ``torch.sparse.mm`` take (one
value per sequence; sequence streams are dense or ``ids``). Everything is parsed in one pass into
memory at construction; every error is one line naming ``file:line`` and what was expected.
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
_LAYOUTS = ("dense", "sparse")
_SPEC_KEYS = ("dim", "format", "shape", "sequence", "field", "ids", "layout")


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
        layout = spec.get("layout", "dense")
        if layout not in _LAYOUTS:
            raise ValueError(f"streams[{name!r}]['layout'] must be 'dense' (a sparse input made dense, the default) "
                             f"or 'sparse' (kept as a torch sparse COO tensor), got {layout!r}")
        if layout == "sparse":
            _check_sparse_layout(str(name), fmt, ids, sequence, shape, dim)
        checked[str(name)] = {"dim": dim, "format": fmt, "shape": shape, "sequence": sequence, "field": field,
                              "ids": ids, "layout": layout}
    return checked


def _check_sparse_layout(name: str, fmt: str, ids: bool, sequence: bool, shape: tuple, dim: int) -> None:
    """``layout: sparse`` keeps a sparse input's values as a sparse ``[n, dim]`` tensor: one value per sequence."""
    if fmt != "sparse":
        raise ValueError(f"streams[{name!r}] has layout: sparse, which keeps the 'index:value' entries of a sparse "
                         f"input; add format: sparse (a dense input is served dense)")
    if ids:
        raise ValueError(f"streams[{name!r}] has ids: true, served as int64 ids, and layout: sparse; use one of them")
    if sequence:
        raise ValueError(f"streams[{name!r}] has layout: sparse and sequence: true; a sparse tensor holds one value "
                         f"per sequence: read a sequence of one 'index:1' token per step with ids: true, or leave "
                         f"layout out to make its steps dense")
    if shape != (dim,):
        raise ValueError(f"streams[{name!r}] has layout: sparse, a sparse [n, dim] tensor; leave out shape "
                         f"{list(shape)}")


def _read_lines(path: str) -> list[str]:
    try:
        with open(path, encoding="utf-8") as file:
            return file.read().splitlines()
    except FileNotFoundError:
        raise DataError(f"CTF file {path} not found; expected '[seqId] |name v v ...' lines") from None
    except (OSError, UnicodeDecodeError) as error:
        raise DataError(f"CTF file {path} could not be read ({error}); expected UTF-8 text") from error


class CTFDeserializer(ArrayDeserializer):
    """A CTF file as a deserializer: features and labels, or named streams (with or without sequences).

    **Features and labels** (no spec has ``sequence: true``, and ``features`` and ``labels`` are
    streams): float32 features and labels, one per sequence, served (``get``, ``num_samples``,
    ``mean_image``) as an :class:`ArrayDeserializer` over those arrays. Labels are int64 class ids
    (one-hot or one ``i:1`` entry), or float32 targets ``[n, 1]`` for a numeric column (dense,
    ``dim: 1``), the number CNTK reads.

    **Named streams** (any spec has ``sequence: true``, or the specs are not a features/labels pair:
    a single stream, other names, or ``labels=None``), as CNTK reads every file: a stream
    deserializer (``streams`` name -> :class:`~dtrain.data.streams.StreamInfo`, ``num_sequences``,
    ``sequence_lengths``, ``read``, ``defining_stream``) over the streams as named in ``streams``. A
    sequence stream has one step per line of the sequence on which its input appears (at least one);
    a non-sequence stream exactly one value per sequence. Sequence streams are read as
    :class:`~dtrain.data.streams.Sequences`.

    Args:
        path: the CTF text file.
        streams: ``{name: spec}`` for every input read (inputs in the file but not listed are
            ignored). Spec keys: ``dim`` (values per line, or the vocabulary of ``ids``),
            ``format`` (``dense`` default, or ``sparse``: made dense), ``shape`` (optional, reshapes
            a float value, e.g. ``[1, 28, 28]``), ``sequence`` (bool, default false: one step per
            line), ``field`` (the input's name in the file when it is not ``name``, CNTK's
            ``StreamDef(field='S0')``), ``ids`` (bool, default false: a sparse input of one
            ``i:1`` entry per value, served as the int64 id ``i`` with ``num_classes=dim``) and
            ``layout`` (``dense`` default: a sparse input made dense; ``sparse``: kept sparse, a
            float32 sparse COO tensor ``[n, dim]``, for a stream with one value per sequence).
        features: the stream served as features (only when read as features and labels).
        labels: the stream served as labels: one-hot (dense, exactly one 1, rest 0) or one sparse
            ``index:1`` entry, whose ``dim`` is ``num_classes``, or a dense numeric column (``dim: 1``)
            read as a float32 target. ``None``: no labels, every stream served by its name. When
            ``features`` and ``labels`` keep their defaults and the specs lack either stream, the
            file is read as named streams (a single-stream file, say).
        defining_stream: with sequences, the stream whose steps count samples when the source is not
            told; default the first sequence stream of ``streams`` (CNTK counts a sequence's lines,
            the same whenever that input is on every line of a sequence).

    Attributes:
        specs: the checked stream specs, with their defaults filled in.
        streams: as features and labels, ``specs``; as named streams, the ``StreamInfo`` of each.

    Raises:
        TypeError / ValueError: bad ``streams`` (an unknown key, a bad value, two streams of one
            field, a ``layout: sparse`` that is not a sparse input with one value per sequence),
            unknown ``features``/``labels``, ``features``/``labels`` given for named streams, or
            ``defining_stream`` without sequence streams.
        DataError: the file is missing or malformed (a wrong value count, an index out of range or
            twice in one value, an input twice in a line, a non-sequence input twice in a sequence,
            a missing input or an empty sequence, a label that is not one-hot, an ``ids`` value
            that is not one ``i:1``); the message names the file and line.
    """

    def __init__(self, path: str | os.PathLike, streams: Mapping, features: str = "features",
                 labels: str | None = "labels", defining_stream: str | None = None) -> None:
        self.specs = _check_streams(streams)
        self._named_streams = self._reads_named_streams(features, labels)
        self.path = os.fspath(path)
        if self._named_streams:
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
        if self.specs[labels]["layout"] == "sparse":
            raise ValueError(f"streams[{labels!r}] has layout: sparse, but labels are served as class ids; leave "
                             f"layout out (or read the streams by name: labels=None)")
        self._features_name, self._labels_name = features, labels
        values = self._parse()
        targets = self._numeric_labels()
        super().__init__(self._stack(features, values[features]),
                         self._stack(labels, values[labels]) if targets else self._class_ids(values[labels]),
                         num_classes=None if targets else self.streams[labels]["dim"])

    def _reads_named_streams(self, features: str, labels: str | None) -> bool:
        """Whether the specs are read as named streams rather than as features and labels (see the class)."""
        if any(spec["sequence"] for spec in self.specs.values()) or labels is None:
            return True
        return (features, labels) == ("features", "labels") and not {features, labels} <= set(self.specs)

    def _numeric_labels(self) -> bool:
        """A dense one-number labels input is a numeric column, read as CNTK reads it: a float target."""
        spec = self.specs[self._labels_name]
        return spec["format"] == "dense" and spec["dim"] == 1

    def _init_streams(self, features: str, labels: str | None, defining_stream: str | None) -> None:
        if features != "features" or labels not in ("labels", None):
            reason = "labels=None" if labels is None else "a stream has sequence: true"
            raise ValueError(f"features={features!r} / labels={labels!r} pick the two streams of data without "
                             f"sequences; with {reason} every stream is served by its own name "
                             f"({', '.join(self.specs)}), so leave them out")
        sequence_streams = [name for name, spec in self.specs.items() if spec["sequence"]]
        if defining_stream is not None and not sequence_streams:
            raise ValueError(f"defining_stream={defining_stream!r} counts the steps of a sequence stream, and no "
                             f"stream here has sequence: true; leave it out")
        if defining_stream is None and sequence_streams:
            defining_stream = sequence_streams[0]
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

    def sequence_keys(self) -> list[str | int]:
        """Each sequence's key, in file order (what a ``CompositeDeserializer`` joins by): its ``seqId``, or
        for a line without one its 0-based index among the file's sequences."""
        return [index if key is None else key for index, key in enumerate(self._sequence_ids)]

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
        if not self._named_streams:
            raise TypeError(f"CTFDeserializer.{what} reads named streams; {self.path} is read as features and labels "
                            f"(no stream has sequence: true), use get()")

    # -- the two-stream protocol (features and labels) -------------------------------------------------
    def _require_two_streams(self, what: str, error: type[Exception] = TypeError) -> None:
        if self._named_streams:
            raise error(f"CTFDeserializer.{what} is for data without sequences read as features and labels; "
                        f"{self.path} is read as the named streams {', '.join(self.specs)} (num_sequences, read)")

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
        if self._features.is_sparse:  # a sparse tensor has no indexing by a tensor, only index_select
            return self._features.index_select(0, index), self._labels[index]
        return super().take(index)

    def mean_image(self) -> torch.Tensor:
        """float32 per-element mean of the features, without sequences (TypeError with them)."""
        self._require_two_streams("mean_image")
        if self._features.is_sparse:
            total = torch.sparse.sum(self._features.to(torch.float64), dim=0).to_dense()
            return (total / self._features.shape[0]).to(torch.float32)
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
        self._sequence_ids: list[str | None] = []  # each sequence's id (None: a line without one)
        seen: dict[str, int] = {}  # stream -> first line that gave it, in the current sequence
        steps: dict[str, int] = {}  # sequence stream -> its steps in the current sequence
        current_id: str | None = None
        first_line, last_line, started = 0, 0, False

        def close_sequence() -> None:
            missing = [name for name in self.specs if name not in seen]
            if missing and not self._named_streams:
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
            self._sequence_ids.append(current_id)

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
        if not self._named_streams:
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
        if spec["layout"] == "sparse":
            entries = [self._sparse_entry(name, token, where) for token in tokens]
            self._check_distinct(name, [index for index, _ in entries], where)
            return (np.array([index for index, _ in entries], dtype=np.int64),
                    np.array([value for _, value in entries], dtype=np.float32))
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
            entries = [self._sparse_entry(name, token, where) for token in tokens]
            self._check_distinct(name, [index for index, _ in entries], where)
            for index, value in entries:
                dense[index] = value
        return dense

    def _check_distinct(self, name: str, indices: list[int], where: str) -> None:
        """One value per index: a repeated index would be kept once when made dense and added up when kept
        sparse, so it is neither."""
        if len(set(indices)) != len(indices):
            repeated = next(index for index in indices if indices.count(index) > 1)
            raise DataError(f"{where}: sparse input {self._input(name)} has index {repeated} twice; expected each "
                            f"index at most once per value")

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

    def _stack(self, name: str, values: list) -> np.ndarray | torch.Tensor:
        """A stream's values as one array: int64 ids ``[n]``, float32 ``[n, *shape]``, or with ``layout:
        sparse`` a coalesced float32 sparse COO tensor ``[n, dim]``."""
        spec = self.specs[name]
        if spec["ids"]:
            return np.asarray(values, dtype=np.int64)
        if spec["layout"] == "sparse":
            rows = np.repeat(np.arange(len(values), dtype=np.int64), [len(indices) for indices, _ in values])
            columns = np.concatenate([indices for indices, _ in values])
            entries = np.concatenate([entries for _, entries in values])
            return torch.sparse_coo_tensor(torch.from_numpy(np.stack([rows, columns])), torch.from_numpy(entries),
                                           (len(values), spec["dim"]), check_invariants=True).coalesce()
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
                            f"'index:1'; got {len(nonzero)} non-zero value(s) (for float targets, read the streams "
                            f"by name: labels=None)")
        return int(nonzero[0])
