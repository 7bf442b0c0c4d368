"""Per-GPU memory of one step (the FSDP paper's Section 3.2.1) and the host memory CPU offload
pins on a node, for `fsdp plan`.

Every rank keeps ``sum(psi_i) / F`` of the parameters (``psi_i`` the padded FlatParameter of
unit ``i``, padded by the engine's own rule, ``F`` the sharding factor), and the same share of
gradients and optimizer state; it materialises the largest unit ``max(psi_i)`` while that unit
computes. The memory manager lets `GATHERS_IN_FLIGHT` gathered units be in flight (the one
computing and the one prefetched) and the root unit (embeddings, final norm, head) stays
gathered from forward to backward, so the transient parameter term is
``root + 2 * max(psi_i)``. With tensor parallelism (``tp``) each ``psi_i`` is the unit's tp
pieces (`fsdp.plan._tp.per_rank`), sharded over the ``gpus / tp`` data-parallel ranks.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from fsdp_engine import MeshShapeError, strategy_mesh_shape

from ._base import (
    ACTIVATION_VALUES_PER_TOKEN,
    GATHERS_IN_FLIGHT,
    HOST_USABLE_FRACTION,
    REDUCTIONS_IN_FLIGHT,
    STRATEGIES,
    PlanError,
    dtype_bytes,
    dtype_name,
    format_bytes,
    padded_numel,
    positive,
)
from ._model import ModelShape
from ._tp import block_activation_values, per_rank

__all__ = [
    "PlanConfig",
    "MemoryBreakdown",
    "HostMemory",
    "memory",
    "host_memory",
    "machine_memory",
    "Units",
    "units",
]

#: `strategy_mesh_shape`'s argument -> the keyword of `fsdp.plan._plan.plan`.
_PLAN_ARGUMENT = {"world_size": "gpus"}


def machine_memory() -> int | None:
    """This machine's physical memory in bytes, or None where the OS does not say."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


