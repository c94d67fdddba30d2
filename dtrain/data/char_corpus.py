"""A character-level language-model corpus: one text file cut into fixed-length token windows.

The corpus is read once, split into a training head and a held-out tail (``validation_fraction``,
as nanoGPT's ``prepare.py`` does), and its characters become token ids (the sorted set of characters
of the whole file, so both splits share one vocabulary). Each sequence of stream ``text`` is a window
of ``context_length + 1`` tokens starting every ``context_length`` tokens: with ``inputs:
["text[:-1]"]`` and ``target: "text[1:]"`` every token of the split is predicted exactly once per
sweep, from up to ``context_length`` tokens before it, and samples count predicted tokens (CNTK's
samples of a sequence target).

The package ships Shakespeare's plays as ``shakespeare.txt.gz`` (see ``shakespeare.README.md``), the
default ``path``; any UTF-8 text file works the same way. A shipped file is verified against its
SHA-256, so a damaged copy is refused instead of training on it.
"""
from __future__ import annotations

import functools
import gzip
import hashlib
import zlib
from pathlib import Path

import numpy as np
import torch

from dtrain.data._checks import check_int
from dtrain.data.errors import DataError
from dtrain.data.streams import Sequences, StreamInfo

__all__ = ["CharCorpus", "SHAKESPEARE"]

#: The shipped corpus: eight of Shakespeare's plays from Project Gutenberg (public domain), 1,182,436 characters.
SHAKESPEARE = Path(__file__).with_name("shakespeare.txt.gz")
#: SHA-256 of the shipped corpus's text (after decompression).
_SHIPPED_SHA256 = {SHAKESPEARE.name: "766c90f6b04a6e94936fb27bdae0e470581b251f1984c26c82d677764ab25d73"}
_SPLITS = ("train", "validation")


@functools.lru_cache(maxsize=4)
def _read_text(path: str, sha256: str | None) -> str:
    """The text of ``path`` (gzip-compressed when it ends in ``.gz``), verified against ``sha256``."""
    file = Path(path)
    if not file.is_file():
        raise DataError(f"corpus file {path} does not exist; expected a UTF-8 text file (or .gz)")
    try:
        raw = gzip.decompress(file.read_bytes()) if file.suffix == ".gz" else file.read_bytes()
    except (OSError, EOFError, zlib.error) as error:
        raise DataError(f"corpus file {path} is damaged ({error}); reinstall dtrain or restore the file") from None
    if sha256 is not None and hashlib.sha256(raw).hexdigest() != sha256:
        raise DataError(f"corpus file {path} does not match its SHA-256 (truncated or modified); reinstall dtrain "
                        f"or restore the file")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise DataError(f"corpus file {path} is not UTF-8 text (byte {error.start}: {error.reason})") from None
    if len(text) < 2:
        raise DataError(f"corpus file {path} holds {len(text)} characters; a language model needs at least 2")
    return text


class CharCorpus:
    """Fixed-length windows of a text file's characters, as stream ``text`` (a stream deserializer).

    Args:
        split: ``train`` (the head) or ``validation`` (the held-out tail).
        context_length: tokens each window predicts; a window holds ``context_length + 1`` tokens.
        path: the text file (``.gz`` read compressed); default: the shipped Shakespeare corpus.
        validation_fraction: the share of the file's characters held out at its end, in (0, 1).
        sha256: the expected SHA-256 of the text, when it is known (the shipped corpus's always is).

    Raises:
        DataError: a missing, damaged, non-UTF-8 or too short file, or a split too short for one window.
        ValueError: a bad ``split``, ``context_length`` or ``validation_fraction``.
    """

    def __init__(self, split: str = "train", context_length: int = 128, path: str | None = None,
                 validation_fraction: float = 0.1, sha256: str | None = None) -> None:
        if split not in _SPLITS:
            raise ValueError(f"split={split!r}: expected one of {', '.join(_SPLITS)}")
        self.context_length = check_int("context_length", context_length, 1)
        if isinstance(validation_fraction, bool) or not isinstance(validation_fraction, (int, float)) \
                or not 0.0 < validation_fraction < 1.0:
            raise ValueError(f"validation_fraction={validation_fraction!r}: expected a number in (0, 1)")
        self.path = str(SHAKESPEARE if path is None else Path(path).expanduser())
        if sha256 is None:
            sha256 = _SHIPPED_SHA256.get(Path(self.path).name) if Path(self.path).parent == SHAKESPEARE.parent else None
        text = _read_text(self.path, sha256)
        self.vocabulary = "".join(sorted(set(text)))
        boundary = int(round(len(text) * (1.0 - validation_fraction)))
        part = text[:boundary] if split == "train" else text[boundary:]
        lookup = np.full(max(map(ord, self.vocabulary)) + 1, -1, dtype=np.int64)
        lookup[[ord(c) for c in self.vocabulary]] = np.arange(len(self.vocabulary))
        self.tokens = torch.from_numpy(lookup[np.frombuffer(part.encode("utf-32-le"), dtype=np.uint32)])
        self.split = split
        self.num_sequences = (len(self.tokens) - 1) // self.context_length
        if self.num_sequences < 1:
            raise DataError(f"corpus file {self.path}: its {split} split holds {len(self.tokens)} characters, fewer "
                            f"than one window of context_length + 1 = {self.context_length + 1}; use a shorter "
                            f"context_length or a longer file")
        self.streams = {"text": StreamInfo("text", (), torch.int64, is_sequence=True,
                                           num_classes=len(self.vocabulary))}
        self._lengths = np.full(self.num_sequences, self.context_length + 1, dtype=np.int64)
        self._starts = np.arange(self.num_sequences, dtype=np.int64) * self.context_length

    @property
    def vocab_size(self) -> int:
        return len(self.vocabulary)

    def sequence_lengths(self, name: str) -> np.ndarray:
        """Steps of every window (``context_length + 1`` each)."""
        return self._lengths

    def read(self, indices: np.ndarray) -> dict[str, Sequences]:
        """Windows ``indices`` as ``Sequences`` ``[n, context_length + 1]`` with no padding."""
        starts = torch.from_numpy(self._starts[np.asarray(indices, dtype=np.int64)])
        data = self.tokens[starts[:, None] + torch.arange(self.context_length + 1)]
        return {"text": Sequences(data, torch.from_numpy(self._lengths[:len(starts)].copy()))}

    def checkpoint_identity(self) -> dict:
        """A resumed run must read the same vocabulary and windows (the file may move)."""
        return {"vocabulary": hashlib.sha256(self.vocabulary.encode("utf-8")).hexdigest()[:16],
                "context_length": self.context_length, "windows": self.num_sequences}

    def encode(self, text: str) -> torch.Tensor:
        """Token ids of ``text``; a character outside the vocabulary is refused."""
        unknown = sorted(set(text) - set(self.vocabulary))
        if unknown:
            raise ValueError(f"characters {''.join(unknown)!r} are not in the corpus's vocabulary")
        index = {c: i for i, c in enumerate(self.vocabulary)}
        return torch.tensor([index[c] for c in text], dtype=torch.int64)

    def decode(self, ids) -> str:
        """The text of token ids."""
        return "".join(self.vocabulary[int(i)] for i in ids)

    def __repr__(self) -> str:
        return (f"CharCorpus(split={self.split!r}, context_length={self.context_length}, path={self.path!r}, "
                f"{self.num_sequences} windows, {self.vocab_size} characters)")
