"""`fsdp plan`: per-GPU memory and communication of one FSDP training step, before you run it.

The planner is arithmetic only (no tensors, no GPU): it follows the FSDP paper (Zhao et al.,
"PyTorch FSDP", VLDB 2023, arXiv 2304.11277) and the way this engine lays units out.

Memory (Section 3.2.1): every rank keeps ``sum(psi_i) / F`` of the parameters (``psi_i`` the
padded FlatParameter of unit ``i``, ``F`` the sharding factor), and the same share of gradients
and optimizer state; it materialises the largest unit ``max(psi_i)`` while that unit computes.
Here the rate limiter lets two gathered units be in flight (the one computing and the one
prefetched) and the root unit (embeddings, final norm, head) stays gathered from forward to
backward, so the transient parameter term is ``root + 2 * max(psi_i)``.

Communication (Sections 3.2.1 and 3.2.2): full sharding all-gathers each unit in forward and again
in backward and reduce-scatters its gradient: about ``3M(W-1)/W`` bytes per GPU for a model of
``M`` bytes on ``W`` GPUs with ring collectives, 1.5x DDP's ``2M(W-1)/W``. Hybrid sharding
keeps those collectives inside a shard group (a node of ``G`` GPUs) and all-reduces the
gradient shards across the replicas, so only ``2(M/G)(R-1)/R = 2M(W-G)/(GW)`` bytes per GPU
cross nodes (the paper writes ``2M(W-1)/(GW)``, which bounds it from above).

Use `plan` (or ``fsdp plan`` on the command line)::

    from fsdp._plan import plan
    p = plan("1b", gpus=64, gpus_per_node=8, strategy="hybrid_shard", param_dtype="bf16",
             gpu_memory="80GB")
    p.memory.total, p.comm.cross_node_bytes, p.recommendation.text
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Protocol, cast

__all__ = [
    "STRATEGIES",
    "ModelShape",
    "PlanConfig",
    "PlanError",
    "MemoryBreakdown",
    "Collective",
    "CommVolume",
    "Recommendation",
    "Plan",
    "plan",
    "padded_numel",
    "parse_count",
    "parse_memory",
    "dtype_bytes",
    "format_bytes",
]

STRATEGIES = ("full_shard", "shard_grad_op", "no_shard", "hybrid_shard")

#: The engine's FlatParameter alignment: every parameter and every shard starts on 16 bytes.
ALIGN_BYTES = 16
#: Gathered units in flight at once besides the root (the rate limiter's default count).
GATHERS_IN_FLIGHT = 2
#: Reduce-scatter outputs alive at once (one being reduced, one being drained).
REDUCTIONS_IN_FLIGHT = 2
#: Values saved per token per transformer block, in units of d_model (see `_block_activations`).
ACTIVATION_VALUES_PER_TOKEN = 16
#: Share of a GPU's memory a plan may use (the rest: CUDA context, NCCL buffers, fragmentation).
USABLE_FRACTION = 0.9
#: Llama-like proportions used to guess a shape from a bare parameter count.
DEFAULT_VOCAB = 32000
DEFAULT_SEQ_LEN = 2048
D_MODEL_PER_LAYER = 128

_DTYPES = {"fp64": 8, "float64": 8, "double": 8, "fp32": 4, "float32": 4, "float": 4,
           "tf32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "half": 2,
           "fp8": 1, "float8": 1}


class PlanError(ValueError):
    """A bad planner input; ``argument`` names it (the keyword of `plan`)."""

    def __init__(self, argument: str, message: str) -> None:
        super().__init__(f"{argument}: {message}")
        self.argument = argument
        self.message = message


def dtype_bytes(dtype: object, *, argument: str = "dtype") -> int:
    """Bytes per element of a dtype given as ``"bf16"``, ``"float32"`` or a ``torch.dtype``."""
    name = str(dtype).lower().removeprefix("torch.")
    if name not in _DTYPES:
        raise PlanError(argument, f"unknown dtype {dtype!r}; use one of fp32, bf16, fp16, fp64, "
                        "fp8")
    return _DTYPES[name]


def _dtype_name(dtype: object) -> str:
    name = str(dtype).lower().removeprefix("torch.")
    return {"float32": "fp32", "float": "fp32", "bfloat16": "bf16", "float16": "fp16",
            "half": "fp16", "float64": "fp64", "double": "fp64", "float8": "fp8"}.get(name, name)


_COUNT = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([kmbt]?)\s*$", re.IGNORECASE)
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)


def parse_count(text: str | int | float, *, argument: str = "params") -> int:
    """A parameter count: ``7000000000``, ``7e9``, ``7B``, ``350M``, ``1.5k``."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
    else:
        match = _COUNT.match(str(text))
        if not match:
            raise PlanError(argument, f"not a count: {text!r} (examples: 7e9, 7B, 350M)")
        scale = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}[match.group(2).lower()]
        value = float(match.group(1)) * scale
    if not math.isfinite(value) or value < 1:
        raise PlanError(argument, f"must be a positive count, got {text!r}")
    return int(round(value))


