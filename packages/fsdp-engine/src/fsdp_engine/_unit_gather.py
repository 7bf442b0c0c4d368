"""Gathering a unit: all-gather each group's shards, copy them to parameter-major order, and
free them again (Note [unit lifecycle] in ``_unit.py``, steps 2 and 3).

Note [stale gathers]
    A unit may still hold a gathered buffer when its next forward begins: the root, the last
    block under the default ``reshard_after_forward=None`` (Note [last unit stays] in
    ``_state.py``) and ``reshard_after_forward=False`` units keep theirs from forward to the end
    of backward, and int ``reshard_after_forward`` units their post-forward piece. When no
    backward came (a forward with gradients enabled whose loss was dropped) and the parameters
    were then changed in place (an optimizer step, ``load_state_dict``, DCP loading,
    ``p.data.copy_``), that buffer holds the old values. Every gather notes the shard's version
    counter (`FlatParameter.version`); `start_unshard` frees a buffer whose shard has changed
    since and gathers again. Before this check the next forward computed with the old values
    (FSDP2 re-gathers and was right; tests/engine/test_stale_gather.py).

Note [in-place gather]
    A group gathered in another dtype (mixed precision) or from another device (CPU
    offload) is cast or copied straight into this rank's slot of the rank-major gather
    output, and that slot is the all-gather's input, as FSDP2 and NCCL do: no send buffer to
    allocate, fill and free per gather. `tests/engine/test_gather_traffic.py` counts the
    buffers. A staged gather (the output is parameter-major, Note [staged collectives] in
    fsdp_comm) and the gather of a post-forward piece (another group) keep the send buffer.
    With a shard group of one the cast is the whole gather: no collective is issued (as in
    FSDP2; `test_no_collective_gathers_a_cast_unit_at_world_size_one`).

Note [gather stream]
    On CUDA a gather runs on the memory layer's all-gather stream from start to end: that
    stream first waits for the work already queued (the optimizer step that wrote the shard),
    then takes the cast or host-to-device copy into this rank's slot, the collective (its
    wait is stream-ordered: Note [stream-ordered waits] in fsdp_comm) and the copy-out to
    parameter-major order, and records one event. The unit's `work` is then that event
    (`SideStreamReady`): `wait_unshard` makes the compute stream wait for it, the host never
    does. So a prefetched unit's cast, host-to-device copy (CPU offload) and copy-out overlap
    the compute of the unit before it instead of queueing behind it; FSDP2 runs the copy-out
    on the compute stream. Buffers freed on the side stream are recycled in event order by
    the pool. On CPU every stream is the calling thread and none of this applies.
    `tests/gpu/test_gpu_parity.py::test_gather_stream_order` checks it on a GPU.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ._context import UnitContext
from ._flat_param import FlatParameter
from ._limiter_guard import LimiterGuard
from ._timeline import LANE_GATHER

__all__ = ["GroupState", "GroupRuntime", "GatherPart", "SideStreamReady"]


class SideStreamReady:
    """Note [gather stream]: the end of a gather queued on the all-gather stream, as a work
    handle. ``wait()`` orders the caller's current stream after it without blocking the host.
    ``streams``: the memory layer's `StreamPool`; ``event``: recorded on the side stream."""

    __slots__ = ("streams", "event")

    def __init__(self, streams: Any, event: Any) -> None:
        self.streams, self.event = streams, event

    def wait(self, timeout: float | None = None) -> None:
        self.streams.wait(self.event, timeout=timeout)

    def wait_stream(self, stream: Any) -> None:
        self.streams.wait(self.event, stream=stream)

    def is_completed(self) -> bool:
        query = getattr(self.event, "query", None)
        return True if query is None else bool(query())


class GroupState(enum.Enum):
    SHARDED = "sharded"
    UNSHARDING = "unsharding"
    UNSHARDED = "unsharded"
    PARTIAL = "partial"  # resharded to the smaller post-forward group (int reshard_after_forward)


