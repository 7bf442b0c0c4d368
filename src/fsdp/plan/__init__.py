"""``fsdp plan``'s engine: per-GPU memory and communication of one FSDP training step, before
you run it (arithmetic only: no tensors, no GPU).

    from fsdp.plan import plan
    p = plan("llama3-70b", gpus=64, gpus_per_node=8, strategy="hybrid_shard",
             param_dtype="bf16", gpu_memory="80GB")
    p.memory.total, p.comm.cross_node_bytes, p.recommendation.text

`plan` returns a `Plan` (its `MemoryBreakdown`, `CommVolume` and `Recommendation`); bad input
raises `PlanError`, a ValueError naming the argument.
"""

from ._plan import (
    ACTIVATION_VALUES_PER_TOKEN,
    ALIGN_BYTES,
    D_MODEL_PER_LAYER,
    DEFAULT_SEQ_LEN,
    DEFAULT_VOCAB,
    GATHERS_IN_FLIGHT,
    HOST_USABLE_FRACTION,
    PRESETS,
    REDUCTIONS_IN_FLIGHT,
    STRATEGIES,
    USABLE_FRACTION,
    Architecture,
    Collective,
    CommVolume,
    HostMemory,
    MemoryBreakdown,
    ModelShape,
    Plan,
    PlanConfig,
    PlanError,
    Recommendation,
    dtype_bytes,
    format_bytes,
    padded_numel,
    parse_count,
    parse_memory,
    plan,
)

__all__ = [
    "plan",
    "Plan",
    "PlanError",
    "PlanConfig",
    "ModelShape",
    "Architecture",
    "MemoryBreakdown",
    "HostMemory",
    "Collective",
    "CommVolume",
    "Recommendation",
    "STRATEGIES",
    "PRESETS",
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
