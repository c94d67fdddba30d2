"""A GPT-style decoder-only transformer for character (or any token) language models.

Pre-norm blocks of causal self-attention (``torch.nn.functional.scaled_dot_product_attention`` with
``is_causal``) and a GELU MLP, learned positions, and a read-out tied to the token embedding, as in
nanoGPT's ``model.py``. ``forward`` takes a token tensor ``[n, T]`` or a :class:`dtrain.data.Sequences`
(fixed-length windows have no padding; padded steps only ever attend to earlier steps, so the real
steps' logits are what an unpadded window gives).
"""
from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional

from dtrain.data.streams import Sequences
from dtrain.models._sizes import check_transformer_sizes

__all__ = ["CharTransformer"]


class _CausalSelfAttention(nn.Module):
    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.projection = nn.Linear(width, width)
        self.dropout = dropout
        self.residual_dropout = nn.Dropout(dropout)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        n, steps, width = hidden.shape
        query, key, value = self.qkv(hidden).split(width, dim=2)
        query, key, value = (t.view(n, steps, self.heads, width // self.heads).transpose(1, 2) for t in (query, key, value))
        attended = functional.scaled_dot_product_attention(
            query, key, value, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.residual_dropout(self.projection(attended.transpose(1, 2).reshape(n, steps, width)))


class _Block(nn.Module):
    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(width)
        self.attention = _CausalSelfAttention(width, heads, dropout)
        self.mlp_norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width), nn.Dropout(dropout))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden + self.attention(self.attention_norm(hidden))
        return hidden + self.mlp(self.mlp_norm(hidden))


class CharTransformer(nn.Module):
    """Logits ``[n, T, vocab_size]`` for the next token at every step of ``[n, T]`` token ids.

    Args:
        vocab_size: number of token ids (the corpus's characters).
        context_length: the longest window the learned positions cover (``T <= context_length``).
        layers, heads, width: the transformer's depth, attention heads and model width
            (``width % heads == 0``).
        dropout: on attention weights, residual branches and embeddings (0 to switch off).

    Raises:
        ValueError: a size that is not a positive whole number, ``width`` not divisible by ``heads``,
            ``dropout`` outside [0, 1); when called, a window longer than ``context_length``.
    """

    def __init__(self, vocab_size: int, context_length: int = 128, layers: int = 4, heads: int = 4,
                 width: int = 128, dropout: float = 0.0) -> None:
        super().__init__()
        check_transformer_sizes({"vocab_size": vocab_size, "context_length": context_length, "layers": layers},
                                width, heads, dropout)
        self.vocab_size = vocab_size
        self.context_length = context_length
        self.token_embedding = nn.Embedding(vocab_size, width)
        self.position_embedding = nn.Embedding(context_length, width)
        self.embedding_dropout = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(_Block(width, heads, dropout) for _ in range(layers))
        self.final_norm = nn.LayerNorm(width)
        self.read_out = nn.Linear(width, vocab_size, bias=False)
        self.read_out.weight = self.token_embedding.weight  # tied, as in GPT-2 and nanoGPT
        self.apply(self._initialize)
        for name, parameter in self.named_parameters():  # GPT-2's scaled initialisation of residual projections
            if name.endswith("projection.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(parameter, mean=0.0, std=0.02 / math.sqrt(2 * layers))

    @staticmethod
    def _initialize(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, tokens: torch.Tensor | Sequences) -> torch.Tensor:
        ids = tokens.data if isinstance(tokens, Sequences) else tokens
        steps = ids.shape[1]
        if steps > self.context_length:
            raise ValueError(f"a window of {steps} tokens is longer than model.context_length={self.context_length}")
        positions = torch.arange(steps, device=ids.device)
        hidden = self.embedding_dropout(self.token_embedding(ids) + self.position_embedding(positions))
        for block in self.blocks:
            hidden = block(hidden)
        return self.read_out(self.final_norm(hidden))

    @torch.no_grad()
    def generate(self, prompt: torch.Tensor, new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
                 generator: torch.Generator | None = None) -> torch.Tensor:
        """``prompt`` ``[n, T0]`` followed by ``new_tokens`` sampled ids (temperature 0: arg-max), each
        step seeing at most the last ``context_length`` tokens."""
        tokens = prompt
        for _ in range(new_tokens):
            logits = self(tokens[:, -self.context_length:])[:, -1]
            if temperature <= 0:
                chosen = logits.argmax(dim=-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    threshold = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
                    logits = logits.masked_fill(logits < threshold, float("-inf"))
                chosen = torch.multinomial(logits.softmax(dim=-1), 1, generator=generator)
            tokens = torch.cat([tokens, chosen], dim=1)
        return tokens