def parse_memory(text: str | int | float, *, argument: str = "gpu_memory") -> int:
    """GPU memory in bytes from ``80``, ``"80GB"``, ``"80GiB"`` or ``"81920MiB"``.

    A bare number is GiB. GB is read as GiB too, as GPU makers use it (an "80GB" A100 has
    81920 MiB)."""
    match = _SIZE.match(str(text)) if not isinstance(text, bool) else None
    if not match:
        raise PlanError(argument, f"not a memory size: {text!r} (examples: 80, 80GB, 40GiB)")
    unit = (match.group(2) or "g").lower()[:1]
    scale = {"b": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}[unit]
    value = float(match.group(1)) * scale
    if value <= 0:
        raise PlanError(argument, f"must be positive, got {text!r}")
    return int(value)


def padded_numel(numels: Sequence[int], *, shard_count: int, itemsize: int) -> int:
    """Elements of one unit's FlatParameter, padding included (Section 3.2.1, Fig. 3).

    Mirrors the engine: each parameter starts at a 16-byte aligned offset, and the total is
    right-padded to ``shard_count`` equal chunks, each a multiple of the alignment."""
    align = max(1, ALIGN_BYTES // itemsize)
    offset = 0
    for n in numels:
        offset = -(-offset // align) * align + n
    chunk = max(1, -(-offset // shard_count))
    return -(-chunk // align) * align * shard_count


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


@dataclass(frozen=True)
class ModelShape:
    """What the planner needs of a model: its units' parameter sizes and activation sizes.

    ``block_params``: numels of one transformer block's parameters, in flattening order (every
    block is one unit, ``n_layers`` of them); ``root_params``: the root unit's (embeddings,
    final norm, head). ``largest_unit`` overrides the block size in the transient term when
    units are not all alike.
    """

    name: str
    block_params: tuple[int, ...]
    n_layers: int
    root_params: tuple[int, ...]
    d_model: int
    vocab_size: int
    seq_len: int
    largest_unit: int | None = None

    @property
    def block_numel(self) -> int:
        return sum(self.block_params)

    @property
    def root_numel(self) -> int:
        return sum(self.root_params)

    @property
    def total_params(self) -> int:
        return self.root_numel + self.n_layers * self.block_numel

    @property
    def max_unit_numel(self) -> int:
        """The largest non-root unit, ``max(psi_i)`` of Section 3.2.1."""
        return self.largest_unit or self.block_numel

    @classmethod
    def from_config(cls, config: _ConfigLike, *, name: str = "") -> ModelShape:
        """The exact parameter list of `fsdp.GPT` built from ``config`` (a `GPTConfig`)."""
        d, v, s = config.d_model, config.vocab_size, config.seq_len
        block = (d, d, 3 * d * d, 3 * d, d * d, d, d, d, 4 * d * d, 4 * d, 4 * d * d, d)
        head = () if config.tie_embeddings else (v * d,)
        root = (v * d, s * d, d, d, *head)
        label = name or f"GPT {config.n_layers}x{d}"
        return cls(label, block, config.n_layers, root, d, v, s)

    @classmethod
    def from_name(cls, name: str) -> ModelShape:
        """A named size of ``fsdp train --model`` (`fsdp._gpt.MODEL_SIZES`)."""
        from ._gpt import MODEL_SIZES

        if name not in MODEL_SIZES:
            raise PlanError("model", f"unknown model {name!r}; choose from "
                            f"{', '.join(MODEL_SIZES)} or give a parameter count")
        return cls.from_config(MODEL_SIZES[name], name=name)

    @classmethod
    def from_params(cls, total: int, *, layers: int | None = None, d_model: int | None = None,
                    vocab_size: int | None = None, seq_len: int | None = None,
                    largest_unit: int | None = None) -> ModelShape:
        """A decoder of ``total`` parameters: ``layers`` equal blocks plus a root of untied
        input and output embeddings (``2 * vocab_size * d_model``).

        What is not given is guessed from Llama-like proportions: a block holds about
        ``12 d^2`` parameters and ``d_model = 128 * layers``."""
        vocab = _positive(DEFAULT_VOCAB if vocab_size is None else vocab_size, "vocab_size")
        layers, d = _shape_of(total, layers, d_model, vocab)
        block = (total - 2 * vocab * d) // layers
        if block < 1:
            raise PlanError("params", f"{total:,} parameters leave nothing for {layers} blocks "
                            f"after embeddings of 2 x {vocab} x {d}; give a smaller vocabulary "
                            "or d_model")
        root = total - layers * block
        if largest_unit is not None:
            _positive(largest_unit, "largest_unit")
        return cls(f"{_human_count(total)} decoder", (block,), layers, (root,), d, vocab,
                   seq_len or DEFAULT_SEQ_LEN, largest_unit)


def _positive(value: Any, argument: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PlanError(argument, f"must be an int >= 1, got {value!r}")
    return value


def _shape_of(total: int, layers: int | None, d_model: int | None,
              vocab: int) -> tuple[int, int]:
    """(layers, d_model) of a ``total``-parameter decoder, solving
    ``total = 12 * layers * d^2 + 2 * vocab * d`` for what is missing."""
    if layers is not None:
        _positive(layers, "layers")
    if d_model is not None:
        _positive(d_model, "d_model")
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
        lo, hi = (mid, hi) if 12 * mid**3 / D_MODEL_PER_LAYER + 2 * vocab * mid < total \
            else (lo, mid)
    d = max(1, round(lo))
    return max(1, round(d / D_MODEL_PER_LAYER)), d


def format_bytes(n: float) -> str:
    """``n`` bytes for people: ``"32.56 GiB"``, ``"6.34 MiB"``."""
    for scale, unit in ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if abs(n) >= scale:
            return f"{n / scale:.2f}".rstrip("0").rstrip(".") + f" {unit}"
    return f"{int(n)} B"


def _human_count(n: int) -> str:
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= scale:
            return f"{n / scale:.3g}{suffix}"
    return str(n)


@dataclass(frozen=True)
class PlanConfig:
    """Cluster shape, strategy and training settings of a plan (see `plan` for each;
    ``gpu_memory`` is in bytes here)."""

    gpus: int
    gpus_per_node: int = 8
    strategy: str = "full_shard"
    shard_size: int | None = None
    param_dtype: str = "fp32"
    reduce_dtype: str | None = None
    master_dtype: str = "fp32"
    optimizer_bytes_per_param: float = 8.0
    micro_batch: int = 1
    seq_len: int | None = None
    activation_checkpointing: bool = False
    cpu_offload: bool = False
    gpu_memory: int | None = None

    def __post_init__(self) -> None:
        _positive(self.gpus, "gpus")
        _positive(self.gpus_per_node, "gpus_per_node")
        _positive(self.micro_batch, "micro_batch")
        if self.seq_len is not None:
            _positive(self.seq_len, "seq_len")
        if self.strategy not in STRATEGIES:
            raise PlanError("strategy", f"unknown strategy {self.strategy!r}; choose from "
                            f"{', '.join(STRATEGIES)}")
        for name in ("param_dtype", "reduce_dtype", "master_dtype"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, _dtype_name(getattr(self, name)))
                dtype_bytes(getattr(self, name), argument=name)
        if not self.optimizer_bytes_per_param >= 0:
            raise PlanError("optimizer_bytes_per_param",
                            f"must be >= 0, got {self.optimizer_bytes_per_param!r}")
        self._check_shard_size()

    def _check_shard_size(self) -> None:
        if self.strategy != "hybrid_shard":
            if self.shard_size is not None:
                raise PlanError("shard_size", "applies to hybrid_shard only, got strategy "
                                f"{self.strategy}")
            return
        if self.shard_size is not None:
            _positive(self.shard_size, "shard_size")
        size = self.shard_group
        if self.gpus % size:
            source = "the shard size" if self.shard_size is not None else "GPUs per node"
            raise PlanError("gpus", f"hybrid_shard needs the GPU count ({self.gpus}) to be a "
                            f"multiple of the shard group ({size}, {source})")

    @property
    def shard_group(self) -> int:
        """The sharding factor F (Section 3.2): W for full sharding, 1 for no sharding, the
        shard group (a node by default) for hybrid sharding."""
        if self.strategy == "no_shard":
            return 1
        if self.strategy == "hybrid_shard":
            return self.shard_size or min(self.gpus_per_node, self.gpus)
        return self.gpus

    @property
    def replicas(self) -> int:
        return self.gpus // self.shard_group

    @property
    def nodes(self) -> int:
        return -(-self.gpus // self.gpus_per_node)

    @property
    def gather_dtype(self) -> str:
        return self.param_dtype

    @property
    def grad_dtype(self) -> str:
        """The reduction dtype: ``reduce_dtype``, else the parameters' compute dtype."""
        return self.reduce_dtype or self.param_dtype


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes per GPU at the peak of a step; `total` sums the GPU terms.

    ``host`` counts what CPU offload keeps in host memory instead (per GPU)."""

    sharded_params: int
    gradients: int
    optimizer_state: int
    unsharded_params: int
    comm_buffers: int
    unsharded_grads: int
    activations: int
    host: int = 0

    @property
    def pooled(self) -> int:
        """What the memory manager's buffer pool peaks at: gathered units plus collective
        buffers (``MemoryManager.stats().peak_bytes``)."""
        return self.unsharded_params + self.comm_buffers

    @property
    def total(self) -> int:
        return (self.sharded_params + self.gradients + self.optimizer_state + self.pooled
                + self.unsharded_grads + self.activations)


@dataclass(frozen=True)
class Collective:
    """One kind of collective in one step.

    ``buffer_bytes``: the full tensors it moves, summed over its calls (an all-gather's output,
    a reduce-scatter's input, an all-reduce's tensor). ``group_size``: ranks in its group;
    ``cross_node``: whether that group spans nodes (then, as in the paper's Section 3.2.2
    accounting, all its traffic counts as cross-node)."""

    name: str
    kind: str
    calls: int
    buffer_bytes: int
    group_size: int
    cross_node: bool

    @property
    def input_bytes(self) -> int:
        """Bytes each rank hands the backend (as `fsdp_comm.FakeBackend.traffic` counts them):
        an all-gather's input is one shard of its output."""
        return self.buffer_bytes // self.group_size if self.kind == "all_gather" \
            else self.buffer_bytes

    @property
    def sent_bytes(self) -> int:
        """Bytes each GPU sends with bandwidth-optimal ring algorithms: ``B(n-1)/n`` for an
        all-gather or reduce-scatter of ``B`` bytes over ``n`` ranks, twice that for an
        all-reduce (Section 3.2.1: full sharding moves 1.5x DDP's volume)."""
        n = self.group_size
        ring = self.buffer_bytes * (n - 1) // n
        return 2 * ring if self.kind == "all_reduce" else ring


@dataclass(frozen=True)
class CommVolume:
    """Communication of one step (one micro-batch, forward and backward) per GPU."""

    collectives: tuple[Collective, ...]

    @property
    def total_bytes(self) -> int:
        return sum(c.sent_bytes for c in self.collectives)

    @property
    def cross_node_bytes(self) -> int:
        return sum(c.sent_bytes for c in self.collectives if c.cross_node)

    @property
    def intra_node_bytes(self) -> int:
        return self.total_bytes - self.cross_node_bytes

    def by_kind(self, kind: str) -> Collective | None:
        """The collectives of ``kind`` merged into one (calls and bytes added)."""
        found = [c for c in self.collectives if c.kind == kind]
        if not found:
            return None
        return replace(found[0], name=kind, calls=sum(c.calls for c in found),
                       buffer_bytes=sum(c.buffer_bytes for c in found))


@dataclass(frozen=True)
class Recommendation:
    """The configuration to run (see `_recommend` for the order of preference) and a
    sentence saying why; ``fits`` is False when nothing fits ``gpu_memory``, and None without
    a ``gpu_memory`` (then nothing is recommended: the configuration is the one asked for)."""

    strategy: str
    activation_checkpointing: bool
    cpu_offload: bool
    fits: bool | None
    total_bytes: int
    cross_node_bytes: int
    text: str


@dataclass(frozen=True)
class Plan:
    """Predicted per-GPU memory and per-step communication for one model on one cluster."""

    model: ModelShape
    config: PlanConfig
    memory: MemoryBreakdown
    comm: CommVolume
    recommendation: Recommendation = field(compare=False)

    @property
    def shard_group(self) -> int:
        return self.config.shard_group

    @property
    def replicas(self) -> int:
        return self.config.replicas

    def fits(self, gpu_memory: int) -> bool:
        """Whether the step fits in ``gpu_memory`` bytes, leaving 10% for the CUDA context,
        NCCL buffers and fragmentation."""
        return self.memory.total <= USABLE_FRACTION * gpu_memory

    def to_dict(self) -> dict[str, Any]:
        """Everything as plain JSON-able values, derived totals included."""
        out: dict[str, Any] = {
            "model": {**asdict(self.model), "total_params": self.model.total_params},
            "config": {**asdict(self.config), "shard_group": self.shard_group,
                       "replicas": self.replicas, "nodes": self.config.nodes},
            "memory": {**asdict(self.memory), "pooled": self.memory.pooled,
                       "total": self.memory.total},
            "comm": {"collectives": [{**asdict(c), "sent_bytes": c.sent_bytes}
                                     for c in self.comm.collectives],
                     "total_bytes": self.comm.total_bytes,
                     "intra_node_bytes": self.comm.intra_node_bytes,
                     "cross_node_bytes": self.comm.cross_node_bytes}}
        out["recommendation"] = asdict(self.recommendation)
        return out


# ---- memory -----------------------------------------------------------------------------
@dataclass(frozen=True)
class _Units:
    """Padded unit sizes (elements) for one sharding factor."""

    root: int
    block: int
    largest: int
    n_blocks: int

    @property
    def total(self) -> int:
        return self.root + self.n_blocks * self.block


def _units(model: ModelShape, config: PlanConfig) -> _Units:
    f, item = config.shard_group, dtype_bytes(config.master_dtype)
    block = padded_numel(model.block_params, shard_count=f, itemsize=item)
    largest = block if model.largest_unit is None else \
        padded_numel((model.largest_unit,), shard_count=f, itemsize=item)
    root = padded_numel(model.root_params, shard_count=f, itemsize=item)
    return _Units(root, block, largest, model.n_layers)


def _sharded_state(model: ModelShape, config: PlanConfig, units: _Units) -> tuple[int, int, int]:
    """(parameters, gradients, optimizer state) bytes each rank keeps (Section 3.2.1).

    Parameters and gradients: ``sum(psi_i) / F`` elements (padding included) in the master
    dtype, in which the optimizer steps. Optimizer state: ``optimizer_bytes_per_param`` for
    each real parameter of the shard, ``Psi / F`` of them (AdamW: two fp32 moments, 8)."""
    f, master = config.shard_group, dtype_bytes(config.master_dtype)
    shard = units.total // f * master
    optimizer = int(config.optimizer_bytes_per_param * model.total_params / f)
    return shard, shard, optimizer


def _unsharded_params(config: PlanConfig, units: _Units) -> int:
    """Gathered parameters alive at the peak, in ``param_dtype`` (Section 3.2.1's
    ``max(psi_i)`` term): the root unit, which stays gathered from forward to backward, plus
    two units in flight (the one computing and the one prefetched; the rate limiter's bound).
    SHARD_GRAD_OP keeps every unit gathered from forward to backward: ``sum(psi_i)``. With no
    sharding and no cast the computation uses the shard itself: nothing extra."""
    gather = dtype_bytes(config.gather_dtype)
    if not _gathers(config):
        return 0
    if config.strategy == "shard_grad_op":
        return units.total * gather
    return (units.root + min(GATHERS_IN_FLIGHT, units.n_blocks) * units.largest) * gather


def _gathers(config: PlanConfig) -> bool:
    """Whether units are gathered into separate buffers: always when sharded; with no
    sharding only to cast (otherwise the computation uses the local copy itself)."""
    return config.shard_group > 1 or config.param_dtype != config.master_dtype


def _casts(config: PlanConfig) -> bool:
    """Whether a gather first copies the shard (to another dtype, or from host memory)."""
    return config.cpu_offload or config.param_dtype != config.master_dtype


def _comm_buffers(config: PlanConfig, units: _Units) -> int:
    """Shard-sized collective buffers at the peak: the outputs of two reduce-scatters (one in
    flight, one being folded into the sharded gradient) and, when gathers cast or copy from
    the host, the send buffer of the prefetch. SHARD_GRAD_OP peaks as backward starts, with
    every unit gathered, one reduce-scatter output and nothing left to prefetch."""
    f = config.shard_group
    shard = units.largest // f
    # Note [rank-major layout] in fsdp_engine: a gathered unit is copied to parameter-major
    # order (one more unit at that moment), and the reduction in flight holds its gradient
    # copied to rank-major order (pooled; autograd's copy is freed at once).
    layout = units.largest * (dtype_bytes(config.gather_dtype) + dtype_bytes(config.grad_dtype))
    if config.strategy == "shard_grad_op":
        return shard * dtype_bytes(config.grad_dtype) + layout
    buffers = REDUCTIONS_IN_FLIGHT * shard * dtype_bytes(config.grad_dtype) if f > 1 else 0
    if f > 1:
        buffers += layout
    if _casts(config):
        buffers += shard * dtype_bytes(config.gather_dtype)
    return buffers


def _unsharded_grads(config: PlanConfig, units: _Units) -> int:
    """Unsharded gradients alive during backward (autograd's, not pooled): the root's, which
    is reduced only when backward reaches the embeddings, plus the unit being differentiated
    and the one whose reduction is in flight."""
    blocks = min(REDUCTIONS_IN_FLIGHT, units.n_blocks)
    if config.shard_group > 1:
        blocks = min(1, units.n_blocks)  # reductions in flight hold pooled rank-major copies
    return (units.root + blocks * units.largest) * dtype_bytes(config.grad_dtype)


def _block_activations(model: ModelShape, tokens: int, itemsize: int) -> int:
    """Activations one block saves for backward: 16 values of d_model per token (Korthikanti
    et al. 2022, "Reducing Activation Recomputation", Sec. 4.1: ``34 s b h`` bytes in 16-bit
    minus the two dropout masks; no ``5 a s^2 b`` score term, as fused attention kernels keep
    no score matrix)."""
    return ACTIVATION_VALUES_PER_TOKEN * tokens * model.d_model * itemsize


def _activations(model: ModelShape, config: PlanConfig) -> int:
    """Activation estimate of one micro-batch in ``param_dtype``: every block's saved
    activations, or with activation checkpointing only each block's input plus one block
    recomputed in backward; plus the root's embeddings, final norm, logits and their fp32
    log-softmax for the loss (``tokens * (3 d + V (e + 4))``)."""
    tokens = config.micro_batch * (config.seq_len or model.seq_len)
    e = dtype_bytes(config.param_dtype)
    block = _block_activations(model, tokens, e)
    if config.activation_checkpointing:
        blocks = model.n_layers * tokens * model.d_model * e + block
    else:
        blocks = model.n_layers * block
    root = tokens * (3 * model.d_model * e + model.vocab_size * (e + 4))
    return blocks + root


def _memory(model: ModelShape, config: PlanConfig) -> MemoryBreakdown:
    units = _units(model, config)
    params, grads, optimizer = _sharded_state(model, config, units)
    host = 0
    if config.cpu_offload:
        host, params, grads, optimizer = params + grads + optimizer, 0, 0, 0
    return MemoryBreakdown(
        sharded_params=params, gradients=grads, optimizer_state=optimizer,
        unsharded_params=_unsharded_params(config, units),
        comm_buffers=_comm_buffers(config, units),
        unsharded_grads=_unsharded_grads(config, units),
        activations=_activations(model, config), host=host)


# ---- communication ----------------------------------------------------------------------
def _spans_nodes(config: PlanConfig, *, group: str) -> bool:
    """Whether a shard, replicate or world group spans nodes. Shard groups are consecutive
    ranks (``[0, S)``, ``[S, 2S)``, ...), so they stay inside a node when ``S`` divides ``G``;
    replicate groups take one rank per shard group, so they span nodes when ``W > G``."""
    g, w = config.gpus_per_node, config.gpus
    if w <= g:
        return False
    if group == "shard":
        s = config.shard_group
        return not (s <= g and g % s == 0)
    return True


def _comm(model: ModelShape, config: PlanConfig) -> CommVolume:
    """Collectives of one step (Sections 3.2.1 and 3.2.2).

    Every unit is all-gathered before its forward and, when resharded after forward (full and
    hybrid sharding, not SHARD_GRAD_OP and never the root), again before its backward; its
    gradient is reduce-scattered in ``reduce_dtype``; with replicas (hybrid, or no sharding
    where the whole gradient is all-reduced) the gradient shard is then all-reduced across
    them. With no sharding, units are "gathered" over a group of one only to cast them (no
    traffic). Full sharding: ``~3M(W-1)/W`` per GPU; no sharding: ``2M(W-1)/W``; hybrid with a node
    per shard group: ``3M(G-1)/G`` inside nodes and ``2M(W-G)/(GW)`` across them."""
    units = _units(model, config)
    f, n_units = config.shard_group, units.n_blocks + 1
    gather, grad = dtype_bytes(config.gather_dtype), dtype_bytes(config.grad_dtype)
    shard_cross = _spans_nodes(config, group="shard")
    out: list[Collective] = []
    if _gathers(config):
        out.append(Collective("all-gather (forward)", "all_gather", n_units,
                              units.total * gather, f, shard_cross))
        if config.strategy != "shard_grad_op":
            out.append(Collective("all-gather (backward)", "all_gather", units.n_blocks,
                                  units.n_blocks * units.block * gather, f, shard_cross))
    if f > 1:
        out.append(Collective("reduce-scatter", "reduce_scatter", n_units, units.total * grad,
                              f, shard_cross))
    if config.replicas > 1:
        out.append(Collective("all-reduce (replicas)", "all_reduce", n_units,
                              units.total // f * grad, config.replicas,
                              _spans_nodes(config, group="replicate")))
    return CommVolume(tuple(out))


# ---- recommendation ---------------------------------------------------------------------
_PREFERENCE = ("no_shard", "hybrid_shard", "shard_grad_op", "full_shard")


def _candidates(config: PlanConfig) -> list[PlanConfig]:
    """What to try, cheapest in speed first: every strategy with the settings asked for, then
    with activation checkpointing, then full sharding with checkpointing and CPU offload (the
    paper's last memory lever; offloading a replicated model would need its whole state in
    host memory per GPU)."""
    group = config.shard_size or config.gpus_per_node
    hybrid = group < config.gpus and config.gpus % group == 0  # else the same as full_shard
    strategies = [s for s in _PREFERENCE if s != "hybrid_shard" or hybrid]
    out = [_variant(config, s, config.activation_checkpointing, config.cpu_offload)
           for s in strategies]
    if not config.activation_checkpointing:
        out += [_variant(config, s, True, config.cpu_offload) for s in strategies]
    if not config.cpu_offload:
        out.append(_variant(config, "full_shard", True, True))
    return out


def _variant(config: PlanConfig, strategy: str, checkpointing: bool,
             offload: bool) -> PlanConfig:
    shard = config.shard_size if strategy == "hybrid_shard" else None
    return replace(config, strategy=strategy, shard_size=shard,
                   activation_checkpointing=checkpointing, cpu_offload=offload)


def _label(config: PlanConfig) -> str:
    extras = [x for x, on in (("activation checkpointing", config.activation_checkpointing),
                              ("CPU offload", config.cpu_offload)) if on]
    return config.strategy + (" with " + " and ".join(extras) if extras else "")


def _recommend(model: ModelShape, config: PlanConfig) -> Recommendation:
    """The candidate to run: among those that fit ``gpu_memory`` (without it: the strategies
    with the settings asked for), the fewest speed trade-offs first (activation checkpointing,
    then CPU offload), then the least cross-node traffic, then the least traffic."""
    budget = config.gpu_memory
    if budget is None:
        return _no_budget(model, config)
    evaluated = [(i, c, _memory(model, c), _comm(model, c))
                 for i, c in enumerate(_candidates(config))]
    pool = [e for e in evaluated if e[2].total <= USABLE_FRACTION * budget]
    if not pool:
        return _no_fit(model, config, evaluated[-1][1:])
    _, c, mem, comm = min(pool, key=lambda e: (_tradeoffs(e[1]), e[3].cross_node_bytes,
                                                e[3].total_bytes, e[0]))
    text = (f"{_label(c)}: {format_bytes(mem.total)} per GPU"
            + (f" (fits {format_bytes(budget)})" if budget is not None else "")
            + f", {_traffic(c, comm)}"
            + (f", {format_bytes(mem.host)} per GPU in host memory" if mem.host else "")
            + _versus(model, config, c))
    return Recommendation(c.strategy, c.activation_checkpointing, c.cpu_offload, True,
                          mem.total, comm.cross_node_bytes, text)


def _no_budget(model: ModelShape, config: PlanConfig) -> Recommendation:
    """Without a memory budget nothing can be said to fit, so nothing is recommended."""
    mem, comm = _memory(model, config), _comm(model, config)
    text = (f"none without a memory budget: pass --gpu-memory SIZE (80GB, say) to recommend "
            f"what fits; {_label(config)} as asked needs {format_bytes(mem.total)} per GPU")
    return Recommendation(config.strategy, config.activation_checkpointing, config.cpu_offload,
                          None, mem.total, comm.cross_node_bytes, text)


def _traffic(config: PlanConfig, comm: CommVolume) -> str:
    if config.nodes == 1:
        return f"{format_bytes(comm.total_bytes)} per GPU per step inside the node"
    return f"{format_bytes(comm.cross_node_bytes)} per GPU per step across nodes"


def _tradeoffs(config: PlanConfig) -> int:
    return 2 * config.cpu_offload + config.activation_checkpointing


def _versus(model: ModelShape, asked: PlanConfig, chosen: PlanConfig) -> str:
    if _label(asked) == _label(chosen):
        return " (as asked)"
    mem = _memory(model, asked)
    if asked.gpu_memory is not None and mem.total > USABLE_FRACTION * asked.gpu_memory:
        return f"; {_label(asked)} needs {format_bytes(mem.total)} and does not fit"
    return f"; {_label(asked)}: {format_bytes(mem.total)}, {_traffic(asked, _comm(model, asked))}"


def _no_fit(model: ModelShape, config: PlanConfig,
            leanest: tuple[PlanConfig, MemoryBreakdown, CommVolume]) -> Recommendation:
    c, mem, comm = leanest
    budget = config.gpu_memory or 0
    need = _gpus_needed(model, c)
    more = f"; about {need} GPUs would fit it" if need else ""
    text = (f"does not fit {format_bytes(budget)}: even {_label(c)} needs "
            f"{format_bytes(mem.total)} per GPU (try a smaller micro-batch or more GPUs{more})")
    return Recommendation(c.strategy, c.activation_checkpointing, c.cpu_offload, False,
                          mem.total, comm.cross_node_bytes, text)


def _gpus_needed(model: ModelShape, config: PlanConfig) -> int | None:
    """The fewest GPUs (whole nodes, doubling) at which ``config`` fits, if any up to 2^16."""
    budget = USABLE_FRACTION * (config.gpu_memory or 0)
    gpus = config.gpus_per_node
    while gpus <= 2**16:
        if _memory(model, replace(config, gpus=gpus)).total <= budget:
            return gpus
        gpus *= 2
    return None


# ---- entry point ------------------------------------------------------------------------
def _resolve_model(model: object, *, layers: int | None, d_model: int | None,
                   vocab_size: int | None, largest_unit: int | None,
                   seq_len: int | None) -> ModelShape:
    """A `ModelShape` from what `plan` was given (see there)."""
    if isinstance(model, (int, float)) and not isinstance(model, bool):
        return ModelShape.from_params(parse_count(model), layers=layers, d_model=d_model,
                                      vocab_size=vocab_size, seq_len=seq_len,
                                      largest_unit=largest_unit)
    shape_args = {"layers": layers, "d_model": d_model, "vocab_size": vocab_size,
                  "largest_unit": largest_unit}
    for name, value in shape_args.items():
        if value is not None:
            raise PlanError(name, "applies to a model given as a parameter count only")
    if isinstance(model, ModelShape):
        return model
    if isinstance(model, str):
        return ModelShape.from_name(model)
    if all(hasattr(model, a) for a in ("d_model", "n_layers", "vocab_size", "seq_len")):
        return ModelShape.from_config(cast(_ConfigLike, model))
    raise PlanError("model", "must be a name, a GPTConfig, a ModelShape or a parameter count, "
                    f"got {type(model).__name__}")


def plan(
    model: str | float | ModelShape | _ConfigLike,
    *,
    gpus: int,
    gpus_per_node: int = 8,
    strategy: str = "full_shard",
    shard_size: int | None = None,
    param_dtype: object = "fp32",
    reduce_dtype: object = None,
    master_dtype: object = "fp32",
    optimizer_bytes_per_param: float = 8.0,
    micro_batch: int = 1,
    seq_len: int | None = None,
    activation_checkpointing: bool = False,
    cpu_offload: bool = False,
    gpu_memory: float | str | None = None,
    layers: int | None = None,
    d_model: int | None = None,
    vocab_size: int | None = None,
    largest_unit: int | None = None,
) -> Plan:
    """Plan one training step of ``model`` on ``gpus`` GPUs, ``gpus_per_node`` to a node.

    ``model``: a name of ``fsdp train --model`` (``"1b"``), a `GPTConfig`, a `ModelShape`, or
    a parameter count (``7e9``; then ``layers``, ``d_model``, ``vocab_size`` and
    ``largest_unit`` describe it, guessed Llama-like when left out). ``strategy``: one of
    `STRATEGIES`; ``shard_size`` is hybrid sharding's shard group (default: one node).
    ``param_dtype``/``reduce_dtype``: mixed precision (gather and compute; gradient reduction,
    default ``param_dtype``); ``master_dtype``: what shards, sharded gradients and the optimizer
    step use. ``optimizer_bytes_per_param``: 8 for AdamW in fp32. ``micro_batch`` and
    ``seq_len`` size the activation estimate. ``gpu_memory`` (GiB, or a string such as
    ``"80GB"`` or ``"40GiB"``) makes the recommendation pick what fits. Raises `PlanError`
    (a ValueError naming the argument) on bad input.
    """
    memory_bytes = None if gpu_memory is None else parse_memory(gpu_memory)
    config = PlanConfig(
        gpus=gpus, gpus_per_node=gpus_per_node, strategy=str(strategy).lower().replace("-", "_"),
        shard_size=shard_size, param_dtype=_dtype_name(param_dtype),
        reduce_dtype=None if reduce_dtype is None else _dtype_name(reduce_dtype),
        master_dtype=_dtype_name(master_dtype),
        optimizer_bytes_per_param=optimizer_bytes_per_param, micro_batch=micro_batch,
        seq_len=seq_len, activation_checkpointing=bool(activation_checkpointing),
        cpu_offload=bool(cpu_offload), gpu_memory=memory_bytes)
    shape = _resolve_model(model, layers=layers, d_model=d_model, vocab_size=vocab_size,
                           largest_unit=largest_unit, seq_len=seq_len)
    return Plan(shape, config, _memory(shape, config), _comm(shape, config),
                _recommend(shape, config))
