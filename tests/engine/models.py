"""Small models for engine tests: a GPT with tied embeddings, a frozen layer and parameter
sizes that do not divide the world size."""

from __future__ import annotations

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        # No attention biases: the key bias has an exactly-zero gradient, so AdamW would turn float
        # noise into full-size updates and no two summation orders could agree on it.
        self.attn = nn.MultiheadAttention(d, heads, bias=False, batch_first=True)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 3 * d + 1), nn.GELU(), nn.Linear(3 * d + 1, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        t = x.shape[1]
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool, device=x.device), diagonal=1)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """Tied input/output embedding; ``frozen`` is a layer with requires_grad=False."""

    def __init__(
        self, vocab: int = 61, d: int = 22, heads: int = 2, layers: int = 3, seq: int = 9
    ) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(seq, d) * 0.02)
        self.frozen = nn.Linear(d, d)
        self.frozen.requires_grad_(False)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        x = x + 0.1 * self.frozen(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def make_batch(
    step: int, rank: int, world: int, batch: int = 4, seq: int = 9, vocab: int = 61
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rank's slice of the global batch of ``step`` (global batch = batch * world)."""
    g = torch.Generator().manual_seed(1000 + step)
    data = torch.randint(0, vocab, (batch * world, seq + 1), generator=g)
    mine = data[rank * batch : (rank + 1) * batch]
    return mine[:, :-1], mine[:, 1:]
