"""`fsdp plan`: per-GPU memory and communication of one FSDP training step, before you run it.

The planner is arithmetic only (no tensors, no GPU): it follows the FSDP paper (Zhao et al.,
"PyTorch FSDP", VLDB 2023, arXiv 2304.11277) and the way this engine lays units out, with the
engine's own constants and rules (`fsdp.plan._base`): its FlatParameter padding, its in-flight
limits, its strategy names, and `fsdp_engine.strategy_mesh_shape` for the mesh a strategy
runs on (which ``fsdp train`` and the benchmarks use too).

Memory (Section 3.2.1, `fsdp.plan._memory`): every rank keeps ``sum(psi_i) / F`` of the
parameters, gradients and optimizer state and materialises ``root + 2 * max(psi_i)`` gathered
parameters; with CPU offload the sharded state goes to the host, and the plan checks that a
node's host memory holds what its ranks pin. Communication (Sections 3.2.1 and 3.2.2,
`fsdp.plan._comm`): about ``3M(W-1)/W`` bytes per GPU for full sharding, ``2M(W-G)/(GW)``
across nodes for hybrid sharding. Models (`fsdp.plan._model`): ``fsdp train``'s sizes, presets
of known models (`fsdp.plan._presets`), a Hugging Face ``config.json`` (`fsdp.plan._hf`), or a
parameter count.

Use `plan` (or ``fsdp plan`` on the command line)::

    from fsdp.plan import plan
    p = plan("llama3-70b", gpus=64, gpus_per_node=8, strategy="hybrid_shard",
             param_dtype="bf16", gpu_memory="80GB")
    p.memory.total, p.comm.cross_node_bytes, p.recommendation.text
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from ._base import (
    ACTIVATION_VALUES_PER_TOKEN,
    ALIGN_BYTES,
    GATHERS_IN_FLIGHT,
    HOST_USABLE_FRACTION,
    REDUCTIONS_IN_FLIGHT,
    STRATEGIES,
    USABLE_FRACTION,
    PlanError,
    dtype_bytes,
    dtype_name,
    format_bytes,
    padded_numel,
    parse_count,
    parse_memory,
)
from ._comm import Collective, CommVolume, comm
from ._memory import HostMemory, MemoryBreakdown, PlanConfig, host_memory, machine_memory
from ._memory import memory as plan_memory
from ._model import (
    D_MODEL_PER_LAYER,
    DEFAULT_SEQ_LEN,
    DEFAULT_VOCAB,
    ModelShape,
    resolve_model,
)
from ._presets import PRESETS, Architecture
from ._recommend import Recommendation, recommend
from ._tp import tp_problem

__all__ = [
    "STRATEGIES",
    "PRESETS",
    "Architecture",
    "ModelShape",
    "PlanConfig",
    "PlanError",
    "MemoryBreakdown",
    "HostMemory",
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
    "ALIGN_BYTES",
    "GATHERS_IN_FLIGHT",
    "REDUCTIONS_IN_FLIGHT",
    "ACTIVATION_VALUES_PER_TOKEN",
    "USABLE_FRACTION",
    "HOST_USABLE_FRACTION",
    "DEFAULT_VOCAB",
    "DEFAULT_SEQ_LEN",
    "D_MODEL_PER_LAYER",
]


@dataclass(frozen=True)
class Plan:
    """Predicted per-GPU memory and per-step communication for one model on one cluster.

    ``host_memory``: what CPU offload pins per node against the host memory, when the plan
    asks for offload or recommends (or refuses) it; else None."""

    model: ModelShape
    config: PlanConfig
    memory: MemoryBreakdown
    comm: CommVolume
    recommendation: Recommendation = field(compare=False)
    host_memory: HostMemory | None = None

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
        host = self.host_memory
        return {
            "model": {**asdict(self.model), "total_params": self.model.total_params},
            "config": {
                **asdict(self.config),
                "shard_group": self.shard_group,
                "replicas": self.replicas,
                "nodes": self.config.nodes,
            },
            "memory": {
                **asdict(self.memory),
                "pooled": self.memory.pooled,
                "total": self.memory.total,
            },
            "comm": {
                "collectives": [
                    {**asdict(c), "sent_bytes": c.sent_bytes} for c in self.comm.collectives
                ],
                "total_bytes": self.comm.total_bytes,
                "intra_node_bytes": self.comm.intra_node_bytes,
                "cross_node_bytes": self.comm.cross_node_bytes,
            },
            "host_memory": None if host is None else _host_dict(host),
            "recommendation": asdict(self.recommendation),
        }


def _host_dict(host: HostMemory) -> dict[str, Any]:
    return {**asdict(host), "per_node": host.per_node, "usable": host.usable, "fits": host.fits}


def _host_budget(host_memory: float | str | None) -> tuple[int | None, str]:
    """(bytes per node, where from): as given, else this machine's total memory."""
    if host_memory is not None:
        return parse_memory(host_memory, argument="host_memory"), "given"
    found = machine_memory()
    return found, "unknown" if found is None else "this machine's"


