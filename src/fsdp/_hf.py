"""Hugging Face transformers models for ``fsdp train --hf-config`` (optional: needs
``pip install "fsdp[hf]"``). Models are built from a config with random weights (nothing is
downloaded); their blocks (the classes the model lists in ``_no_split_modules``) become FSDP
units.

A spec is a local ``config.json`` path or ``MODEL_TYPE[:key=value,...]``, for example
``gpt2:n_layer=4,n_embd=256,n_head=4`` or ``llama:num_hidden_layers=2,hidden_size=128``.
The vocabulary is set to 256 (the byte-level training data).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

__all__ = ["HFModel", "build_hf_model", "parse_hf_spec"]

BYTE_VOCAB = 256


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def parse_hf_spec(spec: str) -> Any:
    """A transformers config from a ``config.json`` path or ``MODEL_TYPE[:k=v,...]``."""
    try:
        from transformers import AutoConfig
    except ImportError:
        raise ValueError('--hf-config needs transformers: pip install "fsdp[hf]"') from None
    path = Path(spec)
    if path.is_file():
        kwargs = json.loads(path.read_text())
        model_type = kwargs.pop("model_type", None)
        if model_type is None:
            raise ValueError(f"--hf-config: {spec} has no model_type")
    else:
        model_type, _, rest = spec.partition(":")
        pairs = [p.split("=", 1) for p in rest.split(",") if p]
        bad = [p[0] for p in pairs if len(p) != 2]
        if bad:
            raise ValueError(f"--hf-config: expected key=value, got {bad} in {spec!r}")
        kwargs = {k.strip(): _value(v.strip()) for k, v in pairs}
    kwargs["vocab_size"] = BYTE_VOCAB
    try:
        return AutoConfig.for_model(model_type, **kwargs)
    except ValueError as exc:
        raise ValueError(f"--hf-config: {exc}") from None


@dataclass
class HFModel:
    model: nn.Module
    blocks: list[nn.Module]
    max_positions: int
    description: dict[str, Any]


def build_hf_model(spec: str) -> HFModel:
    """The causal LM of ``spec`` with random weights, and its block modules."""
    from transformers import AutoModelForCausalLM

    config = parse_hf_spec(spec)
    model = AutoModelForCausalLM.from_config(config)
    names = set(getattr(model, "_no_split_modules", None) or [])
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    if not blocks:
        raise ValueError(f"--hf-config: {type(model).__name__} names no block classes "
                         "(_no_split_modules); it cannot be wrapped per block")
    positions = getattr(config, "n_positions", None) or getattr(
        config, "max_position_embeddings", None) or 1024
    description = {"hf_config": spec, "model_type": config.model_type,
                   "params": sum(p.numel() for p in model.parameters())}
    return HFModel(model, blocks, int(positions), description)
