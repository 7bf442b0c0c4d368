"""`UnitSettings`: what a user can change on a unit at run time (the `FSDPModule` setters),
held in one object that the state and the unit share from `fully_shard` on."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["UnitSettings"]


@dataclass
class UnitSettings:
    """Run-time settings of one unit.

    requires_grad_sync: reduce gradients in this backward (False: accumulate locally).
    reshard_after_forward: free gathered parameters after forward (the root never does).
    reshard_after_forward_auto: ``fully_shard`` was given None (the default): the engine also
        keeps the unit whose forward ends last gathered into backward (Note [last unit
        stays] in ``_state.py``). Cleared by ``set_reshard_after_forward``.
    reshard_after_backward: free them after backward.
    unshard_in_backward: re-gather for backward (False: only valid when nothing in backward
        needs the parameters, e.g. a frozen embedding).
    requires_all_reduce: all-reduce across replicas (hybrid meshes) in this backward.
    divide_factor: divide gradients by this instead of the data-parallel size.
    force_sum_reduction: reduce with a sum, then scale (FSDP2's switch for comm libraries
        without pre-multiplied sums; this engine's backends pick that already).
    forward_prefetch: prefetch the next unit of the last iteration's forward order.
    all_reduce_hook: ``hook(reduced)`` on each reduced flat gradient shard, after the
        replicas' all-reduce (hybrid) or in its place (`FSDPModule.set_all_reduce_hook`);
        ``all_reduce_hook_stream``: the stream it runs in (not with hybrid sharding).
    """

    requires_grad_sync: bool = True
    reshard_after_forward: bool | int = True
    reshard_after_forward_auto: bool = False
    reshard_after_backward: bool = True
    unshard_in_backward: bool = True
    requires_all_reduce: bool = True
    divide_factor: float | None = None
    force_sum_reduction: bool = False
    forward_prefetch: bool = True
    all_reduce_hook: Callable[[Any], None] | None = None
    all_reduce_hook_stream: Any = None