@dataclass(eq=False)
class GroupRuntime:
    """Mutable state of one flat group (trainable or frozen) of a unit."""

    flat: FlatParameter
    state: GroupState = GroupState.SHARDED
    full: torch.Tensor | None = None  # parameter-major gathered buffer
    full_is_shard: bool = False  # one shard, no cast: the views alias the local shard
    gathered: torch.Tensor | None = None  # rank-major all-gather output, until copied out
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
    leaf_in_backward: bool = False  # the leaf was made by a recompute inside backward
    views: list[torch.Tensor] | None = None  # the leaf's views, kept while the buffer stays
    installed: list[torch.Tensor] | None = None  # full parameters `unshard()` registered
    # Note [split backward] in ``_unit_views.py``: the unsharded parameters registered on the
    # modules while the unit stays gathered (leaves over `registered_full`, the same objects
    # from forward to backward), and whether the latest forward application routed its
    # gradient through them as well as through the flat leaf.
    registered: list[torch.Tensor] | None = None  # parameters (`installed` may be this list)
    registered_full: torch.Tensor | None = None
    through_registered: bool = False
    installed_version: int | None = None  # their versions' sum when registered (write-back)
    # Note [pending gradients]: per-parameter views of `grad_accum` shown as the installed
    # parameters' ``.grad`` (the same objects while `grad_accum` is the same buffer).
    pending_views: list[torch.Tensor] | None = None
    pending_base: torch.Tensor | None = None
    pending_shown_to: list[torch.Tensor] | None = None  # the `installed` list they went to
    # Tensors the user set as ``.grad`` there (None: ours shown), shown again on the next
    # registered parameters: FSDP2's ``.grad`` stays the same object from step to step.
    pending_user: list[torch.Tensor | None] | None = None
    # What `_show_pending` last put in each ``.grad`` (None included), and the accumulator
    # it showed: a ``.grad`` that is still that object is not the user's doing.
    pending_shown: list[torch.Tensor | None] | None = None
    pending_shown_base: torch.Tensor | None = None
    # Note [all-gather extensions]: parameters whose local tensor has the hooks (looked for
    # at the group's first forward).
    extensions: tuple[int, ...] | None = None
    gathered_version: int | None = None  # shard's version when gathered (Note [stale gathers])
    # Note [unused parameters] in ``_unit_reduce.py``: indices of the parameters no forward
    # application since the last reduction gave a gradient (None: none recorded yet).
    unused: frozenset[int] | None = None
    # Hybrid sharding with ``set_requires_all_reduce(False)``: reduce-scattered gradients not
    # yet all-reduced across replicas, and the parameters none of them reached.
    partial_reduced: torch.Tensor | None = None
    partial_unused: frozenset[int] | None = None


