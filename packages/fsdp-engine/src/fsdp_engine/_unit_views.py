"""The unsharded parameters a unit's modules compute with: views of the gathered buffer cut
from one autograd leaf (Note [parameter views]), and the checks that keep backward honest.

Note [parameter views]
    Unsharded (inside forward): the module sees, in its ``_parameters`` slot, a view with the
    parameter's shape cut from an autograd leaf that aliases the parameter-major gathered
    buffer, by one autograd node per forward application (`ViewsNode`, Note [one node per
    application] in ``_views_node.py``). Its backward hands every parameter's gradient to
    the unit, which writes them straight into the reduce-scatter's input. After the forward
    the DTensor parameter goes back into the slot.

    The leaf is made once per group and re-pointed (``leaf.data = buffer``) at each new
    gather: a new leaf is made only while backward still owes the old one gradients (a
    second application pending). A group whose gathered form is its shard itself (a shard
    group of one, no cast) never reshards, so its views are cut once and reused; such a unit
    needs no pre-backward hook either. This keeps a unit's Python cost per forward+backward
    near 20 microseconds (the fsdp-engine README has the figure).

Note [split backward]
    The split backward of pipelining's zero-bubble schedules (``torch.distributed.
    pipelining``: ``stage_backward_input``, later ``stage_backward_weight``) first
    differentiates toward the stage's input only, then toward each registered parameter's
    own autograd leaf, from gradients it kept at the graph's nodes. FSDP2 registers the
    unsharded parameters of a unit that stays gathered after forward, and those are the
    leaves its forward computed with. Here forward computes with views of one flat leaf
    (one reduce-scatter, no gradient copy), so for a unit that stays gathered the
    unsharded parameters registered after the forward (the same objects while the buffer
    stays: `_registered`) are inputs of the application's `ViewsNode` too. Its backward
    hands the gradients to the unit whenever autograd will run the leaf's accumulator
    (every backward that asks for the whole graph), and returns them to the registered
    parameters otherwise (a pass that asks for those, as the weight half does), in the
    reduce dtype (``grad_dtype``); the gradients set there are pending gradients (Note
    [pending gradients]). Units that reshard after forward register their DTensors, as in
    FSDP2, and their node has no such inputs.

Note [pending gradients]
    With ``set_requires_gradient_sync(False)`` a backward leaves its gradient unreduced, in
    the group's flat ``grad_accum`` (the reduce dtype). As in FSDP2 (torch 2.13), while the
    unit's unsharded parameters are registered (after a forward that keeps them, after
    ``unshard()``, after a backward with ``set_reshard_after_backward(False)``) each one's
    ``.grad`` is its view of that buffer: the same tensor object from step to step, edits in
    place are the unreduced gradient, ``zero_grad(set_to_none=True)`` clears it (noticed
    before the parameters go or backward adds to it: `_absorb_pending_edits`). The sharded
    DTensors' ``.grad`` is the reduced history only; the next backward with sync reduces
    the pending part and adds it there. A ``.grad`` the user sets there (the weight half of
    pipelining's split backward: ``p.grad = dw``, then ``p.grad += dw``) is pending gradient
    too, even before any backward made one, and that same tensor is shown again while the
    gradient stays unreduced.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch

from ._extensions import extension_value, has_extension
from ._tensor_parallel import tp_parameter, wrap_tp_views
from ._unit_gather import GroupRuntime, GroupState
from ._views_node import Application, ViewsNode

__all__ = ["ViewsPart"]

_REQUIRES_GRAD = operator.attrgetter("requires_grad")
# Note [split backward]: measured right on torch 2.13; on torch 2.11 the weight pass gave
# twice the gradient (2026-11-27), so there the registered parameters stay out of the graph
# and a weight pass warns instead (Note [backward that skips the parameters]).
_SPLIT_BACKWARD = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 13)
_VERSION = operator.attrgetter("_version")


class ViewsPart:
    """Views for forward, full parameters for backward and for `unshard()`."""

    fqn: str
    groups: list[GroupRuntime]
    ctx: Any
    delivered: bool  # the reduce part's: a gradient arrived in this backward pass

    # Provided by the reduce and gather parts of the unit:
    wait_unshard: Callable[[], None]

    def views_for_forward(self, index: int, *, stays: bool = False) -> list[torch.Tensor]:
        """The parameters of group ``index`` as views of its gathered buffer, for one forward.
        ``stays``: the unit stays gathered after this forward (Note [split backward])."""
        g = self.groups[index]
        full = g.full
        assert full is not None
        # requires_grad is read per forward: ``p.requires_grad_(False)`` after fully_shard
        # freezes a parameter from the next forward on (FSDP2 honours it too).
        wants = tuple(map(_REQUIRES_GRAD, g.flat.params))
        tps = g.flat.layout.tps
        if True not in wants or not torch.is_grad_enabled():
            plain = unflatten(g, full)
            if tps is not None:  # Note [flat buffer on a 2-D mesh]
                plain = wrap_tp_views(tps, plain)
            return self._with_extensions(g, plain, False)
        in_backward = _in_backward()
        if g.leaf_full is not full or (g.leaf_uses and g.leaf_uses[0] and not in_backward):
            # A second application while one is pending (a module called twice, or called
            # again after a backward that did not reach the first call, as a chunked loss
            # does) gets its own leaf. A recompute inside backward (activation
            # checkpointing) of an application still pending is that same application:
            # counted once (its gradient arrives through the original graph).
            self._point_leaf_at(g, full)
        uses = g.leaf_uses
        assert g.leaf is not None and uses is not None
        counted = not (in_backward and uses[0])
        if counted:
            uses[0] += 1
            g.pending_forwards += 1
        g.forward_version = g.flat.version()
        views = g.views
        if views is None:
            registered = (
                _registered(g, self.ctx.mp.reduce_dtype)
                if stays
                and _SPLIT_BACKWARD
                and not in_backward
                and not _extensions(g)
                and tps is None
                else ()
            )
            app = Application(index, g, uses, g.leaf, counted, bool(registered), self)
            views = list(ViewsNode.apply(app, g.leaf, *registered))  # type: ignore[no-untyped-call]
            g.through_registered = bool(registered)
            if g.full_is_shard:
                # The buffer is the shard itself and stays: so can the views (autograd may
                # run their node in any number of backward passes: it saves no tensors).
                g.views = views
        if False in wants:  # frozen parameters compute with values that carry no gradient
            views = [v if w else v.detach() for v, w in zip(views, wants)]
        if tps is not None:  # Note [flat buffer on a 2-D mesh]: the tp pieces as DTensors
            views = wrap_tp_views(tps, views)
        if g.extensions == ():  # the common case, without a call
            return views
        return self._with_extensions(g, views, True)

    def registered_grads_arrived(self, g: GroupRuntime) -> None:
        """A backward pass sent a forward application's gradients to the registered
        parameters (Note [split backward]): that application is delivered; its leaf keeps
        the use (a later backward through the same graph may still reach it)."""
        g.pending_forwards = max(0, g.pending_forwards - 1)
        self.delivered = True

    def _with_extensions(
        self, g: GroupRuntime, views: list[torch.Tensor], grad: bool
    ) -> list[torch.Tensor]:
        """Parameters whose local tensor defines FSDP2's all-gather extension compute with
        the tensor it builds (Note [all-gather extensions])."""
        params = g.flat.params
        ext = _extensions(g)
        if not ext:
            return views
        views = list(views)
        ctx = self.ctx
        mesh = g.flat.spec.mesh
        if mesh.ndim > 1:  # the hook sees the shard mesh, as in FSDP2
            mesh = mesh[mesh.mesh_dim_names[-1]]
        for i in ext:
            slot = g.flat.layout.slots[i]
            views[i] = extension_value(
                params[i]._local_tensor,  # type: ignore[attr-defined]  # a DTensor's
                views[i] if grad and params[i].requires_grad else None,
                slot=slot,
                mesh=mesh,
                backend=ctx.shard,
                module=slot.uses[0][0],
                mp=ctx.mp,
                param_dtype=ctx.mp.param_dtype or g.flat.dtype,
            )
        return views

    def _point_leaf_at(self, g: GroupRuntime, full: torch.Tensor) -> None:
        """Make the group's leaf alias ``full``. The leaf outlives a gather (re-pointing costs
        less than a new leaf); a leaf that forward applications still wait on in backward
        keeps its buffer, and a new one takes over."""
        if g.leaf is None or (g.leaf_uses is not None and g.leaf_uses[0]):
            g.leaf_in_backward = _in_backward()  # a recompute's leaf (see `end_backward`)
            g.leaf = full.detach().requires_grad_(True)
            g.leaf_idle = full.new_empty(0)
            g.leaf_uses = [0]
        else:
            g.leaf.data = full
        g.leaf_full, g.views = full, None

    def _release_leaf(self, g: GroupRuntime) -> None:
        """The gathered buffer is going back to the pool: an idle leaf lets go of it."""
        g.leaf_full, g.views = None, None
        g.registered = g.registered_full = None
        if g.leaf is not None and g.leaf_uses is not None and not g.leaf_uses[0]:
            assert g.leaf_idle is not None  # made with the leaf
            g.leaf.data = g.leaf_idle

    def end_backward(self) -> None:
        """Backward is over: forward applications made inside it whose gradients never came
        (a recompute of activation checkpointing on a new leaf that backward does not reach)
        are forgotten. Applications made in forward stay pending: a later backward may
        still deliver them (a chunked loss runs one backward per chunk, then one through the
        model)."""
        for g in self.groups:
            if g.leaf_uses is not None and g.leaf_in_backward:
                g.leaf_uses[0] = 0

    def check_unchanged(self, g: GroupRuntime, when: str) -> None:
        """Parameters must not change between a forward and its backward (the version
        `views_for_forward` noted)."""
        if g.forward_version is not None and g.flat.version() != g.forward_version:
            raise RuntimeError(
                f"FSDP unit '{self.fqn or '<root>'}': its parameters were modified in place "
                f"between forward and backward (detected {when}); gradients would be computed "
                "against different values. Step the optimizer after backward."
            )

    def full_for_backward(self, index: int) -> torch.Tensor:
        """The gathered buffer of group ``index``, re-gathering it if it was freed."""
        g = self.groups[index]
        self.check_unchanged(g, "re-gathering for backward")
        if g.state is not GroupState.UNSHARDED:
            self.wait_unshard()
        assert g.full is not None
        return g.full

    def install_full_params(self) -> None:
        """`unshard()`: register full, original-shape parameters on the modules (FSDP2
        shows the unsharded parameters between ``unshard()`` and ``reshard()``)."""
        for g in self.groups:
            assert g.full is not None
            if g.installed is None:
                g.installed = _registered(g, self.ctx.mp.reduce_dtype)
                g.installed_version = sum(map(_VERSION, g.installed))
            for slots, name, _, i in bindings(g):
                slots[name] = g.installed[i]
            _show_pending(g)

    def write_back_installed(self) -> None:
        """Full parameters registered by `install_full_params` that were written in place
        (``load_state_dict`` or ``p.copy_`` after a forward that kept them, between
        ``unshard()`` and ``reshard()``): copy this rank's rows into the shard before they
        are taken down, so the write is not lost with the gathered buffer (FSDP2 loses it).
        The shard's version then changes and the buffer is gathered again (Note [stale
        gathers])."""
        for g in self.groups:
            if g.installed_version is None and g.pending_shown_to is None:
                continue  # nothing `install_full_params` registered is up
            _absorb_pending_edits(g, self.ctx.mp.reduce_dtype)
            if g.installed_version is None or g.installed is None:
                continue
            if sum(map(_VERSION, g.installed)) != g.installed_version:
                flat, layout = g.flat, g.flat.layout
                with torch.no_grad():
                    for slot, full in zip(layout.slots, g.installed):
                        layout.local_view(flat.local_shard, slot, flat.shard_index).copy_(
                            slot.rows_of(getattr(full, "_local_tensor", full), flat.shard_index)
                        )
            g.installed_version = None

    def install_backward_views(self) -> None:
        """For this unit's backward: put unsharded views on the modules, so that activation
        checkpointing's recompute (which calls the inner modules' forward, not this unit's)
        computes with full parameters. The views come from a throwaway leaf: the recomputed
        graph only supplies saved values; gradients flow through the original graph to the
        unit's own leaf."""
        self.write_back_installed()
        for g in self.groups:
            full = g.full
            if full is None:
                continue
            if g.flat.requires_grad:
                # Hooks run inside the autograd engine with grad mode off; views made there
                # would not be differentiable and the recompute would save other tensors
                # than the forward did (checkpoint's count check fails).
                with torch.enable_grad():
                    tmp = full.detach().requires_grad_(True)
                    layout = g.flat.layout
                    pieces = tmp.split_with_sizes(layout.split_sizes)
                    views = [
                        pieces[i] if len(shape) == 1 else pieces[i].view(shape)
                        for i, shape in zip(layout.param_pieces, layout.shapes)
                    ]
            else:
                views = unflatten(g, full)
            if g.flat.layout.tps is not None:
                with torch.enable_grad():  # as for the views above
                    views = wrap_tp_views(g.flat.layout.tps, views)
            g.installed = views
            for slots, name, _, i in bindings(g):
                slots[name] = views[i]

    def keep_forward_views(self) -> None:
        """A resident unit (never resharded) leaves its forward views on the modules until
        the end of backward, as FSDP2 does for units it does not reshard: a recompute of
        activation checkpointing then finds full parameters (resident units hook no
        pre-backward that could install them)."""
        for g in self.groups:
            if g.views is not None and g.flat.layout.tps is None:  # the cached views of a
                # resident trainable group (a tp group's modules hold DTensors over them)
                g.installed = g.views
                continue
            shown: list[Any] = [None] * len(g.flat.params)
            for slots, name, _, i in bindings(g):
                shown[i] = slots[name]
            g.installed = shown

    def restore_installed(self) -> None:
        """Backward is over: put the DTensors back where full parameters were left installed
        (by `install_backward_views`, `keep_forward_views` or `unshard()`)."""
        for g in self.groups:
            if g.installed_version is not None or g.pending_shown_to is not None:
                self.write_back_installed()
                break
        for g in self.groups:
            if g.installed is not None:
                for slots, name, param, _ in bindings(g):
                    slots[name] = param
                g.installed = None

    def restore_sharded_params(self) -> None:
        """Put the DTensor parameters back into the modules' slots."""
        self.write_back_installed()
        for g in self.groups:
            for slots, name, param, _ in bindings(g):
                slots[name] = param
            g.installed = None


