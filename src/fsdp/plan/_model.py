"""`ModelShape`: what `fsdp plan` needs of a model (its units' parameter shapes), from a named
size of ``fsdp train``, a preset (`fsdp.plan._presets`), a Hugging Face ``config.json``, a
`GPTConfig`, or a bare parameter count.

A bare count (``--params 70B``) takes the shape of the preset whose count is within 10% of it
(Llama 3 70B's, say) and says so; with no preset that near, or with ``layers``, ``d_model`` or
``vocab_size`` given, the shape is solved Llama-like from the count and marked as a guess.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Protocol, cast

from ._base import PlanError, Shape, as_shape, human_count, parse_count, positive
from ._presets import PRESETS, Architecture, nearest_preset, preset

__all__ = [
    "ModelShape",
    "TensorCuts",
    "resolve_model",
    "DEFAULT_VOCAB",
    "DEFAULT_SEQ_LEN",
    "D_MODEL_PER_LAYER",
    "CUTS",
]

#: Llama-like proportions used to guess a shape from a bare parameter count.
DEFAULT_VOCAB = 32000
DEFAULT_SEQ_LEN = 2048
D_MODEL_PER_LAYER = 128


#: How tensor parallelism holds one parameter (`TensorCuts`): ``"rows"`` (dim 0 cut over the
#: tp ranks: column-parallel weights and biases, embeddings and the head cut by vocabulary),
#: ``"cols"`` (dim 1 cut: row-parallel weights), ``"whole"`` (every tp rank holds all of it:
#: a row-parallel bias) or ``"norm"`` (whole on every tp rank; under sequence parallelism
#: each rank's gradient covers its tokens only and is summed over the tp group).
CUTS = ("rows", "cols", "whole", "norm")


@dataclass(frozen=True)
class TensorCuts:
    """How tensor parallelism cuts a model (Megatron-style, `fsdp.models._tp_plan` for the built-in
    models): one of `CUTS` for each parameter of ``block_params`` and of ``root_params``, in
    their order; ``counts``: (what, count) pairs that must be divisible by the tp size (the
    heads, the FFN width)."""

    block: tuple[str, ...]
    root: tuple[str, ...]
    counts: tuple[tuple[str, int], ...] = ()
    positions: bool = False  # learned positions, the root's second parameter (seq, d_model)


def _linear_cuts(cut: str, bias: bool) -> tuple[str, ...]:
    """A column-parallel (``"rows"``) or row-parallel (``"cols"``) Linear's weight and bias
    cuts; a row-parallel bias is added once, after the reduction (``"whole"``)."""
    return (cut, cut if cut == "rows" else "whole") if bias else (cut,)


def _architecture_cuts(arch: Architecture) -> TensorCuts:
    """`TensorCuts` of a preset's or a ``config.json``'s shapes, in the order of
    `Architecture.block_shapes` and `Architecture.root_shapes` (Hugging Face's)."""
    norm = ("norm",) * (1 if arch.norm == "rmsnorm" else 2)
    if arch.family == "gpt2":  # Conv1D weights are (in, out): the cut dims swap
        block = (*norm, "cols", "rows", "rows", "whole", *norm, "cols", "rows", "rows", "whole")
    else:
        qkv = _linear_cuts("rows", arch.qkv_bias) * 3
        block = (
            *qkv,
            *_linear_cuts("cols", arch.out_bias),
            *_linear_cuts("rows", arch.mlp_bias),
            *_linear_cuts("rows", arch.mlp_bias),
            *_linear_cuts("cols", arch.mlp_bias),
            *norm,
            *norm,
        )
    positions = ("rows",) if arch.family == "gpt2" else ()
    head = () if arch.tie_embeddings else ("rows",)
    counts = (
        ("attention heads", arch.n_heads),
        ("key/value heads", arch.n_kv_heads),
        ("FFN width", arch.ffn_dim),
    )
    return TensorCuts(block, ("rows", *positions, *norm, *head), counts, bool(positions))


class _ConfigLike(Protocol):
    """What the planner reads of a `GPTConfig`."""

    @property
    def vocab_size(self) -> int: ...
    @property
    def seq_len(self) -> int: ...
    @property
    def d_model(self) -> int: ...
    @property
    def n_layers(self) -> int: ...
    @property
    def tie_embeddings(self) -> bool: ...
    @property
    def n_heads(self) -> int: ...


@dataclass(frozen=True)
class ModelShape:
    """What the planner needs of a model: its units' parameter shapes and activation sizes.

    ``block_params``: shapes of one transformer block's parameters, in flattening order (every
    block is one unit, ``n_layers`` of them; a bare count is a 1-D parameter);
    ``root_params``: the root unit's (embeddings, final norm, head). ``largest_unit``
    overrides the block size in the transient term when units are not all alike. ``note``
    says where a shape came from when it was not given exactly (a preset taken for a count, a
    guess); ``architecture``: the full description, for presets and config files.
    """

    name: str
    block_params: tuple[Shape, ...]
    n_layers: int
    root_params: tuple[Shape, ...]
    d_model: int
    vocab_size: int
    seq_len: int
    largest_unit: int | None = None
    note: str = ""
    architecture: Architecture | None = None
    cuts: TensorCuts | None = None  # None: tensor parallelism divides every parameter

    def __post_init__(self) -> None:
        for name in ("block_params", "root_params"):
            shapes = tuple(as_shape(p) for p in getattr(self, name))
            object.__setattr__(self, name, shapes)

    @property
    def block_numel(self) -> int:
        return sum(math.prod(s) for s in self.block_params)

    @property
    def root_numel(self) -> int:
        return sum(math.prod(s) for s in self.root_params)

    @property
    def total_params(self) -> int:
        return self.root_numel + self.n_layers * self.block_numel

    @property
    def max_unit_numel(self) -> int:
        """The largest non-root unit, ``max(psi_i)`` of Section 3.2.1."""
        return self.largest_unit or self.block_numel

    @classmethod
    def from_config(cls, config: _ConfigLike, *, name: str = "") -> ModelShape:
        """The exact parameter shapes of `fsdp.GPT` built from ``config`` (a `GPTConfig`)."""
        d, v, s = config.d_model, config.vocab_size, config.seq_len
        block = (
            (d,),
            (d,),
            (3 * d, d),
            (3 * d,),
            (d, d),
            (d,),
            (d,),
            (d,),
            (4 * d, d),
            (4 * d,),
            (d, 4 * d),
            (d,),
        )
        head: tuple[Shape, ...] = () if config.tie_embeddings else ((v, d),)
        root = ((v, d), (s, d), (d,), (d,), *head)
        label = name or f"GPT {config.n_layers}x{d}"
        cuts = TensorCuts(
            (
                "norm",
                "norm",
                "rows",
                "rows",
                "cols",
                "whole",
                "norm",
                "norm",
                "rows",
                "rows",
                "cols",
                "whole",
            ),
            ("rows", "rows", "norm", "norm", *(("rows",) if head else ())),
            (("attention heads", config.n_heads), ("FFN width", 4 * d)),
            positions=True,
        )
        return cls(label, block, config.n_layers, root, d, v, s, cuts=cuts)

    @classmethod
    def from_llama_config(cls, config: Any, *, name: str = "") -> ModelShape:
        """The exact parameter shapes of `fsdp.Llama` built from ``config`` (a
        `LlamaConfig`: fused ``wqkv`` and ``w13`` projections, RMSNorm, untied head)."""
        d, v, f = config.dim, config.vocab_size, config.ffn_dim
        block = ((d,), (3 * d, d), (d, d), (d,), (2 * f, d), (d, f))
        cuts = TensorCuts(
            ("norm", "rows", "cols", "norm", "rows", "cols"),
            ("rows", "norm", "rows"),
            (("attention heads", config.n_heads), ("FFN width", f)),
        )
        return cls(
            name or f"Llama {config.n_layers}x{d}",
            block,
            config.n_layers,
            ((v, d), (d,), (v, d)),
            d,
            v,
            config.seq_len,
            cuts=cuts,
        )

    @classmethod
    def from_architecture(cls, arch: Architecture, *, note: str = "") -> ModelShape:
        """A preset's or a ``config.json``'s shapes (`fsdp.plan._presets.Architecture`)."""
        return cls(
            arch.name,
            arch.block_shapes(),
            arch.n_layers,
            arch.root_shapes(),
            arch.d_model,
            arch.vocab_size,
            arch.seq_len,
            note=note,
            architecture=arch,
            cuts=_architecture_cuts(arch),
        )

    @classmethod
    def from_hf_config(cls, path: str | os.PathLike[str]) -> ModelShape:
        """A Hugging Face ``config.json`` (or a directory holding one), read as plain JSON."""
        from ._hf import read_hf_config

        return cls.from_architecture(read_hf_config(path))

    @classmethod
    def from_name(cls, name: str) -> ModelShape:
        """A named size of ``fsdp train --model`` (`fsdp.models._gpt.MODEL_SIZES`, and the Llama
        sizes as ``llama-NAME``) or a preset."""
        from ..models import LLAMA_SIZES, MODEL_SIZES

        if name in MODEL_SIZES:
            return cls.from_config(MODEL_SIZES[name], name=name)
        if name.startswith("llama-") and name[6:] in LLAMA_SIZES:
            return cls.from_llama_config(LLAMA_SIZES[name[6:]], name=name)
        found = preset(name)
        if found is None:
            llamas = ", ".join(f"llama-{n}" for n in LLAMA_SIZES)
            raise PlanError(
                "model",
                f"unknown model {name!r}; choose a size of fsdp train "
                f"({', '.join(MODEL_SIZES)}, {llamas}), a preset "
                f"({', '.join(PRESETS)}) or give a parameter count",
            )
        return cls.from_architecture(found)

    @classmethod
    def from_params(
        cls,
        total: int,
        *,
        layers: int | None = None,
        d_model: int | None = None,
        vocab_size: int | None = None,
        seq_len: int | None = None,
        largest_unit: int | None = None,
    ) -> ModelShape:
        """A decoder of ``total`` parameters: ``layers`` equal blocks plus a root of untied
        input and output embeddings (``2 * vocab_size * d_model``).

        What is not given is guessed from Llama-like proportions: a block holds about
        ``12 d^2`` parameters and ``d_model = 128 * layers`` (then ``note`` says so)."""
        vocab = positive(DEFAULT_VOCAB if vocab_size is None else vocab_size, "vocab_size")
        guessed = [n for n, v in (("layers", layers), ("d_model", d_model)) if v is None]
        layers, d = _shape_of(total, layers, d_model, vocab)
        block = (total - 2 * vocab * d) // layers
        if block < 1:
            raise PlanError(
                "params",
                f"{total:,} parameters leave nothing for {layers} blocks "
                f"after embeddings of 2 x {vocab} x {d}; give a smaller vocabulary "
                "or d_model",
            )
        if largest_unit is not None:
            positive(largest_unit, "largest_unit")
        note = (
            f"{' and '.join(guessed)} guessed from the count (Llama-like: about 12 d^2 per "
            "block, d_model = 128 x layers); pass --layers and --d-model for the real "
            "shape"
            if guessed
            else ""
        )
        return cls(
            f"{human_count(total)} decoder",
            ((block,),),
            layers,
            ((total - layers * block,),),
            d,
            vocab,
            seq_len or DEFAULT_SEQ_LEN,
            largest_unit,
            note,
        )


def _shape_of(total: int, layers: int | None, d_model: int | None, vocab: int) -> tuple[int, int]:
    """(layers, d_model) of a ``total``-parameter decoder, solving
    ``total = 12 * layers * d^2 + 2 * vocab * d`` for what is missing."""
    if layers is not None:
        positive(layers, "layers")
    if d_model is not None:
        positive(d_model, "d_model")
    if layers is not None and d_model is not None:
        return layers, d_model
    if layers is not None:  # quadratic in d
        a, b = 12 * layers, 2 * vocab
        return layers, max(1, round((-b + math.sqrt(b * b + 4 * a * total)) / (2 * a)))
    if d_model is not None:
        return max(1, round((total - 2 * vocab * d_model) / (12 * d_model**2))), d_model
    lo, hi = 1.0, 1e6  # 12 d^3 / 128 + 2 vocab d = total, increasing in d
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (
            (mid, hi) if 12 * mid**3 / D_MODEL_PER_LAYER + 2 * vocab * mid < total else (lo, mid)
        )
    d = max(1, round(lo))
    return max(1, round(d / D_MODEL_PER_LAYER)), d


def _from_count(total: int, hints: dict[str, int | None], seq_len: int | None) -> ModelShape:
    """A bare count: the nearest preset's shape when no shape is hinted and one is within
    10%, else `ModelShape.from_params`."""
    found = None if any(v is not None for v in hints.values()) else nearest_preset(total)
    if found is None:
        return ModelShape.from_params(total, seq_len=seq_len, **hints)
    off = (found.num_params - total) / total
    note = (
        f"{human_count(total)} parameters: using preset {found.name}'s shape "
        f"({found.num_params:,} parameters, {off:+.1%}); pass --layers and --d-model "
        "for another shape"
    )
    return ModelShape.from_architecture(found, note=note)


def resolve_model(
    model: object,
    *,
    layers: int | None = None,
    d_model: int | None = None,
    vocab_size: int | None = None,
    largest_unit: int | None = None,
    seq_len: int | None = None,
) -> ModelShape:
    """A `ModelShape` from what `fsdp.plan._plan.plan` was given (see there)."""
    hints: dict[str, Any] = {
        "layers": layers,
        "d_model": d_model,
        "vocab_size": vocab_size,
        "largest_unit": largest_unit,
    }
    if isinstance(model, (int, float)) and not isinstance(model, bool):
        return _from_count(parse_count(model), hints, seq_len)
    for name, value in hints.items():
        if value is not None:
            raise PlanError(name, "applies to a model given as a parameter count only")
    if isinstance(model, ModelShape):
        return model
    if isinstance(model, Architecture):
        return ModelShape.from_architecture(model)
    if isinstance(model, str):
        return ModelShape.from_name(model)
    if all(hasattr(model, a) for a in ("d_model", "n_layers", "vocab_size", "seq_len")):
        return ModelShape.from_config(cast(_ConfigLike, model))
    raise PlanError(
        "model",
        "must be a name, a GPTConfig, an Architecture, a ModelShape or a "
        f"parameter count, got {type(model).__name__}",
    )