class GatherPart:
    """All-gather, copy-out and free of a unit's groups."""

    fqn: str
    ctx: UnitContext
    groups: list[GroupRuntime]
    resident: bool
    limiter_guard: LimiterGuard | None
    _release_leaf: Callable[[GroupRuntime], None]  # the views part's
    write_back_installed: Callable[[], None]  # the views part's

    def _gather_dtype(self, g: GroupRuntime) -> torch.dtype:
        return self.ctx.mp.param_dtype or g.flat.dtype

    @property
    def is_unsharded(self) -> bool:
        return all(g.state is GroupState.UNSHARDED for g in self.groups)

    def start_unshard(self, *, prefetch: bool = False) -> None:
        """Issue the all-gathers this unit still needs (asynchronously)."""
        self._drop_stale()
        for g in self.groups:
            if g.state in (GroupState.SHARDED, GroupState.PARTIAL):
                self._start_gather(g, prefetch)

    def _drop_stale(self) -> None:
        """Note [stale gathers]: free what was gathered before the shards last changed."""
        for g in self.groups:
            if g.installed_version is not None or g.pending_shown_to is not None:
                self.write_back_installed()
                break
        stale = [
            g
            for g in self.groups
            if g.state is not GroupState.SHARDED
            and not g.full_is_shard
            and g.gathered_version != g.flat.version()
        ]
        if not stale:
            return
        self.reshard(after_forward=False)
        for g in stale:
            if g.partial is not None:
                self.ctx.memory.free(g.partial)
                g.partial, g.state = None, GroupState.SHARDED

    def _start_gather(self, g: GroupRuntime, prefetch: bool) -> None:
        layout, dtype = g.flat.layout, self._gather_dtype(g)
        partial = g.state is GroupState.PARTIAL
        backend = self.ctx.post_forward if partial else self.ctx.shard
        source = g.partial if partial else g.flat.local_shard
        assert source is not None  # a PARTIAL group holds its post-forward piece
        if (
            layout.is_identity
            and not partial
            and dtype == g.flat.dtype
            and source.device == self.ctx.device
        ):
            g.full, g.full_is_shard, g.state = g.flat.local_shard, True, GroupState.UNSHARDED
            self.resident = all(g.full_is_shard for g in self.groups)
            return
        nbytes = layout.padded_numel * dtype.itemsize
        go, ticket = self._guard().acquire(nbytes, prefetch=prefetch)
        if not go:
            return
        g.ticket = None if ticket is None else (ticket, nbytes)
        side = self._side_stream()
        if side is None:
            self._launch(g, source, backend, nbytes)
            return
        # Note [gather stream]: everything up to the parameter-major buffer is queued on the
        # all-gather stream, after the work already queued (an optimizer step that wrote the
        # shard); the compute stream waits for its end when the unit is used.
        streams = self.ctx.memory.streams  # type: ignore[attr-defined]  # found by _side_stream
        side.wait_stream(streams.current())
        with streams.use(side):
            self._launch(g, source, backend, nbytes)
            if g.state is GroupState.UNSHARDING:
                g.work.wait()  # stream-ordered on NCCL: the side stream waits, not the host
                self._after_gather(g)
            g.work = SideStreamReady(streams, streams.record_event(side))
        g.state = GroupState.UNSHARDING

    def _side_stream(self) -> Any:
        """The all-gather stream on CUDA (None on CPU, or for a memory layer without one)."""
        if self.ctx.device.type != "cuda":
            return None
        streams = getattr(self.ctx.memory, "streams", None)
        return None if streams is None else streams.all_gather

    def _launch(self, g: GroupRuntime, source: torch.Tensor, backend: Any, nbytes: int) -> None:
        """Cast or copy into the gather buffer and issue the all-gather (Note [in-place
        gather]), on the current stream."""
        layout, dtype = g.flat.layout, self._gather_dtype(g)
        partial = g.state is GroupState.PARTIAL
        if not partial:
            g.gathered_version = g.flat.version()
        mm, tl = self.ctx.memory, self.ctx.timeline
        out = mm.allocate(layout.padded_numel, dtype)
        if source.dtype != dtype or source.device != self.ctx.device:
            # Mixed precision casts (CPU offload copies the host shard to the device) in the
            # same step. Note [in-place gather]: straight into this rank's slot of the
            # rank-major output, which is then the collective's input; a staged or partial
            # gather (whose output is not rank-major in this group) casts into a send buffer.
            if partial or (
                not layout.is_identity and backend.stages("all_gather_into_tensor", nbytes)
            ):
                g.send = dest = mm.allocate(source.numel(), dtype)
            else:
                assert g.flat.shard_index == backend.rank, "shard index is not the group rank"
                start = g.flat.shard_index * source.numel()
                dest = out[start : start + source.numel()]
            if tl is None:
                dest.copy_(source, non_blocking=True)
            else:
                tl.host_copy(self.fqn, "cast", dest.copy_, source, True)
            source = dest
        if layout.is_identity and not partial and backend.world_size == 1:
            # A shard group of one (world size 1, or HSDP/DDP-style replication only): the
            # cast above is the whole gather; FSDP2 issues no collective either.
            g.full, g.state = out, GroupState.UNSHARDED
            return
        # One-byte floats (float8, frozen weights of a quantised model): gathered as bytes,
        # which every backend moves (gloo refuses float8: "Invalid scalar type").
        wire_out, wire_in = (
            (out.view(torch.uint8), source.view(torch.uint8))
            if dtype.is_floating_point and dtype.itemsize == 1
            else (out, source)
        )
        if layout.is_identity:
            g.full = out
        elif backend.stages("all_gather_into_tensor", nbytes):
            # Note [staged collectives] in fsdp_comm: the copy to parameter-major order is
            # the one out of the backend's shared segment; no rank-major buffer here.
            g.full = out
            g.work = self._issue_gather(
                backend.all_gather_copy_out, wire_out, wire_in, self._copy_out(g)
            )
            g.state = GroupState.UNSHARDING
            return
        else:
            g.gathered = out
        g.work = self._issue_gather(backend.all_gather_into_tensor, wire_out, wire_in)
        g.state = GroupState.UNSHARDING

    def _issue_gather(self, call: Callable[..., Any], *args: Any) -> Any:
        tl = self.ctx.timeline
        if tl is None:
            return call(*args, async_op=True)
        return tl.collective(LANE_GATHER, self.fqn, "gather", call, *args, async_op=True)

    def _copy_out(self, g: GroupRuntime) -> Callable[[torch.Tensor, torch.Tensor], Any]:
        """Note [rank-major layout]: the gathered data, rank-major, into parameter order."""
        tl, to_param_major = self.ctx.timeline, g.flat.layout.to_param_major
        if tl is None:
            return to_param_major
        return functools.partial(tl.host_copy, self.fqn, "copy_out", to_param_major)

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
        tl = self.ctx.timeline
        for g in self.groups:
            if g.state is GroupState.UNSHARDING:
                if tl is None:
                    g.work.wait()
                else:
                    tl.wait(LANE_GATHER, self.fqn, "gather", g.work)
                self._after_gather(g)

    def _after_gather(self, g: GroupRuntime) -> None:
        mm = self.ctx.memory
        if g.send is not None:
            mm.free(g.send, after=g.work)
            g.send = None
        if g.partial is not None:
            mm.free(g.partial, after=g.work)
            g.partial = None
        if g.gathered is not None:
            # Note [rank-major layout]: one copy puts each parameter's rows together.
            g.full = mm.allocate(g.gathered.numel(), g.gathered.dtype)
            if self.ctx.timeline is None:
                g.flat.layout.to_param_major(g.gathered, g.full)
            else:
                self.ctx.timeline.host_copy(
                    self.fqn, "copy_out", g.flat.layout.to_param_major, g.gathered, g.full
                )
            mm.free(g.gathered)
            g.gathered = None
        g.work, g.state = None, GroupState.UNSHARDED

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
                if self.ctx.timeline is None:
                    g.work.wait()
                else:
                    self.ctx.timeline.wait(LANE_GATHER, self.fqn, "gather", g.work)
                self._after_gather(g)
            if g.state is not GroupState.UNSHARDED:
                continue
            if keep_partial and not g.full_is_shard:
                g.partial = self._cut_partial(g)
            assert g.full is not None  # UNSHARDED
            if not g.full_is_shard:
                self.ctx.memory.free(g.full, after=after)
            self._release_leaf(g)
            g.full, g.full_is_shard = None, False
            g.state = GroupState.PARTIAL if g.partial is not None else GroupState.SHARDED
        self.release_ticket(after=after)

    def take_full(self, g: GroupRuntime, numel: int, dtype: torch.dtype) -> torch.Tensor | None:
        """Hand group ``g``'s gathered buffer to its gradient reduction instead of freeing it
        (the group is resharded now): backward is done with the parameters, and the buffer
        has the size the rank-major gradient needs, so the reduction allocates nothing.
        None when the buffer must stay (kept after backward, partial, aliased, other dtype)."""
        full = g.full
        if (
            full is None
            or g.full_is_shard
            or g.state is not GroupState.UNSHARDED
            or full.numel() != numel
            or full.dtype != dtype
            or g.installed is not None
            or self.ctx.post_forward is not None
        ):
            return None
        self._release_leaf(g)
        g.full, g.state = None, GroupState.SHARDED
        if g.ticket is not None:
            self._guard().release(*g.ticket)
            g.ticket = None
        return full

    def _cut_partial(self, g: GroupRuntime) -> torch.Tensor:
        """This rank's piece of the rank-major buffer for its post-forward group: the chunks
        of ranks ``[i*w/k, (i+1)*w/k)`` (a gather in the group of ``k`` rebuilds the whole)."""
        pf, full = self.ctx.post_forward, g.full
        assert pf is not None and full is not None  # kept partial: an int reshard, UNSHARDED
        layout = g.flat.layout
        w, per = layout.shard_count, layout.shard_count // pf.world_size
        lo = pf.rank * per
        kept = self.ctx.memory.allocate(per * layout.shard_numel, full.dtype)
        parts = [
            part.view(w, -1)[lo : lo + per]
            for part in full.split([w * size for size in layout.copy_sizes])  # type: ignore[no-untyped-call]
        ]
        torch.cat(parts, dim=1, out=kept.view(per, layout.shard_numel))
        return kept
