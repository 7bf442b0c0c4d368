"""`FSDPUnit`: the runtime of one unit: gather its flat parameters, reshard them, and reduce
their gradients (the paper's Fig. 1 and 5, steps 2 to 6)."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ._context import UnitContext
from ._flat_param import FlatParameter
from ._limiter_guard import LimiterGuard

__all__ = ["FSDPUnit", "GroupState"]


class GroupState(enum.Enum):
    SHARDED = "sharded"
    UNSHARDING = "unsharding"
    UNSHARDED = "unsharded"
    PARTIAL = "partial"  # resharded to the smaller post-forward group (int reshard_after_forward)


@dataclass(eq=False)
class _GroupRuntime:
    """Mutable state of one flat group (trainable or frozen) of a unit."""

    flat: FlatParameter
    state: GroupState = GroupState.SHARDED
    full: torch.Tensor | None = None
    full_is_shard: bool = False  # NO_SHARD without a cast: the views alias the local shard
    work: Any = None
    send: torch.Tensor | None = None
    ticket: Any = None
    partial: torch.Tensor | None = None
    grad_accum: torch.Tensor | None = None  # unsharded gradient not yet reduced
    pending_forwards: int = 0  # forward applications whose backward has not run yet
    forward_version: int | None = None  # local shard's version at the last forward


@dataclass
class _Reduction:
    group: _GroupRuntime
    out: torch.Tensor
    work: Any
    flat_grad: torch.Tensor
    out_pooled: bool


@dataclass(eq=False)
class FSDPUnit:
    """One unit: its flat groups plus the context to communicate and allocate with."""

    fqn: str
    ctx: UnitContext
    groups: list[_GroupRuntime] = field(default_factory=list)
    reductions: list[_Reduction] = field(default_factory=list)
    requires_grad_sync: bool = True
    reshard_after_backward: bool = True
    on_backward_done: Callable[[], None] | None = None

    @classmethod
    def create(cls, fqn: str, ctx: UnitContext, flats: list[FlatParameter]) -> FSDPUnit:
        return cls(fqn, ctx, [_GroupRuntime(f) for f in flats])

    # ---- parameters ----------------------------------------------------------------------
    @property
    def param_dtype(self) -> torch.dtype | None:
        return self.ctx.mp.param_dtype

    def _gather_dtype(self, g: _GroupRuntime) -> torch.dtype:
        return self.param_dtype or g.flat.dtype

    @property
    def is_unsharded(self) -> bool:
        return all(g.state is GroupState.UNSHARDED for g in self.groups)

    def start_unshard(self, *, prefetch: bool = False) -> None:
        """Issue the all-gathers this unit still needs (asynchronously)."""
        for g in self.groups:
            if g.state in (GroupState.SHARDED, GroupState.PARTIAL):
                self._start_gather(g, prefetch)

    def _start_gather(self, g: _GroupRuntime, prefetch: bool) -> None:
        layout, dtype = g.flat.layout, self._gather_dtype(g)
        partial = g.state is GroupState.PARTIAL
        backend = self.ctx.post_forward if partial else self.ctx.shard
        source = g.partial if partial else g.flat.local_shard
        if backend.world_size == 1 and not partial and dtype == g.flat.dtype:
            g.full, g.full_is_shard, g.state = g.flat.local_shard, True, GroupState.UNSHARDED
            return
        nbytes = layout.padded_numel * torch.empty(0, dtype=dtype).element_size()
        guard = LimiterGuard.of(self.ctx.memory.limiter)
        go, ticket = guard.acquire(nbytes, prefetch=prefetch)
        if not go:
            return
        mm = self.ctx.memory
        if source.dtype != dtype or source.device != self.ctx.device:
            # Mixed precision casts into a send buffer; CPU offload copies the host shard to
            # the device in the same step (pinned host memory makes it asynchronous).
            g.send = mm.allocate(source.numel(), dtype)
            g.send.copy_(source, non_blocking=True)
            source = g.send
        g.full = mm.allocate(layout.padded_numel, dtype)
        g.ticket = None if ticket is None else (ticket, nbytes)
        g.work = backend.all_gather_into_tensor(g.full, source, async_op=True)
        g.state = GroupState.UNSHARDING

    def wait_unshard(self) -> None:
        """Block until every group is unsharded (issuing what was not issued yet)."""
        self.start_unshard()
        for g in self.groups:
            if g.state is GroupState.UNSHARDING:
                g.work.wait()
                self._after_gather(g)

    def _after_gather(self, g: _GroupRuntime) -> None:
        if g.send is not None:
            self.ctx.memory.free(g.send, after=g.work)
            g.send = None
        if g.partial is not None:
            self.ctx.memory.free(g.partial, after=g.work)
            g.partial = None
        g.work, g.state = None, GroupState.UNSHARDED

    def mark_forward(self, g: _GroupRuntime) -> None:
        """Remember the shard's version: parameters must not change until backward is done."""
        g.forward_version = self._version(g)

    @staticmethod
    def _version(g: _GroupRuntime) -> int:
        # In-place writes through a parameter bump its own counter, not the shard's.
        return g.flat.local_shard._version + sum(p._version for p in g.flat.params)

    def check_unchanged(self, g: _GroupRuntime, when: str) -> None:
        if g.forward_version is not None and self._version(g) != g.forward_version:
            raise RuntimeError(
                f"FSDP unit '{self.fqn or '<root>'}': its parameters were modified in place "
                f"between forward and backward (detected {when}); gradients would be computed "
                "against different values. Step the optimizer after backward.")

    def full_for_backward(self, index: int) -> torch.Tensor:
        """The gathered buffer of group ``index``, re-gathering it if it was freed."""
        g = self.groups[index]
        self.check_unchanged(g, "re-gathering for backward")
        if g.state is not GroupState.UNSHARDED:
            self.wait_unshard()
        assert g.full is not None
        return g.full

    def release_ticket(self, *, after: Any = None) -> None:
        """The unit's all-gather is consumed: stop counting it as in flight."""
        guard = LimiterGuard.of(self.ctx.memory.limiter)
        for g in self.groups:
            if g.ticket is not None:
                guard.release(*g.ticket, after=after)
                g.ticket = None

    def reshard(self, *, after_forward: bool, after: Any = None) -> None:
        """Free the unsharded buffers (or keep the smaller post-forward piece)."""
        keep_partial = after_forward and self.ctx.post_forward is not None
        for g in self.groups:
            if g.state is GroupState.UNSHARDING:
                g.work.wait()
                self._after_gather(g)
            if g.state is not GroupState.UNSHARDED:
                continue
            if keep_partial and not g.full_is_shard:
                g.partial = self._cut_partial(g)
            if not g.full_is_shard:
                self.ctx.memory.free(g.full, after=after)
            g.full, g.full_is_shard = None, False
            g.state = GroupState.PARTIAL if g.partial is not None else GroupState.SHARDED
        self.release_ticket(after=after)

    def _cut_partial(self, g: _GroupRuntime) -> torch.Tensor:
        pf = self.ctx.post_forward
        piece = g.flat.layout.padded_numel // pf.world_size
        kept = self.ctx.memory.allocate(piece, g.full.dtype)
        kept.copy_(g.full[pf.rank * piece:(pf.rank + 1) * piece])
        return kept

    # ---- gradients -----------------------------------------------------------------------
    def accumulate_grads(self, index: int, grads: tuple[torch.Tensor | None, ...]) -> None:
        """Add one backward application's parameter gradients into the unsharded buffer and,
        when the last pending application is done, start the reduction."""
        g = self.groups[index]
        if g.pending_forwards == 0:
            raise RuntimeError(
                f"FSDP unit '{self.fqn or '<root>'}': backward reached its parameters more often "
                "than forward used them (backward twice through one graph, e.g. with "
                "retain_graph=True); run forward again before each backward")
        self.check_unchanged(g, "during backward")
        flat_grad = self._pack(g, grads)
        if g.grad_accum is None:
            g.grad_accum = flat_grad
        else:
            g.grad_accum.add_(flat_grad)
            self.ctx.memory.free(flat_grad)
        g.pending_forwards = max(0, g.pending_forwards - 1)
        if g.pending_forwards == 0 and self.requires_grad_sync:
            self._start_reduction(g)
        if self.on_backward_done is not None:
            self.on_backward_done()

    def _pack(self, g: _GroupRuntime, grads: tuple[torch.Tensor | None, ...]) -> torch.Tensor:
        """One flat gradient in the reduce dtype: each parameter's gradient at its offset,
        zeros in padding and for parameters that got no gradient."""
        layout = g.flat.layout
        dtype = self.ctx.mp.reduce_dtype or self._gather_dtype(g)
        flat = self.ctx.memory.allocate(layout.padded_numel, dtype)
        cursor = 0
        for slot, grad in zip(layout.slots, grads):
            if slot.offset > cursor:
                flat[cursor:slot.offset].zero_()
            piece = flat[slot.offset:slot.offset + slot.numel]
            if grad is None:
                piece.zero_()
            else:
                piece.copy_(grad.reshape(-1))
            cursor = slot.offset + slot.numel
        flat[cursor:].zero_()
        return flat

    def _start_reduction(self, g: _GroupRuntime) -> None:
        flat_grad, g.grad_accum = g.grad_accum, None
        if flat_grad is None:
            return
        shard = self.ctx.shard
        op = self._reduce_op(shard.world_size)
        if shard.world_size == 1:
            self.reductions.append(_Reduction(g, flat_grad, None, flat_grad, True))
            return
        out = self.ctx.memory.allocate(g.flat.layout.shard_numel, flat_grad.dtype)
        work = shard.reduce_scatter_tensor(out, flat_grad, op=op, async_op=True)
        self.reductions.append(_Reduction(g, out, work, flat_grad, True))

    def _reduce_op(self, world_size: int) -> Any:
        from fsdp_comm import ReduceOp

        factor = self.ctx.divide_factor or float(self.ctx.data_parallel_size)
        return ReduceOp.premul_sum(1.0 / factor)

    def flush_unreduced(self) -> None:
        """Start reductions of gradients whose backward applications did not all run."""
        if not self.requires_grad_sync:
            return
        for g in self.groups:
            if g.grad_accum is not None:
                g.pending_forwards = 0
                self._start_reduction(g)

    def finish_reductions(self) -> None:
        """Wait for this unit's reductions and add the results into the sharded gradients."""
        from fsdp_comm import ReduceOp

        for red in self.reductions:
            if red.work is not None:
                red.work.wait()
                if red.flat_grad is not red.out:
                    self.ctx.memory.free(red.flat_grad)
            rep = self.ctx.replicate
            if red.work is None:  # no shard group: the whole reduction is across replicas
                factor = self.ctx.divide_factor or float(self.ctx.data_parallel_size)
                if rep is not None:
                    rep.all_reduce(red.out, op=ReduceOp.premul_sum(1.0 / factor))
                elif factor != 1.0:
                    red.out.mul_(1.0 / factor)
            elif rep is not None:
                rep.all_reduce(red.out, op=ReduceOp.SUM)
            self._accumulate_sharded(red.group.flat, red.out)
            self.ctx.memory.free(red.out)
        self.reductions.clear()

    @staticmethod
    def _accumulate_sharded(flat: FlatParameter, reduced: torch.Tensor) -> None:
        """Add into the sharded gradient, which lives with the shard (the host with offload)."""
        home = flat.local_shard.device
        if flat.grads_attached():
            assert flat.sharded_grad is not None
            flat.sharded_grad.add_(reduced.to(device=home, dtype=flat.dtype))
        else:
            flat.attach_sharded_grad(reduced.to(device=home, dtype=flat.dtype, copy=True))
