"""A GPT-style decoder used by ``fsdp train`` and the comparison benchmarks.

Pre-norm blocks (causal self-attention through ``scaled_dot_product_attention``, a 4x GELU
MLP), learned positions, optionally tied input and output embeddings. Each `Block` is the
natural FSDP unit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["GPTConfig", "GPT", "Block", "MODEL_SIZES", "init_gpt_module"]


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 8192
    seq_len: int = 128
    d_model: int = 512
    n_heads: int = 8
    n_layers: int = 8
    tie_embeddings: bool = False  # untied by default, as in the reference timings (NOTES.md)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "d_model", "n_heads", "n_layers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be an int >= 1, got {value!r}")
        if self.d_model % self.n_heads:
            raise ValueError(
                f"GPTConfig: d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})"
            )

    @property
    def num_params(self) -> int:
        d, v = self.d_model, self.vocab_size
        block = 12 * d * d + 13 * d
        head = 0 if self.tie_embeddings else v * d
        return v * d + head + self.seq_len * d + self.n_layers * block + 2 * d


#: Named sizes (``fsdp train --model NAME``); "8x512" is the reference benchmark model.
MODEL_SIZES: dict[str, GPTConfig] = {
    "tiny": GPTConfig(vocab_size=256, seq_len=64, d_model=64, n_heads=4, n_layers=2),
    "small": GPTConfig(vocab_size=256, seq_len=128, d_model=256, n_heads=4, n_layers=4),
    "8x512": GPTConfig(),
    "200m": GPTConfig(vocab_size=8192, seq_len=128, d_model=1024, n_heads=16, n_layers=16),
    "1b": GPTConfig(vocab_size=32768, seq_len=512, d_model=2048, n_heads=16, n_layers=18),
}


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.n_heads = cfg.n_heads
        self.head_dim = d // cfg.n_heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Shapes come from the projection, and heads are counted from it (-1): under tensor
        # parallelism ``x`` is this rank's part of the sequence (sequence parallelism) and
        # ``qkv`` yields this rank's heads only, [q; k; v] of them (fsdp.models._tp_plan).
        qkv = self.qkv(self.ln1(x))
        b, t = qkv.shape[:2]
        q, k, v = (z.view(b, t, -1, self.head_dim).transpose(1, 2) for z in qkv.chunk(3, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, -1))
        mlp: torch.Tensor = self.out(F.gelu(self.fc(self.ln2(x))))
        return x + mlp


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.tok.weight
        #: Recompute each block in backward (torch.utils.checkpoint, non-reentrant).
        self.activation_checkpointing = False
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2 style initialisation (normal, std 0.02; residual projections scaled)."""
        for name, p in self.named_parameters():
            if p.device.type == "meta":
                continue
            if p.dim() >= 2:
                std = (
                    0.02 / math.sqrt(2 * self.cfg.n_layers)
                    if name.endswith(("proj.weight", "out.weight"))
                    else 0.02
                )
                nn.init.normal_(p, std=std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for block in self.blocks:
            if self.activation_checkpointing and torch.is_grad_enabled():
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        logits: torch.Tensor = self.head(self.ln_f(x))
        return logits


def init_gpt_module(module: nn.Module) -> None:
    """Initialise one module's own parameters GPT-2 style (for meta-device construction,
    where modules are materialised one unit at a time)."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)
        if (bias := getattr(module, "bias", None)) is not None:
            nn.init.zeros_(bias)
    elif (reset := getattr(module, "reset_parameters", None)) is not None:
        reset()
