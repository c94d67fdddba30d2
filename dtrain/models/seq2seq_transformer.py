"""A small transformer encoder-decoder for short sequence-to-sequence tasks (grapheme-to-phoneme).

Pre-norm ``torch.nn.TransformerEncoder``/``TransformerDecoder`` layers over learned token and
position embeddings; the decoder's read-out is tied to its token embedding. ``forward(source,
decoder_input)`` is teacher forcing (logits for every step of ``decoder_input``); ``greedy_decode``
and ``beam_decode`` generate from ``<s>`` until ``</s>``, one step at a time (each step computes only
its own position: :class:`~dtrain.models.decoder_steps.DecoderSteps`), many sources at once, for the
evaluation passes' error rates.
"""
from __future__ import annotations

import torch
from torch import nn

from dtrain.checks import whole_number
from dtrain.data.streams import Sequences
from dtrain.models._sizes import check_transformer_sizes
from dtrain.models.decoder_steps import DecoderSteps

__all__ = ["Seq2SeqTransformer"]


class Seq2SeqTransformer(nn.Module):
    """Logits ``[n, T, target_vocab_size]`` for ``decoder_input`` ``[n, T]`` given ``source`` ``[n, S]``.

    Args:
        source_vocab_size, target_vocab_size: token ids of each side (id 0 may pad).
        width, heads, encoder_layers, decoder_layers, feedforward: the transformer's sizes.
        dropout: on attention, feed-forward and embeddings.
        context_length: the longest source or target sequence the learned positions cover.
        begin, end: the target's ``<s>`` and ``</s>`` ids (what the decoders start from and stop at).

    Raises:
        ValueError: a size that is not a positive whole number, ``width`` not divisible by ``heads``,
            ``dropout`` outside [0, 1); when called, a sequence longer than ``context_length``.
    """

    def __init__(self, source_vocab_size: int, target_vocab_size: int, width: int = 256, heads: int = 4,
                 encoder_layers: int = 3, decoder_layers: int = 3, feedforward: int = 1024, dropout: float = 0.1,
                 context_length: int = 64, begin: int = 1, end: int = 2) -> None:
        super().__init__()
        check_transformer_sizes({"source_vocab_size": source_vocab_size, "target_vocab_size": target_vocab_size,
                                 "encoder_layers": encoder_layers, "decoder_layers": decoder_layers,
                                 "feedforward": feedforward, "context_length": context_length}, width, heads, dropout)
        self.context_length, self.begin, self.end = context_length, begin, end
        self.source_embedding = nn.Embedding(source_vocab_size, width)
        self.target_embedding = nn.Embedding(target_vocab_size, width)
        self.position_embedding = nn.Embedding(context_length, width)
        self.dropout = nn.Dropout(dropout)
        self.encoder = nn.TransformerEncoder(
            nn.TransformerEncoderLayer(width, heads, feedforward, dropout, batch_first=True, norm_first=True),
            encoder_layers, norm=nn.LayerNorm(width), enable_nested_tensor=False)
        self.decoder = nn.TransformerDecoder(
            nn.TransformerDecoderLayer(width, heads, feedforward, dropout, batch_first=True, norm_first=True),
            decoder_layers, norm=nn.LayerNorm(width))
        self.read_out = nn.Linear(width, target_vocab_size, bias=False)
        self.read_out.weight = self.target_embedding.weight
        for embedding in (self.source_embedding, self.target_embedding, self.position_embedding):
            nn.init.normal_(embedding.weight, mean=0.0, std=0.02)  # GPT-2's initialisation

    def _embed(self, embedding: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
        steps = ids.shape[1]
        if steps > self.context_length:
            raise ValueError(f"a sequence of {steps} steps is longer than model.context_length={self.context_length}")
        positions = self.position_embedding(torch.arange(steps, device=ids.device))
        return self.dropout(embedding(ids) + positions)

    def encode(self, source: Sequences) -> tuple[torch.Tensor, torch.Tensor]:
        """The encoder's states ``[n, S, width]`` and the source's padding (True at padded steps)."""
        padding = ~source.mask
        return self.encoder(self._embed(self.source_embedding, source.data), src_key_padding_mask=padding), padding

    def decode(self, memory: torch.Tensor, source_padding: torch.Tensor, decoder_input: torch.Tensor,
               target_padding: torch.Tensor | None = None) -> torch.Tensor:
        """Logits for every step of ``decoder_input`` ``[n, T]`` (causal: step t sees steps <= t)."""
        steps = decoder_input.shape[1]
        causal = torch.ones(steps, steps, dtype=torch.bool, device=decoder_input.device).triu(1)
        hidden = self.decoder(self._embed(self.target_embedding, decoder_input), memory, tgt_mask=causal,
                              tgt_key_padding_mask=target_padding, memory_key_padding_mask=source_padding)
        return self.read_out(hidden)

    def forward(self, source: Sequences, decoder_input: Sequences) -> torch.Tensor:
        memory, source_padding = self.encode(source)
        return self.decode(memory, source_padding, decoder_input.data, ~decoder_input.mask)

    def decoder_steps(self, memory: torch.Tensor, source_padding: torch.Tensor, hypotheses: int = 1) -> DecoderSteps:
        """The decoder run one step at a time over ``memory``, ``hypotheses`` outputs per source (what the
        decoders below step through)."""
        return DecoderSteps(self, memory, source_padding, hypotheses)

    @torch.no_grad()
    def greedy_decode(self, source: Sequences, max_steps: int | None = None) -> list[list[int]]:
        """Each source's arg-max output, step by step from ``<s>`` to ``</s>`` (excluded), at most
        ``max_steps`` (default: ``context_length - 1``) ids. A finished sequence leaves the batch, so
        the steps after it cost only the unfinished ones."""
        was_training = self.training
        self.eval()
        try:
            memory, source_padding = self.encode(source)
            n = memory.shape[0]
            steps = self.decoder_steps(memory, source_padding)
            limit = min(max_steps or self.context_length - 1, self.context_length - 1)
            outputs: list[list[int]] = [[] for _ in range(n)]
            active = torch.arange(n, device=memory.device)  # rows still decoding
            tokens = torch.full((n, 1), self.begin, dtype=torch.int64, device=memory.device)
            for _ in range(limit):
                chosen = steps.next(tokens).argmax(dim=-1)
                ended = chosen == self.end
                for row, token in zip(active[~ended].tolist(), chosen[~ended].tolist()):
                    outputs[row].append(token)
                keep = ~ended
                if not bool(keep.any()):
                    break
                if not bool(keep.all()):
                    active = active[keep]
                    steps.keep(keep.nonzero()[:, 0])
                tokens = torch.cat([tokens[keep], chosen[keep, None]], dim=1)
        finally:
            self.train(was_training)
        return outputs

    @torch.no_grad()
    def beam_decode(self, source: Sequences, beam_size: int = 4, max_steps: int | None = None) -> list[list[int]]:
        """Each source's likeliest output found by a beam search of ``beam_size`` hypotheses: the
        output (``</s>`` excluded) with the largest summed log-probability among those the beam reached.

        At each step every live hypothesis is extended by every token; of the ``2 * beam_size`` best
        extensions, those ending in ``</s>`` among the first ``beam_size`` are finished outputs and
        the best ``beam_size`` others stay in the beam. A source is done when its best finished
        output scores at least its best live hypothesis (extending a hypothesis only lowers its
        score, so nothing left can beat it). ``beam_size=1`` is exactly :meth:`greedy_decode`.
        A source with no finished output after ``max_steps`` returns its best live hypothesis.

        Raises:
            ValueError: ``beam_size`` not a whole number of at least 1.
        """
        whole_number("beam_size", beam_size, 1, unit="hypotheses")
        was_training = self.training
        self.eval()
        try:
            return self._beam_search(source, beam_size, max_steps)
        finally:
            self.train(was_training)

    def _beam_search(self, source: Sequences, k: int, max_steps: int | None) -> list[list[int]]:
        memory, source_padding = self.encode(source)
        n, device = memory.shape[0], memory.device
        limit = min(max_steps or self.context_length - 1, self.context_length - 1)
        best: list[tuple[float, list[int]] | None] = [None] * n  # each source's best finished output
        rows = torch.arange(n, device=device)  # the sources still searching
        steps = self.decoder_steps(memory, source_padding, hypotheses=k)
        tokens = torch.full((n * k, 1), self.begin, dtype=torch.int64, device=device)
        scores = torch.full((n, k), float("-inf"), device=device)
        scores[:, 0] = 0.0  # one live hypothesis, <s>, until the first step fans out
        ranks = torch.arange(2 * k, device=device)
        for _ in range(limit):
            log_probs = torch.log_softmax(steps.next(tokens).float(), dim=-1)
            vocab = log_probs.shape[-1]
            extended = (scores[:, :, None] + log_probs.view(len(rows), k, vocab)).view(len(rows), k * vocab)
            top_scores, top = extended.topk(min(2 * k, k * vocab), dim=1)
            parent, token = top // vocab, top % vocab
            ends = (token == self.end) & (ranks[:top.shape[1]] < k) & torch.isfinite(top_scores)
            for i, j in ends.nonzero().tolist():
                row, score = int(rows[i]), float(top_scores[i, j])
                if best[row] is None or score > best[row][0]:
                    hypothesis = int(i * k + parent[i, j])
                    best[row] = (score, tokens[hypothesis, 1:].tolist())
            # the beam: the best k extensions that do not end (there are at least k among 2k)
            order = (token == self.end).to(torch.int64).mul(2 * k).add(ranks[:top.shape[1]]).argsort(dim=1)
            kept = order[:, :k]
            scores = top_scores.gather(1, kept)
            chosen_parent = parent.gather(1, kept) + torch.arange(len(rows), device=device)[:, None] * k
            tokens = torch.cat([tokens[chosen_parent.view(-1)], token.gather(1, kept).view(-1, 1)], dim=1)
            steps.keep(chosen_parent.view(-1))
            finished = torch.tensor([best[int(r)] is not None and best[int(r)][0] >= float(s)
                                     for r, s in zip(rows.tolist(), scores[:, 0].tolist())], device=device)
            if bool(finished.all()):
                rows = rows[:0]
                break
            if bool(finished.any()):
                keep = ~finished
                keep_hypotheses = keep.repeat_interleave(k)
                rows, scores = rows[keep], scores[keep]
                tokens = tokens[keep_hypotheses]
                steps.keep(keep_hypotheses.nonzero()[:, 0])
        for i, row in enumerate(rows.tolist()):  # out of steps: the best finished or live output
            live = (float(scores[i, 0]), tokens[i * k, 1:].tolist())
            if best[row] is None or live[0] > best[row][0]:
                best[row] = live
        return [found[1] for found in best]  # every source has one by now