def _extensions(g: GroupRuntime) -> tuple[int, ...]:
    """The parameters of ``g`` whose local tensor defines FSDP2's all-gather extension.
    Looked for once, at the group's first forward (FSDP2 looks at lazy initialisation): a
    hook patched on a local tensor after that is not seen."""
    ext = g.extensions
    if ext is None:
        ext = g.extensions = tuple(
            i
            for i, p in enumerate(g.flat.params)
            if has_extension(p._local_tensor)  # type: ignore[attr-defined]  # a DTensor's
        )
    return ext


def _registered(g: GroupRuntime, reduce_dtype: torch.dtype | None) -> list[torch.Tensor]:
    """The unsharded parameters registered while group ``g`` stays gathered: leaves over
    its gathered buffer, the same objects while that buffer stays (Note [split
    backward])."""
    full = g.full
    assert full is not None
    params = g.flat.params
    reg = g.registered
    if reg is None or g.registered_full is not full:
        reg = [  # parameters, typed as the tensors `installed` holds (it may be this list)
            torch.nn.Parameter(v, requires_grad=p.requires_grad)
            if s.tp is None
            else tp_parameter(s.tp, v, p.requires_grad)
            for v, p, s in zip(unflatten(g, full), params, g.flat.layout.slots)
        ]
        if reduce_dtype is not None and reduce_dtype != full.dtype:
            for r in reg:
                r.grad_dtype = reduce_dtype  # pending gradients are in the reduce dtype
        g.registered, g.registered_full = reg, full
        return reg
    for r, p in zip(reg, params):
        if r.requires_grad != p.requires_grad:  # requires_grad_() on the DTensor since
            r.requires_grad_(p.requires_grad)
    return reg


