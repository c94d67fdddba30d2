"""A pre-norm ``torch.nn.TransformerDecoder`` run one step at a time, for the decoders of
:class:`~dtrain.models.Seq2SeqTransformer`.

Teacher forcing recomputes every earlier step of the output at each new one, so decoding ``T`` steps
costs ``T * T / 2`` decoder positions. Under the causal mask an earlier position's states never change,
so here each layer keeps the keys and values of the steps already decoded (and of the encoder's states,
which every step reads) and computes only the new position: ``T`` positions in all. The arithmetic is
the layer's own (its projections, norms, feed-forward and activation); only the attention is read from
the kept keys and values.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


def _heads(attention: nn.MultiheadAttention, x: torch.Tensor, which: int) -> torch.Tensor:
    """The query (0), key (1) or value (2) projection of ``x`` ``[n, L, width]`` as ``[n, heads, L, head width]``."""
    width = attention.embed_dim
    weight = attention.in_proj_weight[which * width:(which + 1) * width]
    bias = None if attention.in_proj_bias is None else attention.in_proj_bias[which * width:(which + 1) * width]
    n, steps = x.shape[:2]
    return F.linear(x, weight, bias).view(n, steps, attention.num_heads, attention.head_dim).transpose(1, 2)


def _attend(attention: nn.MultiheadAttention, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
            allowed: torch.Tensor | None = None) -> torch.Tensor:
    """``attention``'s output for one query step ``[n, heads, 1, head width]`` over the kept keys and values."""
    found = F.scaled_dot_product_attention(query, keys, values, attn_mask=allowed)
    return attention.out_proj(found.transpose(1, 2).reshape(query.shape[0], 1, attention.embed_dim))


class DecoderSteps:
    """The next step's logits for ``n * hypotheses`` outputs being decoded, keeping each layer's keys and values.

    Args:
        model: a :class:`~dtrain.models.Seq2SeqTransformer` (its embeddings, decoder and read-out).
        memory: the encoder's states ``[n, S, width]``.
        source_padding: True at the source's padded steps ``[n, S]`` (never attended to).
        hypotheses: outputs decoded per source (a beam's width), rows ``i * hypotheses ...`` of source ``i``.
            A source's encoder keys and values are kept once and read by all of its outputs (they are
            the queries of one cross-attention), so reordering a beam copies only the outputs' own.
    """

    def __init__(self, model: nn.Module, memory: torch.Tensor, source_padding: torch.Tensor,
                 hypotheses: int = 1) -> None:
        layers = model.decoder.layers
        for layer in layers:
            if not (layer.norm_first and layer.self_attn.batch_first and layer.self_attn._qkv_same_embed_dim
                    and layer.multihead_attn._qkv_same_embed_dim):
                raise ValueError("DecoderSteps runs pre-norm, batch-first decoder layers with packed projections")
        self.model, self.hypotheses = model, hypotheses
        self.steps = 0  # output positions taken in so far
        self.allowed = ~source_padding[:, None, None, :]  # [n, 1, 1, S]: the source steps each output may read
        self.cross = [(_heads(layer.multihead_attn, memory, 1), _heads(layer.multihead_attn, memory, 2))
                      for layer in layers]
        attention = layers[0].self_attn
        empty = memory.new_zeros(memory.shape[0] * hypotheses, attention.num_heads, 0, attention.head_dim)
        self.own: list[tuple[torch.Tensor, torch.Tensor]] = [(empty, empty) for _ in layers]

    def next(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits ``[rows, vocabulary]`` of the step after ``tokens`` ``[rows, t]`` (the outputs so far from
        ``<s>``: the steps before the last were passed to earlier calls, so only its last column is read)."""
        model = self.model
        if self.steps >= model.context_length:
            raise ValueError(f"a sequence of {self.steps + 1} steps is longer than model.context_length="
                             f"{model.context_length}")
        x = model.dropout(model.target_embedding(tokens[:, -1:]) + model.position_embedding.weight[self.steps])
        for index, layer in enumerate(model.decoder.layers):
            normed = layer.norm1(x)
            keys, values = self.own[index]
            keys = torch.cat([keys, _heads(layer.self_attn, normed, 1)], dim=2)
            values = torch.cat([values, _heads(layer.self_attn, normed, 2)], dim=2)
            self.own[index] = keys, values
            x = x + layer.dropout1(_attend(layer.self_attn, _heads(layer.self_attn, normed, 0), keys, values))
            x = x + layer.dropout2(self._cross_attend(layer.multihead_attn, layer.norm2(x), *self.cross[index]))
            x = x + layer._ff_block(layer.norm3(x))
        if model.decoder.norm is not None:
            x = model.decoder.norm(x)
        self.steps += 1
        return model.read_out(x[:, 0])

    def _cross_attend(self, attention: nn.MultiheadAttention, x: torch.Tensor, keys: torch.Tensor,
                      values: torch.Tensor) -> torch.Tensor:
        """Each output's attention over its source's encoder states: a source's outputs are its queries."""
        rows, group = x.shape[0], self.hypotheses
        query = _heads(attention, x, 0).reshape(rows // group, group, attention.num_heads, attention.head_dim)
        found = F.scaled_dot_product_attention(query.transpose(1, 2), keys, values, attn_mask=self.allowed)
        return attention.out_proj(found.transpose(1, 2).reshape(rows, 1, attention.embed_dim))

    def keep(self, rows: torch.Tensor) -> None:
        """Keeps the outputs at ``rows`` (indices, in their new order; repeats allowed: a beam's parents), each
        group of ``hypotheses`` of them from one source, as a beam's are."""
        self.own = [(keys[rows], values[rows]) for keys, values in self.own]
        sources = rows[::self.hypotheses] // self.hypotheses
        if sources.shape[0] != self.allowed.shape[0] or not bool((sources == torch.arange(
                sources.shape[0], device=sources.device)).all()):  # sources left (or moved): theirs follow
            self.allowed = self.allowed[sources]
            self.cross = [(keys[sources], values[sources]) for keys, values in self.cross]
