"""Model FLOPs utilisation (MFU): the model's FLOPs per second over the hardware's peak.

``mfu = flops_per_token * tokens_per_s / (peak_tflops * 1e12 * world_size)``: the peak is
per device (``--peak-tflops``, or a detected GPU's dense bf16/fp16/TF32 figure), times the
devices training. Only the model's own FLOPs count: activation checkpointing's recomputation
is not useful work, so it lowers MFU, as it should.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = [
    "ModelShape",
    "model_shape",
    "flops_per_token",
    "model_flops_utilization",
    "detect_peak_tflops",
    "device_peak",
    "PEAK_TFLOPS",
]


@dataclass(frozen=True)
class ModelShape:
    """What the FLOPs formula needs: matmul parameters, layers, width."""

    params: int  # parameters that multiply activations (embedding lookups excluded)
    n_layers: int
    d_model: int


def model_shape(model: nn.Module, n_layers: int, d_model: int) -> ModelShape:
    """The shape of an unsharded (or meta) ``model``. Embedding tables are lookups, not
    matmuls, and are left out, unless the same tensor is also a linear layer's weight (a tied
    output head), which is a matmul."""
    params = {id(p): p.numel() for p in model.parameters()}
    linear = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
    for m in model.modules():
        if isinstance(m, nn.Embedding) and id(m.weight) not in linear:
            params.pop(id(m.weight), None)
    return ModelShape(sum(params.values()), n_layers, d_model)


def flops_per_token(shape: ModelShape, seq_len: int) -> float:
    """Training FLOPs per token: ``6 * N + 12 * n_layers * seq_len * d_model``.

    The formula of the PaLM paper (Chowdhery et al., 2022, "PaLM: Scaling Language Modeling
    with Pathways", appendix B): 6N for the forward (2N) and backward (4N) matmuls with the
    ``N`` matmul parameters, plus the attention scores and their weighted sum, which grow with
    the sequence length (causal masking not discounted, as in the paper).
    """
    return 6.0 * shape.params + 12.0 * shape.n_layers * seq_len * shape.d_model


def model_flops_utilization(
    flops_per_tok: float, tokens_per_s: float, peak_tflops: float, world_size: int
) -> float:
    """The fraction (0..1) of ``world_size`` devices' peak (``peak_tflops`` each) that
    ``tokens_per_s`` tokens a second of ``flops_per_tok`` FLOPs each use."""
    if not (math.isfinite(peak_tflops) and peak_tflops > 0):
        raise ValueError(f"peak_tflops must be a finite number > 0, got {peak_tflops!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size!r}")
    return flops_per_tok * tokens_per_s / (peak_tflops * 1e12 * world_size)


#: Dense peak TFLOP/s per device (no sparsity) from the vendors' data sheets:
#: (device name pattern, bf16/fp16 tensor cores, TF32 tensor cores, plain fp32). The first
#: pattern matching ``torch.cuda.get_device_name`` wins, so variants come before families.
PEAK_TFLOPS: tuple[tuple[str, float, float, float], ...] = (
    (r"H200", 989.0, 494.5, 66.9),
    (r"H100.*PCIe", 756.0, 378.0, 51.2),
    (r"H100.*NVL", 835.0, 417.5, 60.0),
    (r"H100|H800", 989.0, 494.5, 66.9),
    (r"A100|A800", 312.0, 156.0, 19.5),
    (r"L40S", 362.0, 183.0, 91.6),
    (r"\bL4\b", 121.0, 60.0, 30.3),
)


def detect_peak_tflops(
    device_name: str, dtype: torch.dtype, allow_tf32: bool | None = None
) -> float | None:
    """The dense peak of one ``device_name`` GPU computing in ``dtype``, None if unknown.
    fp32 matmuls use TF32 tensor cores only when ``allow_tf32`` (default: torch's
    ``torch.backends.cuda.matmul.allow_tf32``)."""
    for pattern, half, tf32, fp32 in PEAK_TFLOPS:
        if re.search(pattern, device_name):
            if dtype in (torch.bfloat16, torch.float16):
                return half
            if allow_tf32 is None:
                allow_tf32 = torch.backends.cuda.matmul.allow_tf32
            return tf32 if allow_tf32 else fp32
    return None


def device_peak(
    peak_tflops: float | None, device: Any, dtype: torch.dtype
) -> tuple[float | None, str]:
    """The per-device peak MFU is measured against, and where it comes from (or, when it is
    None, why MFU is unknown): ``--peak-tflops``, else the table for a CUDA ``device``."""
    if peak_tflops is not None:
        return peak_tflops, f"--peak-tflops {peak_tflops:g} per device"
    device = torch.device(device)
    if device.type != "cuda":
        return None, (
            f"MFU unknown: no peak FLOP/s is known for {device.type} devices; pass --peak-tflops"
        )
    name = torch.cuda.get_device_name(device)
    peak = detect_peak_tflops(name, dtype)
    if peak is None:
        return None, f"MFU unknown: no peak FLOP/s is known for {name}; pass --peak-tflops"
    return peak, f"{name} dense {str(dtype).removeprefix('torch.')} peak {peak:g} TFLOP/s"