def _plan_host(shape: ModelShape, config: PlanConfig, rec: Recommendation) -> HostMemory | None:
    return host_memory(shape, config) if config.cpu_offload else rec.host


def plan(
    model: str | float | ModelShape | Architecture | Any,
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
    host_memory: float | str | None = None,
    layers: int | None = None,
    d_model: int | None = None,
    vocab_size: int | None = None,
    largest_unit: int | None = None,
    tp: int = 1,
    sequence_parallel: bool = True,
) -> Plan:
    """Plan one training step of ``model`` on ``gpus`` GPUs, ``gpus_per_node`` to a node.

    ``model``: a name of ``fsdp train --model`` (``"1b"``) or a preset (``"llama3-8b"``,
    `PRESETS`), a `GPTConfig`, an `Architecture` (``ModelShape.from_hf_config`` reads a
    ``config.json``), a `ModelShape`, or a parameter count (``7e9``; then ``layers``,
    ``d_model``, ``vocab_size`` and ``largest_unit`` describe it; with none of them a preset
    within 10% of the count lends its shape, else the shape is guessed Llama-like).
    ``strategy``: one of `STRATEGIES`; ``shard_size`` is hybrid sharding's shard group
    (default: one node). ``param_dtype``/``reduce_dtype``: mixed precision (gather and
    compute; gradient reduction, default ``param_dtype``); ``master_dtype``: what shards,
    sharded gradients and the optimizer step use. ``optimizer_bytes_per_param``: 8 for AdamW
    in fp32. ``micro_batch`` and ``seq_len`` size the activation estimate. ``gpu_memory``
    (GiB, or a size such as ``"80GB"``) makes the recommendation pick what fits;
    ``host_memory`` (per node; default this machine's) is what CPU offload may pin 80% of.
    ``tp``: tensor parallelism over groups of that many consecutive GPUs, FSDP over the
    ``gpus / tp`` data-parallel ranks (the strategy and ``shard_size`` lay those out);
    ``sequence_parallel`` (with ``tp > 1``) cuts activations between blocks along the sequence
    (`fsdp.plan._tp`). Raises `PlanError` (a ValueError naming the argument) on bad input.
    """
    gpu_bytes = None if gpu_memory is None else parse_memory(gpu_memory)
    host_bytes, host_source = _host_budget(host_memory)
    config = PlanConfig(
        gpus=gpus,
        gpus_per_node=gpus_per_node,
        strategy=str(strategy).lower().replace("-", "_"),
        shard_size=shard_size,
        param_dtype=dtype_name(param_dtype),
        reduce_dtype=None if reduce_dtype is None else dtype_name(reduce_dtype),
        master_dtype=dtype_name(master_dtype),
        optimizer_bytes_per_param=optimizer_bytes_per_param,
        micro_batch=micro_batch,
        seq_len=seq_len,
        activation_checkpointing=bool(activation_checkpointing),
        cpu_offload=bool(cpu_offload),
        gpu_memory=gpu_bytes,
        host_memory=host_bytes,
        host_memory_source=host_source,
        tp=tp,
        sequence_parallel=bool(sequence_parallel),
    )
    shape = resolve_model(
        model,
        layers=layers,
        d_model=d_model,
        vocab_size=vocab_size,
        largest_unit=largest_unit,
        seq_len=seq_len,
    )
    problem = tp_problem(
        shape, config.tp, config.sequence_parallel, config.seq_len or shape.seq_len
    )
    if problem is not None:
        raise problem
    rec = recommend(shape, config)
    return Plan(
        shape,
        config,
        plan_memory(shape, config),
        comm(shape, config),
        rec,
        _plan_host(shape, config, rec),
    )