def _pending_views(g: GroupRuntime) -> list[torch.Tensor] | None:
    """Per-parameter views of the group's unreduced gradient (Note [pending gradients])."""
    acc = g.grad_accum
    if acc is None:
        g.pending_views = g.pending_base = g.pending_user = None
        return None
    if g.pending_views is None or g.pending_base is not acc:
        layout = g.flat.layout
        views = [layout.full_view(acc, s) for s in layout.slots]
        if layout.tps is not None:  # the installed tp parameters take DTensor gradients
            views = wrap_tp_views(layout.tps, views)
        g.pending_views = views
        g.pending_base, g.pending_user = acc, None
    return g.pending_views


def _show_pending(g: GroupRuntime) -> None:
    """The installed full parameters show the unreduced gradient as ``.grad`` (None when
    there is none), in the reduce dtype (``grad_dtype`` allows it)."""
    views = _pending_views(g)
    installed = g.installed
    assert installed is not None
    user = g.pending_user
    shown: list[torch.Tensor | None] = []
    for i, p in enumerate(installed):
        if views is None:
            p.grad = None
            shown.append(None)
            continue
        v = views[i]
        if p.dtype != v.dtype:
            p.grad_dtype = v.dtype
        mine = user[i] if user is not None else None
        if mine is not None:
            mine.copy_(v)  # the user's tensor again, holding the whole unreduced gradient
            v = mine
        p.grad = v
        shown.append(v)
    g.pending_shown_to, g.pending_shown, g.pending_shown_base = installed, shown, g.grad_accum


