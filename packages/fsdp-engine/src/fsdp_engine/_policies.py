"""Policies: how a unit casts (`MixedPrecisionPolicy`), where it keeps state
(`OffloadPolicy`), and the FSDP1 strategy names (`ShardingStrategy`)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

__all__ = [
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "CPUOffloadPolicy",
    "ShardingStrategy",
    "STRATEGY_NAMES",
    "as_mp_policy",
    "as_offload_policy",
]


class ShardingStrategy(enum.Enum):
    """The paper's strategies, as mesh shapes and resharding (FSDP1's names).

    FULL_SHARD: shard over every rank, reshard after forward. SHARD_GRAD_OP: shard over every
    rank, keep parameters unsharded from forward to backward. NO_SHARD: replicate (a shard group
    of one), all-reduce gradients, like DDP. HYBRID_SHARD: shard inside groups, replicate across
    them (needs a 2-D mesh).
    """

    FULL_SHARD = "full_shard"
    SHARD_GRAD_OP = "shard_grad_op"
    NO_SHARD = "no_shard"
    HYBRID_SHARD = "hybrid_shard"


#: The strategies' names as command lines and configs spell them (``"full_shard"``, ...).
STRATEGY_NAMES: tuple[str, ...] = tuple(s.value for s in ShardingStrategy)


def _check_dtype(name: str, value: object) -> None:
    if value is not None and not (isinstance(value, torch.dtype) and value.is_floating_point):
        raise TypeError(
            f"MixedPrecisionPolicy.{name} must be a floating torch.dtype or None, got {value!r}"
        )


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Dtypes a unit computes and communicates in; None keeps the parameter's own dtype.

    param_dtype: unsharded parameters (all-gathered in it) and the forward/backward compute.
    reduce_dtype: gradient reduce-scatter / all-reduce (default: param_dtype).
    output_dtype: floating outputs of the unit's forward are cast to it.
    cast_forward_inputs: cast floating forward inputs to param_dtype.
    buffer_dtype: the unit's module buffers are cast to it once, at initialisation (this
    engine's addition, FSDP1's field; last, so that positional arguments mean what they mean
    in torch's FSDP2 policy).
    The optimizer always steps on the full-precision sharded parameters.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True
    buffer_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "output_dtype", "buffer_dtype"):
            _check_dtype(name, getattr(self, name))


@dataclass(frozen=True)
class OffloadPolicy:
    """Keep sharded parameters, gradients and optimizer state on the compute device."""


@dataclass(frozen=True)
class CPUOffloadPolicy(OffloadPolicy):
    """Keep sharded parameters, gradients (and so optimizer state) in host memory.

    Parameters are copied to the device for the all-gather and gradients back after the
    reduce-scatter; the optimizer steps on the CPU. ``pin_memory`` pins host memory where CUDA
    exists.
    """

    pin_memory: bool = True


def as_mp_policy(policy: object) -> MixedPrecisionPolicy:
    """Ours, torch's FSDP2 ``MixedPrecisionPolicy`` or FSDP1's ``MixedPrecision`` (same
    field meanings; FSDP1's ``cast_forward_inputs`` defaults to False there too)."""
    if policy is None:
        return MixedPrecisionPolicy()
    if isinstance(policy, MixedPrecisionPolicy):
        return policy
    from torch.distributed.fsdp import MixedPrecision
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy

    if isinstance(policy, TorchPolicy):
        return MixedPrecisionPolicy(
            param_dtype=policy.param_dtype,
            reduce_dtype=policy.reduce_dtype,
            output_dtype=policy.output_dtype,
            cast_forward_inputs=policy.cast_forward_inputs,
        )
    if isinstance(policy, MixedPrecision):
        return MixedPrecisionPolicy(
            param_dtype=policy.param_dtype,
            reduce_dtype=policy.reduce_dtype,
            buffer_dtype=policy.buffer_dtype,
            cast_forward_inputs=policy.cast_forward_inputs or policy.cast_root_forward_inputs,
        )
    raise TypeError(
        "mp_policy must be a MixedPrecisionPolicy (fsdp_engine's or torch's) or "
        f"FSDP1's MixedPrecision, got {type(policy).__name__}"
    )


def as_offload_policy(policy: object) -> OffloadPolicy:
    """Ours, torch's FSDP2 ``OffloadPolicy``/``CPUOffloadPolicy`` or FSDP1's ``CPUOffload``."""
    if policy is None:
        return OffloadPolicy()
    if isinstance(policy, OffloadPolicy):
        return policy
    import torch.distributed.fsdp as tfsdp

    if isinstance(policy, tfsdp.CPUOffloadPolicy):
        return CPUOffloadPolicy(pin_memory=policy.pin_memory)
    if isinstance(policy, tfsdp.OffloadPolicy):
        return OffloadPolicy()
    if isinstance(policy, tfsdp.CPUOffload):
        return CPUOffloadPolicy() if policy.offload_params else OffloadPolicy()
    raise TypeError(
        "offload_policy must be an OffloadPolicy (fsdp_engine's or torch's) or "
        f"FSDP1's CPUOffload, got {type(policy).__name__}"
    )