@dataclass(frozen=True)
class PlanConfig:
    """Cluster shape, strategy and training settings of a plan (see `fsdp.plan._plan.plan` for
    each; ``gpu_memory`` and ``host_memory`` (per node) are in bytes here, and
    ``host_memory_source`` says where the latter came from: ``"given"``, ``"this machine's"``
    or ``"unknown"``)."""

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
    host_memory: int | None = None
    host_memory_source: str = "unknown"
    tp: int = 1
    sequence_parallel: bool = True

    def __post_init__(self) -> None:
        positive(self.micro_batch, "micro_batch")
        positive(self.tp, "tp")
        positive(self.gpus, "gpus")
        if self.gpus % self.tp:
            raise PlanError(
                "tp",
                f"must divide gpus ({self.gpus}): the data-parallel size "
                f"is gpus / tp, got {self.tp}",
            )
        if not self.sequence_parallel and self.tp == 1:
            object.__setattr__(self, "sequence_parallel", True)  # no tp: nothing to switch
        if self.seq_len is not None:
            positive(self.seq_len, "seq_len")
        if self.strategy not in STRATEGIES:
            raise PlanError(
                "strategy",
                f"unknown strategy {self.strategy!r}; choose from {', '.join(STRATEGIES)}",
            )
        for name in ("param_dtype", "reduce_dtype", "master_dtype"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, dtype_name(getattr(self, name)))
                dtype_bytes(getattr(self, name), argument=name)
        if not self.optimizer_bytes_per_param >= 0:
            raise PlanError(
                "optimizer_bytes_per_param", f"must be >= 0, got {self.optimizer_bytes_per_param!r}"
            )
        self.mesh_shape  # noqa: B018 (validates gpus, gpus_per_node and shard_size)

    @property
    def dp(self) -> int:
        """Data-parallel ranks: ``gpus / tp``, laid out by the strategy."""
        return self.gpus // self.tp

    @property
    def mesh_shape(self) -> tuple[int, int]:
        """(replicas, shard group) from the engine's `strategy_mesh_shape` over the ``dp``
        data-parallel ranks (hybrid sharding's group is ``shard_size``, else the
        data-parallel ranks of a node)."""
        try:
            return strategy_mesh_shape(
                self.strategy,
                self.dp,
                shard_size=self.shard_size,
                gpus_per_node=max(1, self.gpus_per_node // self.tp),
            )
        except MeshShapeError as exc:
            raise PlanError(_PLAN_ARGUMENT.get(exc.argument, exc.argument), exc.message) from None

    @property
    def shard_group(self) -> int:
        """The sharding factor F (Section 3.2): W for full sharding, 1 for no sharding, the
        shard group (a node by default) for hybrid sharding."""
        return self.mesh_shape[1]

    @property
    def replicas(self) -> int:
        return self.mesh_shape[0]

    @property
    def nodes(self) -> int:
        return -(-self.gpus // self.gpus_per_node)

    @property
    def gpus_on_a_node(self) -> int:
        return min(self.gpus, self.gpus_per_node)

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
        return (
            self.sharded_params
            + self.gradients
            + self.optimizer_state
            + self.pooled
            + self.unsharded_grads
            + self.activations
        )


@dataclass(frozen=True)
class HostMemory:
    """What CPU offload pins in one node's host memory (the sharded fp32 parameters,
    gradients and optimizer state of its ranks) against what the node has: ``available``
    bytes from ``source`` (``"given"``, ``"this machine's"``, or ``"unknown"`` with None)."""

    per_gpu: int
    gpus: int
    available: int | None
    source: str

    @property
    def per_node(self) -> int:
        return self.per_gpu * self.gpus

    @property
    def usable(self) -> int | None:
        """The share offload may pin (`HOST_USABLE_FRACTION`)."""
        return None if self.available is None else int(HOST_USABLE_FRACTION * self.available)

    @property
    def fits(self) -> bool | None:
        return None if self.usable is None else self.per_node <= self.usable

    def text(self) -> str:
        """``"8 GPUs x 16.3 GiB = 130 GiB pinned per node, fits 80% of 512 GiB (given)"``."""
        need = (
            f"{self.gpus} GPU{'s' if self.gpus > 1 else ''} x {format_bytes(self.per_gpu)}"
            f" = {format_bytes(self.per_node)} pinned per node"
        )
        if self.available is None:
            return f"{need}; host memory unknown (pass --host-memory SIZE per node)"
        verdict = "fits" if self.fits else "does not fit"
        return (
            f"{need}, {verdict} {HOST_USABLE_FRACTION:.0%} of "
            f"{format_bytes(self.available)} ({self.source})"
        )


@dataclass(frozen=True)
class Units:
    """Padded unit sizes (elements) for one sharding factor."""

    root: int
    block: int
    largest: int
    n_blocks: int

    @property
    def total(self) -> int:
        return self.root + self.n_blocks * self.block


def units(model: ModelShape, config: PlanConfig) -> Units:
    """Every unit padded as the engine lays it out in the master dtype (its tp pieces with
    tensor parallelism)."""
    model = per_rank(model, config.tp)
    f, item = config.shard_group, dtype_bytes(config.master_dtype)
    block = padded_numel(model.block_params, shard_count=f, itemsize=item)
    largest = (
        block
        if model.largest_unit is None
        else padded_numel((model.largest_unit,), shard_count=f, itemsize=item)
    )
    root = padded_numel(model.root_params, shard_count=f, itemsize=item)
    return Units(root, block, largest, model.n_layers)


def _sharded_state(model: ModelShape, config: PlanConfig, u: Units) -> tuple[int, int, int]:
    """(parameters, gradients, optimizer state) bytes each rank keeps (Section 3.2.1).

    Parameters and gradients: ``sum(psi_i) / F`` elements (padding included) in the master
    dtype, in which the optimizer steps. Optimizer state: ``optimizer_bytes_per_param`` for
    each real parameter of the shard, ``Psi / F`` of them (AdamW: two fp32 moments, 8)."""
    f, master = config.shard_group, dtype_bytes(config.master_dtype)
    shard = u.total // f * master
    held = per_rank(model, config.tp).total_params
    optimizer = int(config.optimizer_bytes_per_param * held / f)
    return shard, shard, optimizer


def gathers(config: PlanConfig) -> bool:
    """Whether units are gathered into separate buffers: always when sharded; with no
    sharding only to cast (otherwise the computation uses the local copy itself)."""
    return config.shard_group > 1 or config.param_dtype != config.master_dtype


def _unsharded_params(config: PlanConfig, u: Units) -> int:
    """Gathered parameters alive at the peak, in ``param_dtype`` (Section 3.2.1's
    ``max(psi_i)`` term): the root unit, which stays gathered from forward to backward, plus
    `GATHERS_IN_FLIGHT` units (the one computing and the one prefetched: the memory manager's
    limit). SHARD_GRAD_OP keeps every unit gathered from forward to backward: ``sum(psi_i)``.
    With no sharding and no cast the computation uses the shard itself: nothing extra."""
    gather = dtype_bytes(config.gather_dtype)
    if not gathers(config):
        return 0
    if config.strategy == "shard_grad_op":
        return u.total * gather
    return (u.root + min(GATHERS_IN_FLIGHT, u.n_blocks) * u.largest) * gather


def _comm_buffers(config: PlanConfig, u: Units) -> int:
    """Shard-sized collective buffers at the peak: the outputs of `REDUCTIONS_IN_FLIGHT`
    reduce-scatters (one in flight, one being folded into the sharded gradient). A gather
    that casts or copies from the host writes straight into its own slot of the gathered
    buffer (Note [in-place gather] in fsdp_engine): no send buffer. SHARD_GRAD_OP peaks
    as backward starts, with every unit gathered, one reduce-scatter output and nothing left
    to prefetch."""
    f = config.shard_group
    shard = u.largest // f
    # Note [rank-major layout] in fsdp_engine: a gathered unit is copied to parameter-major
    # order (one more unit at that moment), and the reduction in flight holds its gradient
    # copied to rank-major order (pooled; autograd's copy is freed at once).
    layout = u.largest * (dtype_bytes(config.gather_dtype) + dtype_bytes(config.grad_dtype))
    # Note [reducing into the gradient] in fsdp_engine: a reduce-scatter output of the master
    # dtype on the shard's device becomes the sharded gradient itself (counted there), not a
    # pooled buffer.
    pooled_out = config.grad_dtype != config.master_dtype or config.cpu_offload
    if config.strategy == "shard_grad_op":
        return (
            shard * dtype_bytes(config.grad_dtype) if pooled_out else 0
        ) + _gathered_then_reduced(config, u)
    buffers = (
        REDUCTIONS_IN_FLIGHT * shard * dtype_bytes(config.grad_dtype) if f > 1 and pooled_out else 0
    )
    if f > 1:
        buffers += layout
    return buffers


def _gathered_then_reduced(config: PlanConfig, u: Units) -> int:
    """SHARD_GRAD_OP's one unit beyond every gathered unit: the last gather's rank-major
    buffer while it is copied to parameter-major order. A unit resharded after its backward
    hands its gathered buffer to its reduction (`take_full` in fsdp_engine) when the dtypes
    match, so the rank-major gradient needs a buffer of its own only when they differ."""
    gather, grad = dtype_bytes(config.gather_dtype), dtype_bytes(config.grad_dtype)
    reuses = config.gather_dtype == config.grad_dtype
    return u.largest * max(gather, 0 if reuses else grad)


def _unsharded_grads(config: PlanConfig, u: Units) -> int:
    """Unsharded gradients alive during backward (autograd's, not pooled): the root's, which
    is reduced only when backward reaches the embeddings, plus the unit being differentiated
    and the one whose reduction is in flight."""
    blocks = min(REDUCTIONS_IN_FLIGHT, u.n_blocks)
    if config.shard_group > 1:
        blocks = min(1, u.n_blocks)  # reductions in flight hold pooled rank-major copies
    return (u.root + blocks * u.largest) * dtype_bytes(config.grad_dtype)


def _block_activations(model: ModelShape, config: PlanConfig, tokens: int, itemsize: int) -> int:
    """Activations one block saves for backward: 16 values of d_model per token (Korthikanti
    et al. 2022, "Reducing Activation Recomputation", Sec. 4.1: ``34 s b h`` bytes in 16-bit
    minus the two dropout masks; no ``5 a s^2 b`` score term, as fused attention kernels keep
    no score matrix); with tensor parallelism, this rank's share
    (`fsdp.plan._tp.block_activation_values`)."""
    if config.tp == 1:
        return ACTIVATION_VALUES_PER_TOKEN * tokens * model.d_model * itemsize
    values = block_activation_values(config.tp, config.sequence_parallel)
    return int(values * tokens * model.d_model * itemsize)


def _activations(model: ModelShape, config: PlanConfig) -> int:
    """Activation estimate of one micro-batch in ``param_dtype``: every block's saved
    activations, or with activation checkpointing only each block's input plus one block
    recomputed in backward; plus the root's embeddings, final norm, logits and their fp32
    log-softmax for the loss (``tokens * (3 d + V (e + 4))``). With sequence parallelism the
    block inputs and the root's ``3 d`` are cut ``tp`` ways (the logits are gathered whole)."""
    tokens = config.micro_batch * (config.seq_len or model.seq_len)
    e = dtype_bytes(config.param_dtype)
    block = _block_activations(model, config, tokens, e)
    cut = config.tp if config.sequence_parallel else 1
    if config.activation_checkpointing:
        blocks = model.n_layers * tokens * model.d_model * e // cut + block
    else:
        blocks = model.n_layers * block
    root = tokens * (3 * model.d_model * e // cut + model.vocab_size * (e + 4))
    return blocks + root


def memory(model: ModelShape, config: PlanConfig) -> MemoryBreakdown:
    """The per-GPU peak of one step of ``model`` under ``config``."""
    u = units(model, config)
    params, grads, optimizer = _sharded_state(model, config, u)
    host = 0
    if config.cpu_offload:
        host, params, grads, optimizer = params + grads + optimizer, 0, 0, 0
    return MemoryBreakdown(
        sharded_params=params,
        gradients=grads,
        optimizer_state=optimizer,
        unsharded_params=_unsharded_params(config, u),
        comm_buffers=_comm_buffers(config, u),
        unsharded_grads=_unsharded_grads(config, u),
        activations=_activations(model, config),
        host=host,
    )


def host_memory(model: ModelShape, config: PlanConfig) -> HostMemory:
    """What ``config`` with CPU offload pins per node (`HostMemory`)."""
    per_gpu = sum(_sharded_state(model, config, units(model, config)))
    return HostMemory(per_gpu, config.gpus_on_a_node, config.host_memory, config.host_memory_source)