def _absorb_pending_edits(g: GroupRuntime, grad_dtype: torch.dtype | None) -> None:
    """Before the installed parameters go (or backward adds to the unreduced gradient): a
    ``.grad`` the user set to None (``zero_grad()``) clears that parameter's unreduced
    gradient, one the user set or replaced is copied in (and shown again while the gradient
    stays unreduced), edits of the user's own tensor too; edits of ours are in it already. A
    ``.grad`` still showing an accumulator reduced since is stale, not the user's.
    ``grad_dtype``: the unreduced gradient's, when the user's are the first (None: the
    parameters')."""
    shown_to, shown, base = g.pending_shown_to, g.pending_shown, g.pending_shown_base
    g.pending_shown_to = g.pending_shown = g.pending_shown_base = None
    installed = g.installed
    if installed is None or shown_to is not installed or shown is None:
        return
    current = base is not None and base is g.grad_accum
    views = _pending_views(g)  # the accumulator now (None: none yet)
    user = g.pending_user
    with torch.no_grad():
        for i, p in enumerate(installed):
            got = p.grad
            was_user = current and user is not None and user[i] is not None and got is user[i]
            if got is shown[i] and not was_user:
                continue  # ours: in the accumulator already, or stale
            if got is None:
                if views is not None and current:
                    views[i].zero_()
                    if user is not None:
                        user[i] = None
                continue
            if got is shown[i] and not current:
                continue  # the user's tensor of an accumulator reduced since
            if views is None:
                full = g.full  # a gradient set before any backward (split backward)
                assert full is not None, "registered unsharded parameters, no gathered buffer"
                g.grad_accum = torch.zeros_like(full, dtype=grad_dtype or full.dtype)
                views = _pending_views(g)
                assert views is not None
                user = g.pending_user
            v = views[i]
            v.copy_(got)
            if got.shape == v.shape and got.dtype == v.dtype:
                if user is None:
                    user = g.pending_user = [None] * len(views)
                user[i] = got


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def unflatten(g: GroupRuntime, full: torch.Tensor) -> list[torch.Tensor]:
    """Views of a parameter-major gathered buffer with each parameter's shape."""
    layout = g.flat.layout
    return [layout.full_view(full, s) for s in layout.slots]


def bindings(g: GroupRuntime) -> tuple[tuple[dict[str, Any], str, Any, int], ...]:
    return g.flat.bindings
