"""CNTK Text Format (CTF) deserializer: ``[seqId] |name v v ... |sparse i:v ... |# comment``.

Format (``docs/semantics.md#data-formats``, CNTK ``articles/BrainScript-CNTKTextFormat-Reader.md``):
  * an optional leading sequence id; consecutive lines with the same id form one sequence, and a
    line without an id is a sequence of its own;
  * ``|name`` starts an input's values: dense ``v v ...`` (exactly ``dim`` numbers) or sparse
    ``i:v ...`` (0-based indices below ``dim``); each input at most once per line;
  * ``|#`` starts a comment, which runs to the next ``|`` or the end of the line.
This product reads non-sequence data: one sample per sequence, so an input given on several lines
of one sequence is an error. Everything is parsed once into memory at construction.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import numpy as np

from dtrain.data._checks import check_int
from dtrain.data.arrays import ArrayDeserializer
from dtrain.data.errors import DataError

__all__ = ["CTFDeserializer"]

_FORMATS = ("dense", "sparse")


def _check_streams(streams: Mapping) -> dict[str, dict]:
    if not isinstance(streams, Mapping) or not streams:
        raise TypeError(f"streams must be a non-empty mapping name -> {{dim, format}}, got {streams!r}")
    checked = {}
    for name, spec in streams.items():
        if not isinstance(spec, Mapping) or "dim" not in spec:
            raise ValueError(f"streams[{name!r}] must be a mapping with 'dim' (and 'format'), got {spec!r}")
        unknown = set(spec) - {"dim", "format", "shape"}
        if unknown:
            raise ValueError(f"streams[{name!r}] has unknown keys {sorted(unknown)}; expected dim, format, shape")
        dim = check_int(f"streams[{name!r}]['dim']", spec["dim"], 1)
        fmt = spec.get("format", "dense")
        if fmt not in _FORMATS:
            raise ValueError(f"streams[{name!r}]['format'] must be 'dense' or 'sparse', got {fmt!r}")
        shape = tuple(spec.get("shape") or (dim,))
        if int(np.prod(shape)) != dim:
            raise ValueError(f"streams[{name!r}]['shape'] {list(shape)} must hold dim={dim} values")
        checked[str(name)] = {"dim": dim, "format": fmt, "shape": shape}
    return checked


class CTFDeserializer(ArrayDeserializer):
    """A CTF file as a deserializer: float32 features and int64 class labels, one per sequence.

    Parsed into memory once, then served (``get``, ``num_samples``, ``mean_image``) as an
    :class:`ArrayDeserializer` over those arrays.

    Args:
        path: the CTF text file.
        streams: ``{name: {"dim": D, "format": "dense"|"sparse", "shape": [..]}}`` for every input
            read (inputs in the file but not listed are ignored); ``shape`` (optional) reshapes
            the features, e.g. ``[1, 28, 28]``. Sparse values become dense tensors.
        features: the stream used as features.
        labels: the stream used as labels: one-hot (dense, exactly one 1, rest 0) or one sparse
            ``index:1`` entry; its ``dim`` is ``num_classes``.

    Raises:
        TypeError / ValueError: bad ``streams`` or stream names.
        DataError: the file is missing or malformed (a wrong value count, an index out of range,
            an input twice in a line or a sequence, a missing input, a label that is not one-hot);
            the message names the file and line.
    """

    def __init__(self, path: str | os.PathLike, streams: Mapping, features: str = "features",
                 labels: str = "labels") -> None:
        self.streams = _check_streams(streams)
        for role, name in (("features", features), ("labels", labels)):
            if name not in self.streams:
                raise ValueError(f"{role}={name!r} is not in streams {sorted(self.streams)}; add it or rename")
        self.path = os.fspath(path)
        self._features_name, self._labels_name = features, labels
        values = self._parse()
        super().__init__(values[features].reshape(-1, *self.streams[features]["shape"]), values[labels],
                         num_classes=self.streams[labels]["dim"])

    # -- parsing ----------------------------------------------------------------------------------
    def _parse(self) -> dict[str, np.ndarray]:
        try:
            with open(self.path, encoding="utf-8") as file:
                lines = file.read().splitlines()
        except FileNotFoundError:
            raise DataError(f"CTF file {self.path} not found; expected '[seqId] |name v v ...' lines") from None
        except (OSError, UnicodeDecodeError) as error:
            raise DataError(f"CTF file {self.path} could not be read ({error}); expected UTF-8 text") from error
        rows: dict[str, list[np.ndarray]] = {name: [] for name in self.streams}
        sequence_lines: dict[str, int] = {}  # name -> line that gave it, in the current sequence
        label_lines: list[str] = []  # "file:line" of each label, for errors
        current_id: str | None = None
        first_line, started = 0, False

        def close_sequence() -> None:
            missing = [name for name in self.streams if name not in sequence_lines]
            if missing:
                raise DataError(f"{self.path}:{first_line}: sequence {current_id!r} has no value for input(s) "
                                f"{missing}; every sample needs all of {sorted(self.streams)}")

        for line_number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            where = f"{self.path}:{line_number}"
            head, bar, rest = line.partition("|")
            if not bar:
                raise DataError(f"{where}: no '|name' input in {line.strip()[:60]!r}; expected '[seqId] |name v v ...'")
            sequence_id = head.strip() or None
            if sequence_id is not None and " " in sequence_id:
                raise DataError(f"{where}: sequence id {sequence_id!r} must be one token before the first '|'")
            if not started or sequence_id is None or sequence_id != current_id:
                if started:
                    close_sequence()
                sequence_lines = {}
                current_id, first_line, started = sequence_id, line_number, True
            seen_in_line: set[str] = set()
            for segment in ("|" + rest).split("|")[1:]:
                if segment.startswith("#"):
                    continue
                tokens = segment.split()
                if not tokens:
                    raise DataError(f"{where}: empty '|' with no input name; expected '|name v v ...'")
                name, values = tokens[0], tokens[1:]
                if name in seen_in_line:
                    raise DataError(f"{where}: input {name!r} appears twice in one line; CTF allows each input once per line")
                seen_in_line.add(name)
                if name not in self.streams:
                    continue
                if name in sequence_lines:
                    raise DataError(f"{where}: input {name!r} already has a value in this sequence (line "
                                    f"{sequence_lines[name]}); this reader takes one sample per sequence, so give "
                                    f"each line its own sequence id")
                sequence_lines[name] = line_number
                rows[name].append(self._values(name, values, where))
                if name == self._labels_name:
                    label_lines.append(where)
        if started:
            close_sequence()
        if not rows[self._labels_name]:
            raise DataError(f"CTF file {self.path} has no samples; expected '[seqId] |name v v ...' lines")
        features = np.stack(rows[self._features_name]).astype(np.float32)
        labels = np.asarray([self._class(row, where) for row, where in
                             zip(rows[self._labels_name], label_lines)], dtype=np.int64)
        return {self._features_name: features, self._labels_name: labels}

    def _values(self, name: str, tokens: list[str], where: str) -> np.ndarray:
        spec = self.streams[name]
        dense = np.zeros(spec["dim"], dtype=np.float32)
        if spec["format"] == "dense":
            if len(tokens) != spec["dim"]:
                raise DataError(f"{where}: input {name!r} has {len(tokens)} values; expected dim={spec['dim']} "
                                f"dense values (or declare format: sparse)")
            try:
                dense[:] = [float(token) for token in tokens]
            except ValueError:
                raise DataError(f"{where}: input {name!r} has a value that is not a number in "
                                f"{' '.join(tokens)[:60]!r}") from None
        else:
            for token in tokens:
                index_text, colon, value_text = token.partition(":")
                try:
                    index, value = int(index_text), float(value_text)
                except ValueError:
                    index = None
                if not colon or index is None:
                    raise DataError(f"{where}: sparse input {name!r} has {token!r}; expected 'index:value'")
                if not 0 <= index < spec["dim"]:
                    raise DataError(f"{where}: sparse input {name!r} index {index} is outside [0, {spec['dim']})")
                dense[index] = value
        return dense

    def _class(self, row: np.ndarray, where: str) -> int:
        nonzero = np.flatnonzero(row)
        if len(nonzero) != 1 or row[nonzero[0]] != 1.0:
            raise DataError(f"{where}: labels {self._labels_name!r} must be one-hot (a single 1) or one sparse "
                            f"'index:1'; got {len(nonzero)} non-zero value(s)")
        return int(nonzero[0])
