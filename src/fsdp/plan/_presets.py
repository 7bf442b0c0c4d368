"""Known model shapes for `fsdp plan`: Llama 2 and 3 (7B to 70B) and the GPT-2 sizes.

Each `Architecture` holds what the models' published ``config.json`` says (layers, hidden
size, attention and key/value heads, FFN width, vocabulary, tied embeddings, norm, context
length) and lists every parameter's shape the way the Hugging Face implementation registers
it, so parameter counts are exact: Llama 2 7B has 6,738,415,616 parameters, Llama 3 8B
8,030,261,248, GPT-2 124,439,808 (position embeddings included).

Two families cover them: ``llama`` (RMSNorm, rotary positions, grouped-query attention with
``n_kv_heads * head_dim`` wide key and value projections, SwiGLU's three FFN matrices; Mistral
and Qwen2 are the same up to biases) and ``gpt2`` (LayerNorm, learned positions, a 4x GELU MLP
of two matrices, biases everywhere, tied embeddings).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ._base import PlanError, Shape

__all__ = [
    "Architecture",
    "FAMILIES",
    "PRESETS",
    "ALIASES",
    "DEFAULT_SEQ_LEN_CAP",
    "PRESET_MATCH_TOLERANCE",
    "preset",
    "nearest_preset",
]

FAMILIES = ("llama", "gpt2")
NORMS = ("rmsnorm", "layernorm")
#: The activation estimate's default sequence: the model's context, at most this many tokens
#: (Llama 3's pretraining length; pass ``seq_len`` to plan longer contexts).
DEFAULT_SEQ_LEN_CAP = 8192
#: ``--params N`` alone takes a preset's shape when N is within this share of its count.
PRESET_MATCH_TOLERANCE = 0.10


@dataclass(frozen=True)
class Architecture:
    """A decoder's shape as its ``config.json`` gives it.

    ``head_dim`` defaults to ``d_model // n_heads``; ``qkv_bias``, ``out_bias`` and
    ``mlp_bias`` add biases to the query/key/value, attention output and FFN projections
    (the ``gpt2`` family always has them)."""

    family: str
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    vocab_size: int
    max_seq_len: int
    tie_embeddings: bool
    norm: str
    head_dim: int | None = None
    qkv_bias: bool = False
    out_bias: bool = False
    mlp_bias: bool = False
    name: str = ""

    def __post_init__(self) -> None:
        for field in (
            "n_layers",
            "d_model",
            "n_heads",
            "n_kv_heads",
            "ffn_dim",
            "vocab_size",
            "max_seq_len",
        ):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PlanError("model", f"{field} must be an int >= 1, got {value!r}")
        if self.family not in FAMILIES or self.norm not in NORMS:
            raise PlanError(
                "model",
                f"family must be one of {FAMILIES} and norm one of "
                f"{NORMS}, got {self.family!r} and {self.norm!r}",
            )
        if self.n_heads % self.n_kv_heads:
            raise PlanError(
                "model",
                f"n_heads ({self.n_heads}) must be a multiple of "
                f"n_kv_heads ({self.n_kv_heads}) (grouped-query attention)",
            )
        if self.head_dim is None and self.d_model % self.n_heads:
            raise PlanError(
                "model",
                f"d_model ({self.d_model}) must be a multiple of n_heads "
                f"({self.n_heads}) unless head_dim is given",
            )

    @property
    def attention_head_dim(self) -> int:
        return self.head_dim or self.d_model // self.n_heads

    @property
    def seq_len(self) -> int:
        """The default sequence of the activation estimate (see `DEFAULT_SEQ_LEN_CAP`)."""
        return min(self.max_seq_len, DEFAULT_SEQ_LEN_CAP)

    def block_shapes(self) -> tuple[Shape, ...]:
        """One transformer block's parameter shapes, in registration order."""
        return _gpt2_block(self) if self.family == "gpt2" else _llama_block(self)

    def root_shapes(self) -> tuple[Shape, ...]:
        """The root unit's: embeddings (and learned positions), final norm, untied head."""
        d, v = self.d_model, self.vocab_size
        positions: tuple[Shape, ...] = ((self.max_seq_len, d),) if self.family == "gpt2" else ()
        head: tuple[Shape, ...] = () if self.tie_embeddings else ((v, d),)
        return ((v, d), *positions, *_norm(self), *head)

    @property
    def num_params(self) -> int:
        block = sum(math.prod(s) for s in self.block_shapes())
        return self.n_layers * block + sum(math.prod(s) for s in self.root_shapes())

    def describe(self) -> str:
        """One line for people: layers, width, heads, FFN, vocabulary, embeddings, norm."""
        heads = f"{self.n_heads} heads" + (
            f" ({self.n_kv_heads} kv)" if self.n_kv_heads != self.n_heads else ""
        )
        ffn = "SwiGLU" if self.family == "llama" else "GELU"
        return (
            f"{self.n_layers} layers, d_model {self.d_model}, {heads}, FFN {self.ffn_dim} "
            f"({ffn}), vocab {self.vocab_size}, "
            f"{'tied' if self.tie_embeddings else 'untied'} embeddings, "
            f"{'RMSNorm' if self.norm == 'rmsnorm' else 'LayerNorm'}, "
            f"context {self.max_seq_len}"
        )


