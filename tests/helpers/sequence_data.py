"""Small sequence data sets and models as real as the users' (attention with padding masks, packed
recurrent encoders), for the tests of named streams and sequences."""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from dtrain.data import Sequences, StreamArrays

VOCABULARY = 13


def token_sequences(num_sequences: int = 60, seed: int = 0, low: int = 2, high: int = 15) -> StreamArrays:
    """A corpus of ``num_sequences`` token sequences of uneven lengths in ``[low, high)``: stream ``text``
    (vocabulary ``VOCABULARY``), each sequence counting up from a random start modulo the vocabulary, so a
    model can learn it and training moves the parameters measurably."""
    generator = np.random.default_rng(seed)
    lengths = generator.integers(low, high, size=num_sequences)
    starts = generator.integers(0, VOCABULARY, size=num_sequences)
    text = [(start + np.arange(length)) % VOCABULARY for start, length in zip(starts, lengths)]
    return StreamArrays({"text": text}, num_classes={"text": VOCABULARY})


def sequence_pairs(num_sequences: int = 50, seed: int = 1) -> StreamArrays:
    """Sequence-to-sequence pairs of different lengths: ``source`` tokens and ``target`` = ``[BOS] +
    reversed(source) + [EOS]`` with BOS = 1, EOS = 2 (ids 3.. are the symbols); and a per-sequence ``tag``."""
    generator = np.random.default_rng(seed)
    sources, targets = [], []
    for length in generator.integers(1, 9, size=num_sequences):
        symbols = generator.integers(3, VOCABULARY, size=length)
        sources.append(symbols)
        targets.append(np.concatenate([[1], symbols[::-1], [2]]))
    tags = np.array([len(s) % 3 for s in sources], dtype=np.int64)
    return StreamArrays({"source": sources, "target": targets, "tag": tags},
                        num_classes={"source": VOCABULARY, "target": VOCABULARY, "tag": 3})


class TinyCausalLM(nn.Module):
    """Embedding, one causal self-attention layer that masks padding (``key_padding_mask = ~mask``), and
    a linear read-out: logits ``[n, T, VOCABULARY]`` for ``Sequences`` input."""

    context_length = 64

    def __init__(self, width: int = 16):
        super().__init__()
        self.embedding = nn.Embedding(VOCABULARY, width)
        self.position = nn.Embedding(self.context_length, width)
        self.layer = nn.TransformerEncoderLayer(width, nhead=2, dim_feedforward=32, dropout=0.0, batch_first=True)
        self.output = nn.Linear(width, VOCABULARY)

    def forward(self, tokens: Sequences) -> torch.Tensor:
        steps = tokens.data.shape[1]
        hidden = self.embedding(tokens.data) + self.position(torch.arange(steps, device=tokens.data.device))
        causal = torch.ones(steps, steps, dtype=torch.bool, device=hidden.device).triu(1)  # True: may not attend
        hidden = self.layer(hidden, src_mask=causal, src_key_padding_mask=~tokens.mask)
        return self.output(hidden)


class TinySeq2Seq(nn.Module):
    """A GRU encoder over packed source sequences (``lengths`` on the CPU) and a GRU decoder with
    teacher forcing: ``forward(source, decoder_input)`` -> logits ``[n, T, VOCABULARY]``."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.embedding = nn.Embedding(VOCABULARY, width)
        self.encoder = nn.GRU(width, width, batch_first=True)
        self.decoder = nn.GRU(width, width, batch_first=True)
        self.output = nn.Linear(width, VOCABULARY)

    def forward(self, source: Sequences, decoder_input: Sequences) -> torch.Tensor:
        packed = nn.utils.rnn.pack_padded_sequence(self.embedding(source.data), source.lengths, batch_first=True,
                                                   enforce_sorted=False)
        _, state = self.encoder(packed)
        hidden, _ = self.decoder(self.embedding(decoder_input.data), state)
        return self.output(hidden)
