"""`FSDPUnit`: the runtime of one unit, made of its gather, views and reduce parts.

Note [unit lifecycle]
    1. ``fully_shard``: the unit's parameters are laid out rank-major (Note [rank-major
       layout]); each rank keeps its chunk and the modules get DTensor parameters over it
       (``_shard_init.py``). Lazy initialisation at the root's first forward builds this
       runtime with its context (``_lazy_init.py``).
    2. Gather (``_unit_gather.py``): all-gather the chunks (asynchronously, through the
       memory manager's rate limiter) into a pooled buffer; on wait, copy it to
       parameter-major order. A prefetch starts this early.
    3. Views (``_unit_views.py``): the modules compute with views of that buffer cut from
       one autograd leaf (Note [parameter views]); after forward the DTensors go back and the
       buffer is freed (unless kept until backward), saved-tensor hooks re-gathering it for
       backward.
    4. Reduce (``_unit_reduce.py``): each forward application's node delivers the
       parameters' gradients; they are written in rank-major order (cast to the reduce
       dtype on the way), reduce-scattered (then all-reduced across replicas),
       added into the sharded DTensor gradients, and post-accumulate-grad hooks run.
    5. End of backward (``_state.py``): remaining reductions are waited for, so the optimizer
       sees final sharded gradients.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ._context import UnitContext
from ._flat_param import FlatParameter
from ._limiter_guard import LimiterGuard
from ._unit_gather import GatherPart, GroupRuntime, GroupState
from ._unit_reduce import ReducePart, Reduction
from ._unit_views import ViewsPart

if TYPE_CHECKING:
    import torch

__all__ = ["FSDPUnit", "GroupState", "GroupRuntime"]


@dataclass(eq=False)
class FSDPUnit(GatherPart, ViewsPart, ReducePart):
    """One unit: its flat groups plus the context to communicate and allocate with."""

    fqn: str
    ctx: UnitContext
    groups: list[GroupRuntime] = field(default_factory=list)
    reductions: list[Reduction] = field(default_factory=list)
    on_backward_done: Callable[[], None] | None = None
    limiter_guard: LimiterGuard | None = None
    # Every group's unsharded form is its shard (see `reshard`): nothing to gather or free.
    resident: bool = False
    # Resharded after its backward (not the root, reshard_after_backward): its reductions
    # may reuse the gathered buffer (`take_full`).
    frees_after_backward: bool = False
    # A gradient of this unit's parameters arrived in the backward pass now running
    # (Note [backward that skips the parameters] in ``_state.py``).
    delivered: bool = False

    @classmethod
    def create(cls, fqn: str, ctx: UnitContext, flats: list[FlatParameter]) -> FSDPUnit:
        return cls(fqn, ctx, [GroupRuntime(f) for f in flats])

    @property
    def shows_tp_pieces(self) -> bool:
        """Some parameter is tensor-parallel (Note [flat buffer on a 2-D mesh]): kept
        gathered, even a resident unit registers its tp pieces, as FSDP2 does."""
        return any(g.flat.layout.tps is not None for g in self.groups)

    @property
    def param_dtype(self) -> torch.dtype | None:
        return self.ctx.mp.param_dtype