def _norm(a: Architecture) -> tuple[Shape, ...]:
    return ((a.d_model,),) if a.norm == "rmsnorm" else ((a.d_model,), (a.d_model,))


def _linear(out: int, inp: int, bias: bool) -> tuple[Shape, ...]:
    return ((out, inp), (out,)) if bias else ((out, inp),)


def _llama_block(a: Architecture) -> tuple[Shape, ...]:
    """q, k, v, o projections, gate/up/down (SwiGLU), then the two norms (Hugging Face's
    ``LlamaDecoderLayer`` order)."""
    d, f, hd = a.d_model, a.ffn_dim, a.attention_head_dim
    q, kv = a.n_heads * hd, a.n_kv_heads * hd
    return (
        *_linear(q, d, a.qkv_bias),
        *_linear(kv, d, a.qkv_bias),
        *_linear(kv, d, a.qkv_bias),
        *_linear(d, q, a.out_bias),
        *_linear(f, d, a.mlp_bias),
        *_linear(f, d, a.mlp_bias),
        *_linear(d, f, a.mlp_bias),
        *_norm(a),
        *_norm(a),
    )


def _gpt2_block(a: Architecture) -> tuple[Shape, ...]:
    """ln_1, c_attn, c_proj, ln_2, c_fc, c_proj; GPT-2's Conv1D weights are (in, out)."""
    d, f = a.d_model, a.ffn_dim
    return (*_norm(a), (d, 3 * d), (3 * d,), (d, d), (d,), *_norm(a), (d, f), (f,), (f, d), (d,))


def _llama(
    name: str, layers: int, d: int, heads: int, kv: int, ffn: int, vocab: int, context: int
) -> Architecture:
    return Architecture(
        "llama", layers, d, heads, kv, ffn, vocab, context, False, "rmsnorm", name=name
    )


def _gpt2(name: str, layers: int, d: int, heads: int) -> Architecture:
    return Architecture(
        "gpt2",
        layers,
        d,
        heads,
        heads,
        4 * d,
        50257,
        1024,
        True,
        "layernorm",
        qkv_bias=True,
        out_bias=True,
        mlp_bias=True,
        name=name,
    )


#: The published configs (``config.json`` of meta-llama/Llama-2-*-hf, Meta-Llama-3(.1)-*,
#: openai-community/gpt2*).
PRESETS: dict[str, Architecture] = {
    a.name: a
    for a in (
        _llama("llama2-7b", 32, 4096, 32, 32, 11008, 32000, 4096),
        _llama("llama2-13b", 40, 5120, 40, 40, 13824, 32000, 4096),
        _llama("llama2-70b", 80, 8192, 64, 8, 28672, 32000, 4096),
        _llama("llama3-8b", 32, 4096, 32, 8, 14336, 128256, 8192),
        _llama("llama3-70b", 80, 8192, 64, 8, 28672, 128256, 8192),
        _llama("llama3.1-8b", 32, 4096, 32, 8, 14336, 128256, 131072),
        _llama("llama3.1-70b", 80, 8192, 64, 8, 28672, 128256, 131072),
        _gpt2("gpt2", 12, 768, 12),
        _gpt2("gpt2-medium", 24, 1024, 16),
        _gpt2("gpt2-large", 36, 1280, 20),
        _gpt2("gpt2-xl", 48, 1600, 25),
    )
}

#: Other spellings of the presets.
ALIASES: dict[str, str] = {
    **{n.replace("llama", "llama-", 1): n for n in PRESETS if n.startswith("llama")},
    "gpt2-small": "gpt2",
    "gpt2-124m": "gpt2",
}


def preset(name: str) -> Architecture | None:
    """The preset called ``name`` (case-insensitive, aliases too), or None."""
    key = name.strip().lower()
    return PRESETS.get(ALIASES.get(key, key))


def nearest_preset(total: int, tolerance: float = PRESET_MATCH_TOLERANCE) -> Architecture | None:
    """The preset whose parameter count is nearest ``total``, if within ``tolerance`` of it
    (the first listed among equal counts)."""
    best: tuple[float, Architecture] | None = None
    for arch in PRESETS.values():
        off = abs(total - arch.num_params) / arch.num_params
        if off <= tolerance and (best is None or off < best[0]):
            best = (off, arch)
    return None if best is None else best[1]
