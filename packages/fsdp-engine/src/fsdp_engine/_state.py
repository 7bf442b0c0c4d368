"""`FSDPState`: the hooks of one `fully_shard` module, and `RootState`: what the outermost
one keeps per iteration (forward order for prefetching, saved-tensor hooks, the end-of-backward
callback)."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from ._saved_params import SavedParamRegistry
from ._settings import UnitSettings
from ._unit import FSDPUnit

__all__ = ["FSDPState", "RootState", "StateConfig", "MAX_REDUCTIONS_IN_FLIGHT"]

#: Units whose gradient reductions may be in flight at once during backward.
MAX_REDUCTIONS_IN_FLIGHT = 1


@dataclass
class StateConfig:
    """What `fully_shard` was given and resolved: backends, policies, the shards it made."""

    backends: Any
    mp: Any
    offload: Any
    memory: Any
    settings: UnitSettings
    flats: list[Any]
    param_init_fn: Any = None
    sync_module_states: bool = False


@dataclass
class RootState:
    """Per-iteration bookkeeping shared by every unit under one root."""

    states: list[FSDPState] = field(default_factory=list)
    forward_order: list[FSDPState] = field(default_factory=list)
    last_forward_order: list[FSDPState] = field(default_factory=list)
    # Units in the order their forwards ended (the outermost call): backward runs it in
    # reverse (Note [backward prefetch order]).
    post_forward_order: list[FSDPState] = field(default_factory=list)
    saved: SavedParamRegistry = field(default_factory=SavedParamRegistry)
    hooks_ctx: Any = None
    backward_queued: bool = False
    in_forward: int = 0
    draining: list[Any] = field(default_factory=list)  # units with reductions in flight
    provisional: bool = False  # one unit built by an early unshard(), before its tree
    # The unit whose forward ended last before the root's in the last iteration: its
    # backward comes first (Note [last unit stays]).
    last_unit: FSDPState | None = None


class FSDPState:
    """Hooks of one `fully_shard` module; ``unit`` exists from lazy initialisation on."""

    def __init__(
        self, modules: list[nn.Module], config: StateConfig, init_tree: Callable[[FSDPState], None]
    ) -> None:
        self.module = modules[0]
        self.modules = modules
        self.config = config
        self.settings = config.settings
        self._init_tree = init_tree
        self.fqn = ""
        self.unit: FSDPUnit | None = None
        self.root: RootState | None = None  # every state of a tree points at its root's
        self.is_root = False
        self.pre_backward_done = False
        self.forward_prefetch: list[FSDPState] | None = None
        self.backward_prefetch: list[FSDPState] | None = None
        # Position in this iteration's and the last iteration's forward order (prefetching).
        self.forward_pos: int | None = None
        self.last_forward_pos: int | None = None
        self.post_forward_pos: int | None = None  # in root.post_forward_order
        self.is_last_backward = True
        # Note [nested forward]: a method made to gather like forward
        # (`register_fsdp_forward_method`: ``generate``, a Lightning step) may call ``self(x)``,
        # which runs this unit's hooks again inside the first call. The unit is gathered
        # already: inner calls do nothing, and the outermost call reshards. FSDP2 reshards and
        # gathers again per inner call; here one gather serves the whole method.
        self.forward_depth = 0
        for m in modules:  # state dicts show the sharded DTensors, as FSDP2's hooks do
            # (torch leaves these two registrations unannotated)
            m.register_state_dict_pre_hook(self._show_sharded)  # type: ignore[no-untyped-call]
            m.register_load_state_dict_pre_hook(self._show_sharded)  # type: ignore[no-untyped-call]
        if len(modules) == 1:
            modules[0].register_forward_pre_hook(self._pre_forward, prepend=True, with_kwargs=True)
            modules[0].register_forward_hook(self._post_forward, always_call=True)
        else:
            _register_group_hooks(self, modules)

    def _show_sharded(self, *unused: Any, **unused_kw: Any) -> None:
        """Before ``state_dict()``/``load_state_dict()``: a unit that stays gathered after
        forward shows its unsharded parameters; put the DTensors back (writes to the
        unsharded ones are kept: `write_back_installed`). The gathered buffer stays for the
        backward that may follow."""
        if self.unit is not None:
            self.unit.restore_installed()

    # ---- forward -------------------------------------------------------------------------
    def _pre_forward(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if self.unit is None or self.root.provisional:  # type: ignore[union-attr]
            self._init_tree(self)
        root, unit = self.root, self.unit
        assert root is not None and unit is not None
        self.forward_depth += 1
        if self.forward_depth > 1:  # Note [nested forward]
            return args, kwargs
        tl = unit.ctx.timeline  # Note [step timeline]
        t0 = tl.hook_begin(self.fqn) if tl is not None else 0
        if root.in_forward == 0:
            if self.is_root:
                self._begin_iteration(root)
            # Saved-tensor hooks for every outermost forward, the root's or a unit's called
            # on its own (``model.layers[0](x)``, a loss head called per chunk after the
            # model's forward): without them autograd saved views of a buffer that this
            # unit's post-forward frees, and backward computed with whatever the pool put
            # there next (wrong gradients, no error). Not for a recompute inside backward
            # (activation checkpointing), whose own hooks must see the saved tensors.
            if torch._C._current_graph_task_id() == -1:
                root.hooks_ctx = root.saved.hooks()
                root.hooks_ctx.__enter__()
        root.in_forward += 1
        if self.forward_pos is None:
            self.forward_pos = len(root.forward_order)
            root.forward_order.append(self)
        # Issue this unit's gather and the next's before waiting: the next one's runs under
        # this wait, and under the compute before the next unit (the root's embeddings).
        unit.start_unshard()
        self._prefetch_forward(root)
        unit.wait_unshard()
        if not self._reshards_after_forward():
            # Note [tickets of units that stay]: this unit stays unsharded through forward
            # (the root does), so its gather stops counting as one in flight now, not at
            # its post-forward: held, it took one of the limiter's tickets for the whole
            # forward and stopped every block's prefetch.
            unit.release_ticket()
            self._prefetch_forward(root)  # with the ticket back, the limiter may allow it now
        self._install_views(root)
        mp = unit.ctx.mp
        if mp.param_dtype is not None and mp.cast_forward_inputs:
            args, kwargs = _cast_floats((args, kwargs), mp.param_dtype)
        if tl is not None:
            tl.hook_end(self.fqn, t0, opens="forward")
        return args, kwargs

    def _begin_iteration(self, root: RootState) -> None:
        if root.forward_order:
            root.last_forward_order = root.forward_order
        root.forward_order, root.post_forward_order = [], []
        for state in root.states:
            state.pre_backward_done = False
            state.last_forward_pos, state.forward_pos = state.forward_pos, None
            state.post_forward_pos = None
            if state.unit is not None:
                state.unit.drop_unused_grads()

    def _prefetch_forward(self, root: RootState) -> None:
        targets: Sequence[FSDPState] | None = self.forward_prefetch
        if targets is None:
            i, order = self.last_forward_pos, root.last_forward_order
            if not self.settings.forward_prefetch or i is None or i + 1 >= len(order):
                return
            targets = (order[i + 1],)
        for state in targets:
            if state.unit is not None and state.forward_pos is None:
                state.unit.start_unshard(prefetch=True)

    def _install_views(self, root: RootState) -> None:
        unit = self.unit
        assert unit is not None
        stays = not unit.resident and not self._reshards_after_forward()
        for index, g in enumerate(unit.groups):
            assert g.full is not None
            if not g.full_is_shard:
                root.saved.add(unit, index, g.full)
            views = unit.views_for_forward(index, stays=stays)
            installed = g.installed
            for slots, name, param, i in g.flat.bindings:
                now = slots.get(name)
                if now is not param and (installed is None or now is not installed[i]):
                    raise ValueError(
                        f"FSDP unit '{self.fqn or '<root>'}': parameter "
                        f"{g.flat.fqns[i]} was replaced after fully_shard; assign "
                        "new values in place (param.data.copy_) or shard the model after "
                        "building it"
                    )
                slots[name] = views[i]

    def _post_forward(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        root, unit = self.root, self.unit
        if root is None or unit is None:
            return output
        self.forward_depth = max(0, self.forward_depth - 1)
        if self.forward_depth:  # Note [nested forward]: the outermost call reshards
            return output
        tl = unit.ctx.timeline
        t0 = tl.hook_begin(self.fqn, closes="forward") if tl is not None else 0
        root.in_forward -= 1
        if self.post_forward_pos is None:
            self.post_forward_pos = len(root.post_forward_order)
            root.post_forward_order.append(self)
        grad = torch.is_grad_enabled()
        if grad and unit.resident:
            unit.keep_forward_views()
        else:
            unit.restore_sharded_params()
        root.saved.remove(unit)
        reshard = self._reshards_after_forward()
        if reshard or not grad:
            unit.reshard(after_forward=reshard and grad)
        else:
            unit.release_ticket()
            if not unit.resident:
                # FSDP2 registers the unsharded parameters of a unit that stays gathered,
                # until its backward (or reshard()) puts the DTensors back.
                unit.install_full_params()
        if unit.ctx.mp.output_dtype is not None:
            output = _cast_floats(output, unit.ctx.mp.output_dtype)
        if grad and self._needs_pre_backward(root, unit):
            _register_on_outputs(output, self._pre_backward)
        if root.in_forward == 0:
            if self.is_root:
                root.last_unit = self._next_in_backward(root)  # Note [last unit stays]
            if root.hooks_ctx is not None:
                root.hooks_ctx.__exit__(None, None, None)
                root.hooks_ctx = None
        if tl is not None:
            tl.hook_end(self.fqn, t0)
        return output

    def _reshards_after_forward(self) -> bool:
        """Note [last unit stays]: with ``reshard_after_forward`` left at its default (None),
        the root and the unit whose forward ended last before the root's (in the previous
        iteration) keep their gathered parameters into backward, whose first gathers they
        are: freeing and re-gathering the last block at the turn of the step is a round
        trip with nothing to hide it behind. FSDP2 keeps only the root (its docs for None);
        torchtitan sets ``reshard_after_forward=False`` on its last block by hand for this
        reason. Measured: `bench_engines`' `engine_rank` with `EngineBenchConfig(
        reshard_after_forward=True)` against None, 8-block GPT, world size 2, 3 interleaved
        rounds (2026-11-23): None 0, 46 and 90 ms per step faster (median 3.675 s against
        3.727 s). Peak memory does not grow (200M, world size 4: 1846 MiB before and
        after): backward needs that unit gathered at its start anyway, next
        to every activation. A forward with no backward after it (a metric under grad)
        leaves the buffer for the next forward, which re-gathers it if the shard changed
        (Note [stale gathers]). ``reshard_after_forward=True`` given explicitly, or
        ``set_reshard_after_forward``, turns this off for that unit; on the root it then
        reshards too, as FSDP2's root does when given True explicitly."""
        auto = self.settings.reshard_after_forward_auto
        if auto and (self.is_root or (self.root is not None and self.root.last_unit is self)):
            return False
        rf = self.settings.reshard_after_forward
        return rf if isinstance(rf, bool) else rf != 1

    def _needs_pre_backward(self, root: RootState, unit: FSDPUnit) -> bool:
        """The pre-backward hook gathers this unit and prefetches the next in backward order:
        nothing to do when both stay unsharded (the end-of-backward callback is queued by
        whichever hook of a backward runs first)."""
        if self.is_root or not unit.resident:
            return True
        targets = self.backward_prefetch
        if targets is None:
            targets = self._backward_prefetch_targets(root)
        return any(s.unit is None or not s.unit.resident for s in targets)

    def _backward_prefetch_targets(self, root: RootState) -> list[FSDPState]:
        """The next unit in backward order and, when it kept its parameters from forward
        (nothing to gather: Note [last unit stays]), the first after it that freed them, so
        that gather still runs under this unit's backward. The units in between are only
        looked at (under ``reshard_after_forward=False`` everywhere that is every unit left,
        one attribute test each)."""
        following = self._next_in_backward(root)
        if following is None:
            return []
        freed: FSDPState | None = following
        while freed is not None and not freed._reshards_after_forward():
            freed = freed._next_in_backward(root)
        return [following] if freed is None or freed is following else [following, freed]

    def _next_in_backward(self, root: RootState) -> FSDPState | None:
        """Note [backward prefetch order]: the unit whose forward ended just before this
        one's, whose backward comes next.

        Backward runs the units in the reverse order of their forwards' ends, not of their
        starts: the root's forward (and any unit's that wraps others) starts first and ends
        last, and its pre-backward hook runs first, with the last block's backward next. In
        start order the root had nothing to prefetch, and the last block's all-gather waited
        in the open at the start of backward (36 ms per step of the 8-block GPT at world size
        2, 2026-11-23); FSDP2 orders its backward prefetch the same way (post-forward order)."""
        i = self.post_forward_pos
        return root.post_forward_order[i - 1] if i else None

    # ---- backward ------------------------------------------------------------------------
    def _queue_finish_backward(self, root: RootState) -> None:
        if not root.backward_queued:
            root.backward_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)

    def _pre_backward(self, *unused: Any) -> None:
        root, unit = self.root, self.unit
        if self.pre_backward_done or root is None or unit is None:
            return
        self.pre_backward_done = True
        tl = unit.ctx.timeline
        t0 = tl.hook_begin(self.fqn) if tl is not None else 0
        self._queue_finish_backward(root)
        unit.frees_after_backward = self.settings.reshard_after_backward and not self.is_root
        if self.settings.unshard_in_backward:
            unit.wait_unshard()
            unit.install_backward_views()
        targets = self.backward_prefetch
        if targets is None:
            targets = self._backward_prefetch_targets(root)
        for state in targets:
            if state.unit is not None and not state.pre_backward_done:
                state.unit.start_unshard(prefetch=True)
        if tl is not None:
            tl.hook_end(self.fqn, t0, opens="backward")

    def after_unit_backward(self) -> None:
        """Called by the unit once a group's gradients are reduced or accumulated."""
        unit = self.unit
        assert unit is not None
        for g in unit.groups:  # frozen groups have none pending
            if g.pending_forwards:
                break
        else:
            unit.restore_installed()
            if self.settings.reshard_after_backward and not self.is_root:
                unit.reshard(after_forward=False)
            unit.release_host_memory()
        root = self.root
        assert root is not None
        self._queue_finish_backward(root)
        if unit.reductions and unit not in root.draining:
            root.draining.append(unit)
        # Bound the reductions in flight (each holds an unsharded gradient): finish the oldest
        # ones. The rule depends only on the order of units, so every rank waits at the same
        # point of its backward (gloo's point-to-point works report completion only after
        # wait(), so polling them would free nothing).
        while len(root.draining) > MAX_REDUCTIONS_IN_FLIGHT:
            root.draining.pop(0).finish_reductions()

    def finish_backward_now(self) -> None:
        """End a backward pass by hand: reduce what the backward passes since the last end
        left pending, wait, reshard as set (Note [pipelining's reduce step] in
        ``_pipelining.py``: a pipeline stage asks this after its last micro-batch)."""
        if self.root is None:  # no forward yet: nothing pending
            return
        self._finish_backward()

    def _finish_backward(self) -> None:
        root = self.root
        assert root is not None
        tl = self.unit.ctx.timeline if self.unit is not None else None
        t0 = tl.hook_begin(self.fqn) if tl is not None else 0
        _warn_if_parameters_skipped(root.states)
        for state in root.states:
            if state.unit is not None:
                # Gradients set on registered unsharded parameters during this backward
                # (``backward(inputs=params)``, Note [split backward]) join the reduction.
                state.unit.write_back_installed()
                state.unit.flush_unreduced()
        for state in root.states:
            unit = state.unit
            if unit is not None:
                unit.finish_reductions()
                unit.settle_host_grads()
                unit.end_backward()
                # A resident unit (no pre-backward hook) keeps its forward views for the
                # backward still owed to one of its forward applications: a chunked loss runs
                # one backward per chunk first, and activation checkpointing's recompute in
                # the later one must find full parameters (it computed with DTensors).
                keep = unit.resident and any(g.pending_forwards for g in unit.groups)
                if not keep:
                    unit.restore_installed()
                if state.settings.reshard_after_backward:
                    unit.reshard(after_forward=False)
                elif unit.is_unsharded and not keep and (not unit.resident or unit.shows_tp_pieces):
                    # Kept gathered: FSDP2 shows the unsharded parameters until reshard(),
                    # with gradients not yet reduced as their .grad (Note [pending
                    # gradients]).
                    unit.install_full_params()
                state.pre_backward_done = False
        root.backward_queued = False
        root.draining = []
        if tl is not None:
            tl.hook_end(self.fqn, t0)


# Note [backward that skips the parameters]
#     A backward pass can reach a unit's outputs and stop short of its parameters: autograd
#     differentiates only toward the tensors it is asked for (``torch.autograd.grad(loss,
#     inputs=[x])``, ``loss.backward(inputs=...)``). The gradient of that forward for the
#     parameters then comes only from a later backward through the same graph. For a unit
#     that stays gathered after forward, that later pass may also differentiate toward its
#     registered unsharded parameters (the weight half of pipelining's split backward, Note
#     [split backward] in ``_unit_views.py``). A unit that reshards after forward registers
#     its DTensors again, which no backward reaches (in FSDP2 too), so a weight pass toward
#     ``model.parameters()`` would find nothing there and the micro-batch's weight
#     gradient would be lost without a word. So the end of a backward pass warns (once per
#     unit) when a unit that resharded after forward had its pre-backward run and no gradient
#     of its parameters arrived.
_SKIPPED_PARAMETERS = (
    "FSDP unit '{fqn}': a backward pass reached this unit's outputs but not its parameters "
    "(torch.autograd.grad or backward with inputs= that leave them out, or the input half of "
    "a split backward). Their gradients from that forward come only from a later backward "
    "through the whole graph: a weight pass toward this unit's registered parameters "
    "(torch.distributed.pipelining's stage_backward_weight) finds nothing, because the unit "
    "resharded after forward (zero-bubble schedules need reshard_after_forward=False, as "
    "with FSDP2) or torch is older than 2.13."
)


def _warn_if_parameters_skipped(states: list[FSDPState]) -> None:
    for state in states:
        unit = state.unit
        if unit is None:
            continue
        if (
            state.pre_backward_done
            and not unit.delivered
            and any(
                g.flat.requires_grad
                and g.leaf_uses
                and g.leaf_uses[0]
                and not g.leaf_in_backward
                and not g.through_registered
                for g in unit.groups
            )
        ):
            warnings.warn(
                _SKIPPED_PARAMETERS.format(fqn=unit.fqn or "<root>"), UserWarning, stacklevel=2
            )
        unit.delivered = False


def _cast_floats(tree: Any, dtype: torch.dtype) -> Any:
    def cast(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
            return x.to(dtype)
        return x

    return tree_map(cast, tree)


def _register_on_outputs(output: Any, hook: Any) -> None:
    """Run ``hook`` when backward first reaches any of the outputs."""

    def register(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.requires_grad:
            if x.grad_fn is not None:  # a node pre-hook is cheaper than a tensor hook
                x.grad_fn.register_prehook(hook)
            else:
                x.register_hook(hook)  # type: ignore[no-untyped-call]  # unannotated in torch
        return x

    if isinstance(output, torch.Tensor):
        register(output)
    else:
        tree_map(register, output)


def _register_group_hooks(state: FSDPState, modules: list[nn.Module]) -> None:
    """Modules sharded together (``fully_shard([norm, head])``): each call of one of them is
    a forward application of the unit (gathered once, then kept while any of them runs).
    FSDP2 instead runs its pre-forward only for the first module of the group and its
    post-forward after all ran once; code that calls one member repeatedly (torchtitan's
    chunked loss calls ``lm_head`` per chunk, with a backward between) would then compute
    without the unit's hooks. Each call here is counted, so every application's gradient
    reaches the unit; with ``reshard_after_forward=False`` the later calls gather nothing."""
    active = [0]

    def pre(
        module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        active[0] += 1
        return state._pre_forward(module, args, kwargs) if active[0] == 1 else None

    def post(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        active[0] -= 1
        return state._post_forward(module, args, output) if active[0] == 0 else None

    for m in modules:
        m.register_forward_pre_hook(pre, prepend=True, with_kwargs=True)
        m.register_forward_hook(post, always_call=True)
