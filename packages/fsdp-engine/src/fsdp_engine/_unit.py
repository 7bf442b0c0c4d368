"""`FSDPUnit`: the runtime of one unit: gather its flat parameters, reshard them, and reduce
their gradients (the paper's Fig. 1 and 5, steps 2 to 6)."""

from __future__ import annotations

import enum
import functools
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
    leaf: torch.Tensor | None = None  # autograd leaf over `full` (Note [parameter views])
    leaf_uses: list[int] | None = None  # forward applications through the leaf, not yet
    leaf_full: torch.Tensor | None = None  # reached by backward; the buffer it aliases now
    leaf_idle: torch.Tensor | None = None  # empty tensor an idle leaf aliases instead
    views: list[torch.Tensor] | None = None  # the leaf's views, kept while the buffer stays


@dataclass
class _Reduction:
    group: _GroupRuntime
    out: torch.Tensor
    work: Any
    out_pooled: bool
    source: torch.Tensor | None = None  # the unsharded gradient, alive until the work is done


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
    limiter_guard: LimiterGuard | None = None
    # Every group's unsharded form is its shard (see `reshard`): nothing to gather or free.
    resident: bool = False

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
            self.resident = all(g.full_is_shard for g in self.groups)
            return
        nbytes = layout.padded_numel * dtype.itemsize
        go, ticket = self._guard().acquire(nbytes, prefetch=prefetch)
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

    def _guard(self) -> LimiterGuard:
        if self.limiter_guard is None:
            self.limiter_guard = LimiterGuard.of(self.ctx.memory.limiter)
        return self.limiter_guard

    def wait_unshard(self) -> None:
        """Block until every group is unsharded (issuing what was not issued yet)."""
        for g in self.groups:
            if g.state is not GroupState.UNSHARDED:
                break
        else:
            return
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

    def views_for_forward(self, index: int) -> list[torch.Tensor]:
        """The parameters of group ``index`` as views of its gathered buffer, for one forward.

        With gradients on, the views come from one ``split_with_sizes`` of an autograd leaf
        aliasing the buffer: backward then concatenates every parameter's gradient into one
        flat tensor (one C++ node, zeros for padding) and the leaf's post-accumulate hook hands
        it to `on_flat_grad` (Note [parameter views])."""
        g = self.groups[index]
        full = g.full
        assert full is not None
        layout = g.flat.layout
        if not (g.flat.requires_grad and torch.is_grad_enabled()):
            return g.flat.unflatten(full)
        if g.leaf_full is not full:
            self._point_leaf_at(g, index, full)
        assert g.leaf is not None and g.leaf_uses is not None
        g.leaf_uses[0] += 1
        g.pending_forwards += 1
        g.forward_version = g.flat.version()
        if g.views is not None:
            return g.views
        pieces = g.leaf.split_with_sizes(layout.split_sizes)
        views = [pieces[i] if len(shape) == 1 else pieces[i].view(shape)
                 for i, shape in zip(layout.param_pieces, layout.shapes)]
        if g.full_is_shard:
            # The buffer is the shard itself and stays: so can the views (autograd may run
            # their nodes in any number of backward passes: they save no tensors).
            g.views = views
        return views

    def _point_leaf_at(self, g: _GroupRuntime, index: int, full: torch.Tensor) -> None:
        """Make the group's leaf alias ``full``. The leaf and its hook outlive a gather
        (re-pointing costs far less than a new leaf with a new hook); a leaf that forward
        applications still wait on in backward keeps its buffer, and a new one takes over."""
        if g.leaf is None or (g.leaf_uses is not None and g.leaf_uses[0]):
            g.leaf = full.detach().requires_grad_(True)
            g.leaf_idle = full.new_empty(0)
            g.leaf_uses = uses = [0]
            g.leaf.register_post_accumulate_grad_hook(
                lambda leaf, i=index, u=uses: self.on_flat_grad(i, u, leaf))
        else:
            g.leaf.data = full
        g.leaf_full, g.views = full, None

    def _release_leaf(self, g: _GroupRuntime) -> None:
        """The gathered buffer is going back to the pool: an idle leaf lets go of it."""
        g.leaf_full, g.views = None, None
        if g.leaf is not None and g.leaf_uses is not None and not g.leaf_uses[0]:
            g.leaf.data = g.leaf_idle

    def end_backward(self) -> None:
        """Backward is over: forward applications whose gradients never came (the recompute
        of activation checkpointing uses a leaf backward does not reach) are forgotten."""
        for g in self.groups:
            if g.leaf_uses is not None:
                g.leaf_uses[0] = 0

    def check_unchanged(self, g: _GroupRuntime, when: str) -> None:
        """Parameters must not change between a forward and its backward (the version
        `views_for_forward` noted)."""
        if g.forward_version is not None and g.flat.version() != g.forward_version:
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
        for g in self.groups:
            if g.ticket is not None:
                self._guard().release(*g.ticket, after=after)
                g.ticket = None

    def reshard(self, *, after_forward: bool, after: Any = None, aliases: bool = False) -> None:
        """Free the unsharded buffers (or keep the smaller post-forward piece).

        A group whose unsharded form is its own shard (a shard group of one, no cast) has
        nothing to free: it stays unsharded unless ``aliases`` is set."""
        if self.resident and not aliases:
            return
        self.resident = False
        keep_partial = after_forward and self.ctx.post_forward is not None
        for g in self.groups:
            if g.state is GroupState.SHARDED or (g.full_is_shard and not aliases):
                continue
            if g.state is GroupState.UNSHARDING:
                g.work.wait()
                self._after_gather(g)
            if g.state is not GroupState.UNSHARDED:
                continue
            if keep_partial and not g.full_is_shard:
                g.partial = self._cut_partial(g)
            if not g.full_is_shard:
                self.ctx.memory.free(g.full, after=after)
            self._release_leaf(g)
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
    def release_host_memory(self) -> None:
        """This unit's backward is over, and with it the per-parameter gradients autograd made
        for it: tell a memory layer that trims the host heap (Note [host heap] in
        fsdp_memory) how many bytes that freed."""
        if self._host_release is not None:
            self._host_release(self._grad_bytes)

    @functools.cached_property
    def _host_release(self) -> Callable[[int], Any] | None:
        return getattr(self.ctx.memory, "release_host_heap", None)  # optional in a memory layer

    @functools.cached_property
    def _grad_bytes(self) -> int:
        return sum(g.flat.layout.padded_numel * self._gather_dtype(g).itemsize
                   for g in self.groups if g.flat.requires_grad)

    def on_flat_grad(self, index: int, uses: list[int], leaf: torch.Tensor) -> None:
        """Post-accumulate hook of a gathered buffer: ``leaf.grad`` holds the flat gradient of
        ``uses[0]`` forward applications (Note [parameter views]). Accumulate it and, when no
        application is pending any more, start the reduction."""
        g = self.groups[index]
        grad, leaf.grad = leaf.grad, None
        n, uses[0] = uses[0], 0
        if n == 0 or g.pending_forwards < n or grad is None:
            raise RuntimeError(
                f"FSDP unit '{self.fqn or '<root>'}': backward reached its parameters more often "
                "than forward used them (backward twice through one graph, e.g. with "
                "retain_graph=True); run forward again before each backward")
        if leaf is not g.leaf:
            leaf.data = leaf.new_empty(0)  # a replaced leaf: let its old buffer go
        elif g.leaf_full is None:
            leaf.data = g.leaf_idle
        self.check_unchanged(g, "during backward")
        reduce_dtype = self.ctx.mp.reduce_dtype
        if reduce_dtype is not None and grad.dtype != reduce_dtype:
            grad = grad.to(reduce_dtype)
        if g.grad_accum is None:
            g.grad_accum = grad
        else:
            g.grad_accum.add_(grad)
        g.pending_forwards -= n
        if g.pending_forwards == 0 and self.requires_grad_sync:
            self._start_reduction(g)
        if self.on_backward_done is not None:
            self.on_backward_done()

    def _start_reduction(self, g: _GroupRuntime) -> None:
        flat_grad, g.grad_accum = g.grad_accum, None
        if flat_grad is None:
            return
        ctx = self.ctx
        shard = ctx.shard
        if shard.world_size == 1:
            if ctx.replicate is None and not ctx.divide_factor:
                self._accumulate_sharded(g.flat, flat_grad, owned=True)  # nothing to reduce
            else:
                self.reductions.append(_Reduction(g, flat_grad, None, False))
            return
        out = self.ctx.memory.allocate(g.flat.layout.shard_numel, flat_grad.dtype)
        op = self._reduce_op(shard.world_size)
        work = shard.reduce_scatter_tensor(out, flat_grad, op=op, async_op=True)
        # flat_grad stays referenced by the reduction until its work completes.
        self.reductions.append(_Reduction(g, out, work, True, flat_grad))

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
        for red in self.reductions:
            self._finish(red)
        self.reductions.clear()

    def _finish(self, red: _Reduction) -> None:
        from fsdp_comm import ReduceOp

        if red.work is not None:
            red.work.wait()
            red.source = None
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
        if red.out_pooled:
            self.ctx.memory.free(red.out)

    @staticmethod
    def _accumulate_sharded(flat: FlatParameter, reduced: torch.Tensor, *,
                            owned: bool = False) -> None:
        """Add into the sharded gradient, which lives with the shard (the host with offload).
        ``owned``: nothing else holds ``reduced``, so it may become the gradient itself."""
        sharded = flat.sharded_grad
        if sharded is not None and flat.grads_attached():
            # get_device() is an int (-1 on CPU): cheaper than comparing torch.device objects.
            if reduced.dtype != sharded.dtype or reduced.get_device() != sharded.get_device():
                reduced = reduced.to(device=sharded.device, dtype=sharded.dtype)
            sharded.add_(reduced)
        else:
            flat.attach_sharded_grad(reduced.to(device=flat.local_shard.device, dtype=flat.dtype,
                                                copy=not owned))
