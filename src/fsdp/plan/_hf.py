"""Reading a Hugging Face ``config.json`` into an `Architecture` for ``fsdp plan --hf-config``.

Plain JSON, no transformers import: ``model_type`` llama, mistral and qwen2 (grouped-query
attention, SwiGLU; Qwen2 adds query/key/value biases) read ``num_hidden_layers``,
``hidden_size``, ``num_attention_heads``, ``num_key_value_heads``, ``intermediate_size``,
``vocab_size``, ``tie_word_embeddings`` and ``max_position_embeddings`` (and ``head_dim``, and
Llama's ``attention_bias`` and ``mlp_bias``, where given); gpt2 reads ``n_layer``, ``n_embd``,
``n_head``, ``n_inner`` (default ``4 * n_embd``), ``vocab_size`` and ``n_positions``. Keys that
transformers defaults (key/value heads, tied embeddings, biases) take its defaults when missing.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ._base import PlanError
from ._presets import Architecture

__all__ = ["SUPPORTED_MODEL_TYPES", "read_hf_config"]

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "gpt2")
_ARG = "hf_config"


def read_hf_config(path: str | os.PathLike[str]) -> Architecture:
    """The `Architecture` of ``path``: a ``config.json`` or a directory holding one. Raises
    `PlanError` (argument ``hf_config``) naming the file and what is wrong with it."""
    file = _config_file(Path(path))
    data = _load(file)
    model_type = data.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise PlanError(
            _ARG,
            f"{file}: model_type {model_type!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}",
        )
    read = _gpt2 if model_type == "gpt2" else _llama_like
    try:
        return read(_Keys(data, file, model_type))
    except PlanError as exc:
        if exc.argument == _ARG:
            raise
        raise PlanError(_ARG, f"{file}: {exc.message}") from None


def _config_file(path: Path) -> Path:
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        where = f"no config.json in directory {path}" if path.is_dir() else f"no such file: {path}"
        raise PlanError(_ARG, f"{where} (give a Hugging Face model directory or its config.json)")
    return file


def _load(file: Path) -> dict[str, Any]:
    try:
        data = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PlanError(_ARG, f"{file} is not readable JSON: {exc}") from None
    if not isinstance(data, dict):
        raise PlanError(_ARG, f"{file} must hold a JSON object, got {type(data).__name__}")
    return data


class _Keys:
    """A config's values, with errors naming the key and the file."""

    def __init__(self, data: dict[str, Any], file: Path, model_type: str) -> None:
        self.data, self.file, self.model_type = data, file, model_type

    def int(self, key: str, default: int | None = None) -> int:
        value = self.data.get(key)
        if value is None:
            if default is not None:
                return default
            raise PlanError(
                _ARG, f"{self.file} has no {key!r} (model_type {self.model_type} needs it)"
            )
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise PlanError(_ARG, f"{self.file}: {key} must be an int >= 1, got {value!r}")
        return value

    def flag(self, key: str, default: bool) -> bool:
        value = self.data.get(key, default)
        if not isinstance(value, bool):
            raise PlanError(_ARG, f"{self.file}: {key} must be true or false, got {value!r}")
        return value

    def name(self) -> str:
        given = self.data.get("_name_or_path")
        return given if isinstance(given, str) and given else str(self.file.parent.name)


def _biases(k: _Keys) -> tuple[bool, bool, bool]:
    """(qkv, attention output, MLP) biases: Llama's ``attention_bias`` and ``mlp_bias``;
    Qwen2's query/key/value projections always have one; Mistral has none."""
    if k.model_type == "llama":
        attention = k.flag("attention_bias", False)
        return attention, attention, k.flag("mlp_bias", False)
    return k.model_type == "qwen2", False, False


def _llama_like(k: _Keys) -> Architecture:
    heads = k.int("num_attention_heads")
    qkv, out, mlp = _biases(k)
    return Architecture(
        "llama",
        k.int("num_hidden_layers"),
        k.int("hidden_size"),
        heads,
        k.int("num_key_value_heads", heads),
        k.int("intermediate_size"),
        k.int("vocab_size"),
        k.int("max_position_embeddings"),
        k.flag("tie_word_embeddings", False),
        "rmsnorm",
        head_dim=None if k.data.get("head_dim") is None else k.int("head_dim"),
        qkv_bias=qkv,
        out_bias=out,
        mlp_bias=mlp,
        name=f"{k.name()} ({k.model_type})",
    )


def _gpt2(k: _Keys) -> Architecture:
    d = k.int("n_embd")
    return Architecture(
        "gpt2",
        k.int("n_layer"),
        d,
        k.int("n_head"),
        k.int("n_head"),
        k.int("n_inner", 4 * d),
        k.int("vocab_size"),
        k.int("n_positions"),
        k.flag("tie_word_embeddings", True),
        "layernorm",
        qkv_bias=True,
        out_bias=True,
        mlp_bias=True,
        name=f"{k.name()} (gpt2)",
    )
