"""A causal transformer small enough for CPU tests: token and position embeddings, one block of
causal self-attention (separate q, k, v projections) and an MLP, a language-model head."""

from __future__ import annotations

import torch
import torch.nn.functional as F

VOCAB, SEQ, DIM = 32, 8, 16


class TinyGPT(torch.nn.Module):
    def __init__(self, vocab: int = VOCAB, seq: int = SEQ, dim: int = DIM, dropout: float = 0.0) -> None:
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, dim)
        self.pos = torch.nn.Embedding(seq, dim)
        self.q = torch.nn.Linear(dim, dim)
        self.k = torch.nn.Linear(dim, dim)
        self.v = torch.nn.Linear(dim, dim)
        self.proj = torch.nn.Linear(dim, dim)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim))
        self.drop = torch.nn.Dropout(dropout)
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t))
        q, k, v = self.q(x), self.k(x), self.v(x)
        att = (q @ k.transpose(-2, -1)) / (q.shape[-1] ** 0.5)
        att = att.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
        x = x + self.drop(self.proj(att @ v))
        x = x + self.mlp(x)
        return self.head(x)


def lm_loss(module: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    logits = module(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def batch(gen: torch.Generator, size: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    data = torch.randint(0, VOCAB, (size, SEQ + 1), generator=gen)
    return data[:, :-1], data[:, 1:]
