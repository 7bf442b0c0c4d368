"""Reducing a unit's gradients: take each forward application's per-parameter gradients,
write them in rank-major order (or accumulate them while applications are pending),
reduce-scatter (and all-reduce across replicas), add the result into the
sharded DTensor gradients, and run the parameters' post-accumulate-grad hooks (Note [unit
lifecycle] in ``_unit.py``, steps 5 and 6).

Note [unused parameters]
    The gradient a unit reduces has zeros for a parameter the forward did not use (Note
    [parameter views]): a skipped
    head of ``fully_shard([norm, head])``, an expert no token was routed to, a parameter
    frozen with ``requires_grad_(False)`` after ``fully_shard`` (its view is detached). FSDP2
    leaves such a parameter's ``.grad`` None, and an optimizer skips it; a zero gradient would
    be stepped (weight decay, Adam's moments). So each forward application's node notes
    the parameters it gave no gradient to (None among its gradients: ``GroupRuntime.unused``,
    the intersection over applications). The whole flat gradient is still reduced (one
    collective per unit, and a rank that did use the parameter contributes to it); then a
    parameter that no application on this rank reached gets a ``.grad`` only if it had one
    already (accumulation) or its reduced rows are not all zero (another rank used it).
    That last look happens only for parameters left unused here, so a step that uses every
    parameter pays nothing more. A rank that holds none of a
    parameter's rows (fewer rows than ranks) decides by its own use alone; its ``.grad`` is
    an empty shard either way.

Note [one gradient pass]
    A forward application's node hands the unit each parameter's gradient (Note [one node
    per application] in ``_views_node.py``). When they are reduced at once (the common
    step: no other application pending, no accumulation) they are written straight into
    the reduce-scatter's input, in rank-major order and the reduce dtype, by one ``cat``
    (``FlatLayout.grads_to_rank_major``; on a GPU ``torch._chunk_cat``, FSDP2's copy-in):
    with bf16 parameters and fp32 reduction, 2 bytes read and 4 written per parameter. Before,
    autograd's split first concatenated them into a bf16 flat gradient (4 bytes more per
    parameter), which the rank-major copy then read and cast; before that, a cast to a new
    fp32 flat gradient came in between too. Gradients that wait (gradient accumulation,
    several applications) are accumulated parameter-major in the reduce dtype, as before.
    With one shard the rank-major write is the sharded gradient itself. Measured with
    ``python -m fsdp.bench.traffic --model small`` (2026-11-27): world size 2, 25.99 to 21.99
    copy bytes per parameter (FSDP2 35.36); world size 1, 20.28 to 16.28 (FSDP2 33.51).
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch

from ._context import UnitContext
from ._flat_param import _IS_NONE, FlatParameter
from ._host_grads import HostGradCopies
from ._timeline import LANE_REDUCE
from ._unit_gather import GroupRuntime
from ._views_node import Application

__all__ = ["Reduction", "ReducePart"]

_HOOKS = operator.attrgetter("_post_accumulate_grad_hooks")
_NONE_UNUSED: frozenset[int] = frozenset()


@dataclass
class Reduction:
    group: GroupRuntime
    out: torch.Tensor
    work: Any
    out_pooled: bool
    source: torch.Tensor | None = None  # the rank-major gradient, alive until the work is done
    unused: frozenset[int] | None = None  # Note [unused parameters]


class ReducePart:
    """Gradient accumulation and reduction of a unit."""

    fqn: str
    ctx: UnitContext
    groups: list[GroupRuntime]
    reductions: list[Reduction]
    on_backward_done: Callable[[], None] | None

    frees_after_backward: bool  # set by the unit's state: resharded after its backward
    delivered: bool  # a gradient arrived in this backward pass (read by the unit's state)

    # Provided by the views and gather parts of the unit:
    check_unchanged: Callable[[GroupRuntime, str], None]
    take_full: Callable[[GroupRuntime, int, torch.dtype], torch.Tensor | None]

    def drop_unused_grads(self) -> None:
        """At the start of a forward: free sharded gradients no ``.grad`` holds any more."""
        for g in self.groups:
            g.flat.drop_unused_grad()

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
        dtype = self.ctx.mp.param_dtype
        return sum(
            g.flat.layout.padded_numel * (dtype or g.flat.dtype).itemsize
            for g in self.groups
            if g.flat.requires_grad
        )

    def on_param_grads(self, app: Application, grads: tuple[torch.Tensor | None, ...]) -> None:
        """Backward of one forward application (its `ViewsNode`): ``grads`` holds each
        parameter's gradient, None where this application gave it none. Accumulate them,
        and when no application is pending any more start the reduction (Note [one node
        per application] in ``_views_node.py``)."""
        tl = self.ctx.timeline  # Note [step timeline]: the unit's backward range ends
        t0 = tl.hook_begin(self.fqn, closes="backward") if tl is not None else 0
        g, uses = app.group, app.uses
        if app.counted:
            if not uses[0]:
                raise RuntimeError(
                    f"FSDP unit '{self.fqn or '<root>'}': backward reached its parameters more "
                    "often than forward used them (backward twice through one graph, e.g. with "
                    "retain_graph=True); run forward again before each backward"
                )
            uses[0] -= 1
            # Never below zero: a backward may deliver an application the end of an earlier
            # backward already flushed (its reduction then adds into the sharded gradients).
            g.pending_forwards = max(0, g.pending_forwards - 1)
        self.delivered = True
        if not uses[0]:
            leaf = app.leaf
            if leaf is not g.leaf:
                leaf.data = leaf.new_empty(0)  # a replaced leaf: let its old buffer go
            elif g.leaf_full is None:
                assert g.leaf_idle is not None  # made with the leaf
                leaf.data = g.leaf_idle
        self.check_unchanged(g, "during backward")
        _note_unused(g, grads)
        reduce_now = g.pending_forwards == 0 and self.ctx.settings.requires_grad_sync
        if g.grad_accum is None and reduce_now:
            self._start_reduction(g, grads)  # Note [one gradient pass]
        else:
            layout = g.flat.layout
            if g.grad_accum is None:
                like = _first_grad(grads, g)
                dtype = self.ctx.mp.reduce_dtype or like.dtype
                g.grad_accum = layout.param_major(grads, like.new_empty(0, dtype=dtype))
            else:
                for slot, x in zip(layout.slots, grads):
                    if x is not None:
                        layout.full_view(g.grad_accum, slot).add_(x)  # adding casts
            if reduce_now:
                self._start_reduction(g)
        if self.on_backward_done is not None:
            self.on_backward_done()
        if tl is not None:
            tl.hook_end(self.fqn, t0)

    def _start_reduction(
        self, g: GroupRuntime, grads: tuple[torch.Tensor | None, ...] | None = None
    ) -> None:
        """Reduce group ``g``'s accumulated gradient, or, given ``grads``, one application's
        per-parameter gradients written straight into the collective's input."""
        flat_grad, g.grad_accum = g.grad_accum, None
        unused, g.unused = g.unused, None
        if flat_grad is None and grads is None:
            return
        ctx = self.ctx
        shard = ctx.shard
        if grads is not None and shard.world_size == 1 and _adds_in_place(ctx, g, grads):
            # One shard, nothing to reduce, the gradients already attached (accumulation):
            # each parameter's gradient adds into its own, no flat gradient in between.
            self._run_post_accumulate_hooks(g.flat)
            return
        layout = g.flat.layout
        like = flat_grad if flat_grad is not None else _first_grad(grads, g)
        dtype = ctx.mp.reduce_dtype or like.dtype
        nbytes = layout.padded_numel * dtype.itemsize
        # `stages` and `reduce_scatter_copy_in` (in `_start_staged`): fsdp_comm.Backend's, not
        # in the CommBackend protocol.
        staged = shard.world_size > 1 and shard.stages("reduce_scatter_tensor", nbytes)  # type: ignore[attr-defined]
        if shard.world_size == 1 or staged:
            # These paths take a parameter-major flat gradient (with one shard both orders
            # coincide, and the one-pass write gives it).
            if flat_grad is None and not staged:
                assert grads is not None  # one of them is given
                flat_grad = torch.empty(layout.padded_numel, dtype=dtype, device=like.device)
                layout.grads_to_rank_major(grads, flat_grad)
            elif flat_grad is None:
                assert grads is not None  # one of them is given
                flat_grad = layout.param_major(grads, like.new_empty(0, dtype=dtype))
            elif flat_grad.dtype != dtype:
                flat_grad = flat_grad.to(dtype)
        if shard.world_size == 1:
            assert flat_grad is not None  # made above
            if ctx.replicate is None and not ctx.divide_factor:
                # nothing to reduce
                self._accumulate_sharded(g.flat, flat_grad, owned=True, unused=unused)
                self._run_post_accumulate_hooks(g.flat)
            else:
                self.reductions.append(Reduction(g, flat_grad, None, False, unused=unused))
            return
        mm = ctx.memory
        if staged:
            assert flat_grad is not None  # made above
            self._start_staged(g, flat_grad, unused)
            return
        source = None
        if self.frees_after_backward:
            source = self.take_full(g, layout.padded_numel, dtype)
        if source is None:
            source = mm.allocate(layout.padded_numel, dtype)
        # copy(arg, source): per-parameter gradients, or the flat gradient, into the input.
        copy: Callable[[Any, torch.Tensor], None]
        arg: Any
        if flat_grad is None:
            copy, arg = layout.grads_to_rank_major, grads
        else:
            copy, arg = layout.to_rank_major, flat_grad  # Note [rank-major layout]
        tl = ctx.timeline
        if tl is None:
            copy(arg, source)
        else:
            tl.host_copy(self.fqn, "copy_in", copy, arg, source)
        del flat_grad, arg, grads
        # Note [reducing into the gradient]: when this step has no sharded gradient yet (after
        # zero_grad(set_to_none=True)) and the reduced dtype and device are the gradient's, the
        # reduce-scatter's output is a fresh tensor that becomes the gradient itself, where a
        # pooled output was copied into a newly allocated gradient (one shard-sized copy per
        # unit per step, and the same fresh pages either way).
        out, owned = self._reduce_output(g, source)
        work = self._issue_reduce(shard.reduce_scatter_tensor, out, source)
        self.reductions.append(Reduction(g, out, work, not owned, source, unused))

    def _start_staged(
        self, g: GroupRuntime, flat_grad: torch.Tensor, unused: frozenset[int] | None
    ) -> None:
        """Note [staged collectives] in fsdp_comm: the copy to rank-major order writes the
        backend's shared segment directly; no rank-major buffer here."""
        tl, to_rank_major = self.ctx.timeline, g.flat.layout.to_rank_major
        copy_in = (
            to_rank_major
            if tl is None
            else functools.partial(tl.host_copy, self.fqn, "copy_in", to_rank_major)
        )
        out, owned = self._reduce_output(g, flat_grad)
        work = self._issue_reduce(self.ctx.shard.reduce_scatter_copy_in, out, flat_grad, copy_in)  # type: ignore[attr-defined]
        self.reductions.append(Reduction(g, out, work, not owned, unused=unused))

    def _reduce_output(self, g: GroupRuntime, like: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """The reduce-scatter's output, and whether it may become the gradient itself."""
        owned = _output_can_be_grad(g.flat, like)
        numel = g.flat.layout.shard_numel
        out = (
            torch.empty(numel, dtype=like.dtype, device=like.device)
            if owned
            else self.ctx.memory.allocate(numel, like.dtype)
        )
        return out, owned

    def _issue_reduce(self, call: Callable[..., Any], *args: Any) -> Any:
        tl = self.ctx.timeline
        if tl is None:
            return call(*args, op=self._reduce_op(), async_op=True)
        return tl.collective(
            LANE_REDUCE, self.fqn, "reduce", call, *args, op=self._reduce_op(), async_op=True
        )

    def _replicate(self) -> Any:
        return self.ctx.replicate if self.ctx.settings.requires_all_reduce else None

    def _reduce_op(self) -> Any:
        from fsdp_comm import ReduceOp

        factor = self.ctx.divide_factor or float(self.ctx.data_parallel_size)
        return ReduceOp.premul_sum(1.0 / factor)

    def flush_unreduced(self) -> None:
        """Start reductions of gradients whose backward applications did not all run."""
        if not self.ctx.settings.requires_grad_sync:
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

    def _finish(self, red: Reduction) -> None:
        from fsdp_comm import ReduceOp

        mm, tl = self.ctx.memory, self.ctx.timeline
        if red.work is not None:
            if tl is None:
                red.work.wait()
            else:
                tl.wait(LANE_REDUCE, self.fqn, "reduce", red.work)
            if red.source is not None:
                mm.free(red.source)
                red.source = None
        g = red.group
        if self.ctx.replicate is not None and not self.ctx.settings.requires_all_reduce:
            _hold_partial(g, red)  # Note [partial reductions]
            if red.out_pooled:
                mm.free(red.out)
            return
        rep = self._replicate()
        unused = red.unused
        if rep is not None and g.partial_reduced is not None:
            red.out.add_(g.partial_reduced)
            unused = _both_unused(unused, g.partial_unused)
            g.partial_reduced, g.partial_unused = None, None
        if red.work is None:  # no shard group: the whole reduction is across replicas
            factor = self.ctx.divide_factor or float(self.ctx.data_parallel_size)
            if rep is not None:
                _all_reduce(tl, self.fqn, rep, red.out, ReduceOp.premul_sum(1.0 / factor))
            elif factor != 1.0:
                red.out.mul_(1.0 / factor)
        elif rep is not None:
            _all_reduce(tl, self.fqn, rep, red.out, ReduceOp.SUM)
        hook = self.ctx.settings.all_reduce_hook
        if hook is not None:
            _run_hook(hook, self.ctx.settings.all_reduce_hook_stream, red.out)
        after = self._accumulate_sharded(g.flat, red.out, owned=not red.out_pooled, unused=unused)
        if red.out_pooled:
            mm.free(red.out, after=after)  # after its copy to the host, if one is queued
        self._run_post_accumulate_hooks(g.flat)

    def _accumulate_sharded(
        self,
        flat: FlatParameter,
        reduced: torch.Tensor,
        *,
        owned: bool = False,
        unused: frozenset[int] | None = None,
    ) -> Any:
        """Add into the sharded gradient, which lives with the shard (the host with offload).
        The gradient buffer outlives ``zero_grad(set_to_none=True)``: a gradient set to None
        is overwritten instead of added to, and the same DTensor objects are re-attached.
        ``owned``: nothing else holds ``reduced``, so it may become the gradient itself.
        ``unused``: parameters this backward gave no gradient to (Note [unused parameters]).
        Returns the event after which ``reduced`` may be reused (a copy to the host still
        reading it: Note [gradients to the host]), or None."""
        sharded = flat.sharded_grad
        to_host = (
            self._host_copies if reduced.is_cuda and flat.local_shard.device.type == "cpu" else None
        )
        if sharded is not None and flat.grads_attached():
            if to_host is not None and sharded.device.type == "cpu":
                return to_host.add_later(reduced, sharded)
            # get_device() is an int (-1 on CPU): cheaper than comparing torch.device objects.
            if reduced.dtype != sharded.dtype or reduced.get_device() != sharded.get_device():
                reduced = reduced.to(device=sharded.device, dtype=sharded.dtype)
            sharded.add_(reduced)
            return None
        give = _gradients_to_give(flat, reduced, unused) if unused else None
        if sharded is not None and flat.any_grad_attached():
            _accumulate_partly(flat, reduced, give)
            return None
        after = None
        if to_host is not None:
            if sharded is None:
                sharded = torch.empty(reduced.shape, dtype=flat.dtype, pin_memory=True)
            after = to_host.copy(reduced, sharded)
        elif sharded is None:
            sharded = _new_sharded_grad(flat, reduced, owned)
        else:
            sharded.copy_(reduced)
        flat.attach_sharded_grad(sharded, give)
        return after

    @functools.cached_property
    def _host_copies(self) -> HostGradCopies | None:
        """Note [gradients to the host]; None with a memory layer that cannot copy."""
        memory = self.ctx.memory
        return HostGradCopies(memory) if callable(getattr(memory, "copy_to_host", None)) else None

    def settle_host_grads(self) -> None:
        """End of backward: the gradients queued to the host are there (Note [gradients to
        the host])."""
        if "_host_copies" in self.__dict__ and self._host_copies is not None:
            self._host_copies.settle()

    def _run_post_accumulate_hooks(self, flat: FlatParameter) -> None:
        """The sharded gradients are final for this backward: run hooks users registered with
        ``param.register_post_accumulate_grad_hook`` (autograd never accumulates into the
        DTensor parameters itself, so it never would). They read ``.grad`` now: gradients
        on their way to the host arrive first."""
        if not any(map(_HOOKS, flat.params)):
            return
        self.settle_host_grads()
        for p in flat.params:
            hooks = p._post_accumulate_grad_hooks
            if hooks:
                for hook in tuple(hooks.values()):
                    hook(p)


def _all_reduce(tl: Any, fqn: str, rep: Any, tensor: torch.Tensor, op: Any) -> None:
    """The replica all-reduce (synchronous), timed while a timeline records."""
    if tl is None:
        rep.all_reduce(tensor, op=op)
    else:
        tl.collective(LANE_REDUCE, fqn, "all_reduce", rep.all_reduce, tensor, op=op)


def _output_can_be_grad(flat: FlatParameter, source: torch.Tensor) -> bool:
    """Note [reducing into the gradient]: no sharded gradient yet, and nothing to convert."""
    return (
        flat.sharded_grad is None
        and source.dtype == flat.dtype
        and source.device == flat.local_shard.device
    )


def _new_sharded_grad(flat: FlatParameter, reduced: torch.Tensor, owned: bool) -> torch.Tensor:
    """The first sharded gradient of a step. With CPU offload it goes to pinned host memory:
    a device-to-pageable copy ran at a fraction of the speed on an H100 (2026-11-23 trace:
    34 `DtoH (Device -> Pageable)` copies per two steps, where FSDP2 copies to pinned)."""
    home = flat.local_shard.device
    if home.type == "cpu" and reduced.is_cuda:
        grad = torch.empty(reduced.shape, dtype=flat.dtype, pin_memory=True)
        return grad.copy_(reduced)
    return reduced.to(device=home, dtype=flat.dtype, copy=not owned)


def _run_hook(hook: Callable[[torch.Tensor], None], stream: Any, out: torch.Tensor) -> None:
    """`FSDPModule.set_all_reduce_hook`'s hook, in its stream if one was given."""
    if stream is None:
        hook(out)
        return
    device = torch.get_device_module(out.device.type)
    if out.is_cuda:  # the hook's stream sees the reduced values, and ours sees its result
        stream.wait_stream(device.current_stream())
    with device.stream(stream):
        hook(out)
    if out.is_cuda:
        device.current_stream().wait_stream(stream)


def _hold_partial(g: GroupRuntime, red: Reduction) -> None:
    """Note [partial reductions]: hybrid sharding with ``set_requires_all_reduce(False)``
    (gradient accumulation across replicas): the reduce-scattered gradient is kept, not yet
    all-reduced and not yet the parameters' ``.grad``; the next reduction that all-reduces
    adds it in first, so every accumulated micro-batch crosses the replicas exactly once
    (FSDP2 keeps its ``partial_reduce_output`` the same way). Before this, each partial result
    went straight into ``.grad`` and never reached the other replicas (gradients off by up to
    0.016 on a 2x2 mesh)."""
    if g.partial_reduced is None:
        g.partial_reduced = red.out if not red.out_pooled else red.out.clone()
        g.partial_unused = red.unused
    else:
        g.partial_reduced.add_(red.out)
        g.partial_unused = _both_unused(g.partial_unused, red.unused)


def _both_unused(a: frozenset[int] | None, b: frozenset[int] | None) -> frozenset[int] | None:
    """Parameters neither of two accumulated gradients reached (None: every one reached)."""
    if a is None or b is None:
        return None
    return a & b


def _gradients_to_give(
    flat: FlatParameter, reduced: torch.Tensor, unused: frozenset[int]
) -> list[bool]:
    """Note [unused parameters]: which parameters get a ``.grad`` from this reduction. Those a
    forward application reached, those holding a gradient already (accumulation), and those
    this rank did not use but another did: the reduced rows of such a parameter are not all
    zero (only looked at for parameters this rank left unused, so the common step pays
    nothing; on a GPU it is one host sync for all of them)."""
    layout, params = flat.layout, flat.params
    give = [i not in unused or params[i].grad is not None for i in range(len(params))]
    ask = [i for i, yes in enumerate(give) if not yes and params[i].requires_grad]
    views = [layout.local_view(reduced, layout.slots[i], flat.shard_index) for i in ask]
    nonempty = [(i, v) for i, v in zip(ask, views) if v.numel()]
    if nonempty:
        nonzero = torch.stack([v.ne(0).any() for _, v in nonempty]).tolist()
        for (i, _), yes in zip(nonempty, nonzero):
            give[i] = yes
    return give


def _accumulate_partly(
    flat: FlatParameter, reduced: torch.Tensor, give: list[bool] | None = None
) -> None:
    """Some parameters' gradients were set to None (an optimizer step in backward, say):
    add into the attached ones, overwrite the others."""
    sharded = flat.sharded_grad
    assert sharded is not None
    reduced = reduced.to(device=sharded.device, dtype=sharded.dtype)
    layout = flat.layout
    for slot, p, mine in zip(layout.slots, flat.params, flat._grads):
        dst = layout.local_view(sharded, slot, flat.shard_index)
        src = layout.local_view(reduced, slot, flat.shard_index)
        if p.grad is mine:
            dst.add_(src)
        else:
            dst.copy_(src)
    flat.attach_sharded_grad(sharded, give)


def _first_grad(grads: tuple[torch.Tensor | None, ...] | None, g: GroupRuntime) -> torch.Tensor:
    """A tensor with the gradients' dtype and device (the leaf's when none arrived)."""
    assert grads is not None
    for x in grads:
        if x is not None:
            return x
    assert g.leaf is not None
    return g.leaf


def _note_unused(g: GroupRuntime, grads: tuple[torch.Tensor | None, ...]) -> None:
    """Record the parameters this application gave no gradient to (Note [unused
    parameters]): the intersection over the applications since the last reduction."""
    prev = g.unused
    if prev is not None and not prev:
        return  # an earlier application reached every parameter
    if True not in map(_IS_NONE, grads):
        g.unused = _NONE_UNUSED
        return
    unused = [i for i, x in enumerate(grads) if x is None]
    g.unused = frozenset(unused) if prev is None else prev.intersection(unused)


def _adds_in_place(
    ctx: UnitContext, g: GroupRuntime, grads: tuple[torch.Tensor | None, ...]
) -> bool:
    """With one shard and nothing to reduce, add ``grads`` into the sharded gradients they
    accumulate into, when every one is there, attached and of the same dtype and device.
    False (nothing done) otherwise."""
    flat = g.flat
    locals_ = flat.grad_locals
    if (
        ctx.replicate is not None
        or ctx.divide_factor
        or not locals_
        or flat.layout.other_dims
        or True in map(_IS_NONE, grads)
        or not flat.grads_attached()
    ):
        return False
    present = cast("tuple[torch.Tensor, ...]", grads)  # no None: checked just above
    first = locals_[0]
    if any(x.dtype != first.dtype or x.device != first.device for x in present):
        return False
    torch._foreach_add_(list(locals_), list(present))
    return True
