"""A small transformer whose sizes divide neither world size 2 nor 4, and the data it trains on.

Every parameter shape is chosen to stress dim-0 sharding: odd row counts (15, 31, 37, 45), a
parameter with fewer rows than ranks (``mix``: 3 x 5 at world size 4, so one rank holds no
rows), 1-D weights and biases of odd length. No tied weights, no buffers: the state dict is the
parameters, by their original names. Shared by the ranks and the one-process reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, D, HEADS, HIDDEN, SEQ, LAYERS = 37, 15, 3, 31, 7, 2
GLOBAL_BATCH = 8  # rows per step, split evenly over 1, 2 or 4 ranks


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(D)
        self.qkv = nn.Linear(D, 3 * D, bias=False)  # (45, 15)
        self.proj = nn.Linear(D, D)  # (15, 15) and a (15,) bias
        self.ln2 = nn.LayerNorm(D)
        self.fc1 = nn.Linear(D, HIDDEN)  # (31, 15), (31,)
        self.fc2 = nn.Linear(HIDDEN, D)  # (15, 31), (15,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, HEADS, D // HEADS).unbind(2)
        a = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, D))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, D)  # (37, 15)
        self.pos = nn.Parameter(torch.randn(SEQ, D) * 0.1)  # (7, 15)
        self.mix = nn.Parameter(torch.randn(3, 5) * 0.3)  # fewer rows than 4 ranks
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB)  # (37, 15) and a (37,) bias

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        x = x + F.pad(x[..., :3] @ self.mix, (0, D - 5))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def build() -> Net:
    """The same initial weights every time, on every rank."""
    torch.manual_seed(0)
    return Net()


def batch(step: int, rank: int = 0, world: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s equal slice of step ``step``'s global batch (the whole batch for world 1)."""
    g = torch.Generator().manual_seed(1000 + step)
    data = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=g)
    per = GLOBAL_BATCH // world
    mine = data[rank * per : (rank + 1) * per]
    return mine[:, :-1], mine[:, 1:]


def loss_fn(model: nn.Module, step: int, rank: int = 0, world: int = 1) -> torch.Tensor:
    """Mean token loss on the rank's slice; the mean over ranks is the global-batch loss."""
    x, y = batch(step, rank, world)
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


LR = {"adamw": 1e-2, "sgd": 5e-2}


def make_optimizer(kind: str, params) -> torch.optim.Optimizer:
    """``kind``: adamw_foreach | adamw_forloop | adamw_fused | sgd_momentum."""
    params = list(params)
    if kind == "adamw_foreach":
        return torch.optim.AdamW(params, lr=LR["adamw"], foreach=True)
    if kind == "adamw_forloop":
        return torch.optim.AdamW(params, lr=LR["adamw"], foreach=False)
    if kind == "adamw_fused":
        return torch.optim.AdamW(params, lr=LR["adamw"], fused=True)
    if kind == "sgd_momentum":
        return torch.optim.SGD(params, lr=LR["sgd"], momentum=0.9)
    raise ValueError(kind)
