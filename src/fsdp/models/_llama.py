"""A Llama-style decoder for the GPU benchmarks (``python -m fsdp.bench.gpu``).

RMSNorm, rotary position embeddings, causal attention through
``scaled_dot_product_attention`` (flash attention on a GPU) and a SwiGLU MLP, untied input and
output embeddings: the shape of the models our users train. Each `LlamaBlock` is one FSDP unit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["LlamaConfig", "Llama", "LlamaBlock", "LLAMA_SIZES"]


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 32000
    dim: int = 2048
    n_layers: int = 16
    n_heads: int = 16
    ffn_dim: int = 5632
    seq_len: int = 2048

    @property
    def num_params(self) -> int:
        block = 4 * self.dim * self.dim + 3 * self.dim * self.ffn_dim + 2 * self.dim
        return 2 * self.vocab_size * self.dim + self.n_layers * block + self.dim

    def flops_per_token(self) -> float:
        """Model FLOPs of one token's forward and backward: 6 per parameter of the matrix
        products plus causal attention's scores and values (12 * layers * seq * dim, halved
        for the causal mask); activation checkpointing's recompute is not counted (MFU)."""
        attention = 12 * self.n_layers * self.seq_len * self.dim / 2
        return 6 * self.num_params + attention


#: ``1b``: 0.95 B parameters, the size the GPU checklist names.
LLAMA_SIZES: dict[str, LlamaConfig] = {
    "tiny": LlamaConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, ffn_dim=160, seq_len=64),
    "300m": LlamaConfig(dim=1024, n_layers=16, n_heads=16, ffn_dim=2816),
    "1b": LlamaConfig(),
}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def rotary_tables(cfg: LlamaConfig, device: torch.device | str | None = None) -> torch.Tensor:
    """cos and sin of every position and frequency, stacked: shape (2, seq, head_dim // 2)."""
    half = cfg.dim // cfg.n_heads // 2
    freqs = 1.0 / (10000.0 ** (torch.arange(half, device=device, dtype=torch.float32) / half))
    angles = torch.outer(torch.arange(cfg.seq_len, device=device, dtype=torch.float32), freqs)
    return torch.stack([angles.cos(), angles.sin()])


def apply_rotary(x: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    cos, sin = (t[: x.shape[-2]].to(x.dtype) for t in tables)
    a, b = x.chunk(2, dim=-1)
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


class LlamaBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.head_dim = cfg.dim // cfg.n_heads
        self.attn_norm = RMSNorm(cfg.dim)
        self.wqkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.mlp_norm = RMSNorm(cfg.dim)
        self.w13 = nn.Linear(cfg.dim, 2 * cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
        # As in GPT's Block: shapes and the head count (-1) come from the projection, which
        # under tensor parallelism yields this rank's heads, [q; k; v] of them, for this
        # rank's part of the sequence gathered whole (fsdp.models._tp_plan).
        qkv = self.wqkv(self.attn_norm(x))
        b, t = qkv.shape[:2]
        q, k, v = (z.view(b, t, -1, self.head_dim).transpose(1, 2) for z in qkv.chunk(3, dim=-1))
        q, k = apply_rotary(q, tables), apply_rotary(k, tables)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(y.transpose(1, 2).reshape(b, t, -1))
        gate, up = self.w13(self.mlp_norm(x)).chunk(2, dim=-1)
        mlp: torch.Tensor = self.w2(F.silu(gate) * up)
        return x + mlp


class Llama(nn.Module):
    rotary: torch.Tensor  # cos and sin tables (a non-persistent buffer, `rotary_tables`)

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.blocks = nn.ModuleList(LlamaBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.register_buffer("rotary", rotary_tables(cfg), persistent=False)
        #: Recompute each block in backward (torch.utils.checkpoint, non-reentrant).
        self.activation_checkpointing = False
        for p in self.parameters():
            if p.dim() == 2 and p.device.type != "meta":
                nn.init.normal_(p, std=0.02)

    def reset_parameters(self) -> None:
        """Recompute the rotary tables, the model's own buffer (for meta-device construction,
        where each module is materialised on its own: `fsdp.init_gpt_module` initialises the
        embeddings and projections as this constructor does, normal with std 0.02)."""
        self.rotary = rotary_tables(self.cfg, device=self.rotary.device)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            if self.activation_checkpointing and torch.is_grad_enabled():
                x = checkpoint(block, x, self.rotary, use_reentrant=False)
            else:
                x = block(x, self.rotary)
        logits: torch.Tensor = self.head(self.norm(x))
        return logits
