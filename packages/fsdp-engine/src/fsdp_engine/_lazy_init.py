"""Lazy initialisation at the root's first forward (or first explicit unshard).

Parameters were sharded by `fully_shard` already (``_shard_init.py``); only now is the whole
tree of units known, so only now does each unit get its context (backends, one memory manager
per tree by default) and its runtime. Parameters the user replaced (``load_state_dict(sd,
assign=True)``) are adopted, shards whose parameters ``to_empty``/``.to()`` moved are taken
back, and shards still on ``meta`` are an error (FSDP2's), unless the unit has a
``param_init_fn``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ._context import UnitContext
from ._deferred_init import materialize_modules
from ._layout_agreement import agree_on_layout
from ._shard_init import materialize_into_shards
from ._shared_params import check_ties
from ._state import FSDPState, RootState
from ._unit import FSDPUnit

__all__ = ["lazy_init"]

_log = logging.getLogger("fsdp.engine")


def _states_in(module: nn.Module) -> Iterator[tuple[str, FSDPState]]:
    for name, mod in module.named_modules():
        state = getattr(mod, "_fsdp_state", None)
        if state is not None:
            yield name, state


def _unit_tree(root: nn.Module) -> dict[nn.Module, FSDPState]:
    """Module -> the unit covering it (nearest fully_shard ancestor or itself)."""
    owner: dict[nn.Module, FSDPState] = {}

    def visit(mod: nn.Module, current: FSDPState | None) -> None:
        current = getattr(mod, "_fsdp_state", None) or current
        assert current is not None
        owner[mod] = current
        for child in mod.children():
            visit(child, current)

    visit(root, None)
    return owner


def lazy_init(state: FSDPState) -> None:
    """Initialise the tree whose root is ``state`` (the first unit to run)."""
    root_state = RootState()
    state.is_root = True
    names: dict[FSDPState, str] = {}
    for n, s in _states_in(state.module):
        names.setdefault(s, n)
    for other in names:
        if other.unit is not None and not (other.root is not None and other.root.provisional):
            raise ValueError(
                f"fully_shard module {names[other] or '<root>'} was already initialised under "
                "another root; call the outermost fully_shard module first"
            )
    check_ties(state.module)
    agree_on_layout(state, names)  # before any collective: Note [layout agreement] (#30)
    owner = _unit_tree(state.module)
    fqns: dict[int, str] = {}
    for fqn, p in state.module.named_parameters(remove_duplicate=False):
        fqns.setdefault(id(p), fqn)
    default_memory = None
    for s, name in names.items():
        s.fqn, s.root = name, root_state
        root_state.states.append(s)
        for flat in s.config.flats:
            flat.fqns = [
                fqns.get(id(p), slot.fqn) for p, slot in zip(flat.params, flat.layout.slots)
            ]
        if s.unit is not None:  # built alone by an early unshard(): adopted as it is
            s.unit.fqn = name
            continue
        ctx, default_memory = _make_context(s, default_memory)
        covered = [(n, m) for n, m in state.module.named_modules() if owner.get(m) is s]
        _materialize(s, ctx, covered)
        s.unit = FSDPUnit.create(name, ctx, s.config.flats)
        s.unit.on_backward_done = s.after_unit_backward
        _cast_buffers(s, [m for _, m in covered])
    if _log.isEnabledFor(logging.INFO):
        _log_tree(state, list(names))


def _log_tree(root: FSDPState, states: list[FSDPState]) -> None:
    flats = [f for s in states for f in s.config.flats]
    local = sum(f.local_shard.numel() * f.local_shard.element_size() for f in flats)
    device = root.unit.ctx.device if root.unit is not None else "?"
    _log.info(
        "lazy init of %s: %d units, %d parameter groups, %d sharded bytes on this rank (%s)",
        type(root.module).__name__,
        len(states),
        len(flats),
        local,
        device,
    )


def init_unit_alone(state: FSDPState) -> None:
    """``unshard()`` before any forward (FSDP2 allows it): build this unit's runtime only,
    under a provisional root; the tree's lazy initialisation adopts it later."""
    state.root = RootState(states=[state], provisional=True)
    ctx, _ = _make_context(state, None)
    inner = {id(m) for m in state.modules}
    covered = [
        (n, m)
        for top in state.modules
        for n, m in top.named_modules()
        if id(m) in inner or getattr(m, "_fsdp_state", None) is None
    ]
    _materialize(state, ctx, covered)
    state.unit = FSDPUnit.create(state.fqn, ctx, state.config.flats)
    state.unit.on_backward_done = state.after_unit_backward


def _materialize(state: FSDPState, ctx: UnitContext, covered: list[tuple[str, nn.Module]]) -> None:
    """Replaced parameters are adopted and shards whose parameters were given new storage
    (``to_empty``, ``.to()``) are taken back into flat buffers; shards still on ``meta`` are
    initialised now with the unit's ``param_init_fn`` (one group's full parameters at a time),
    or refused with FSDP2's error."""
    if ctx.device.type == "meta":  # a simulated world (fake backend): nothing is real
        return
    flats = state.config.flats
    fn = state.config.param_init_fn
    for flat in flats:
        flat.adopt_replaced()  # load_state_dict(assign=True), module.weight = Parameter(...)
        flat.adopt_locals()  # moved by to_empty/.to() (FSDP2's flow): values are the user's
    if any(f.on_meta for f in flats):
        if fn is None:
            left = [
                fqn for f in flats for fqn, p in zip(f.fqns, f.params) if p.device.type == "meta"
            ]
            raise RuntimeError(
                "FSDP parameters should be materialized from meta device before training, "
                f"but the following were still on meta device: {left}\n"
                "Call model.to_empty(device=...) and initialise them (FSDP2's way), load them "
                "with load_state_dict(..., assign=True), or pass param_init_fn= to "
                "fully_shard (fsdp_engine.reset_parameters, say) to initialise each unit as it "
                "is sharded (the paper's way)"
            )
        sync = ctx.world if state.config.sync_module_states and ctx.world.world_size > 1 else None
        materialize_into_shards(
            flats,
            ctx.device,
            lambda scope: materialize_modules(scope, ctx.device, fn),
            broadcast_from=sync,
        )
        trim_after_init(ctx.device)
    materialize_modules(covered, ctx.device, fn)  # meta buffers of the unit's modules


def trim_after_init(device: torch.device) -> None:
    """Give the heap pages of freed full parameters back (glibc keeps them resident
    otherwise: Note [host heap] in fsdp_memory)."""
    if device.type == "cpu":
        from fsdp_memory import trim_host_heap

        trim_host_heap()


def _make_context(state: FSDPState, default_memory: Any) -> tuple[UnitContext, Any]:
    backends = state.config.backends
    memory = state.config.memory
    if memory is None:
        if default_memory is None:
            from fsdp_memory import MemoryManager

            default_memory = MemoryManager(backends.shard.device)
        memory = default_memory
    ctx = UnitContext(
        shard=backends.shard,
        replicate=backends.replicate,
        world=backends.world,
        memory=memory,
        device=backends.shard.device,
        mp=state.config.mp,
        offload=state.config.offload,
        settings=state.settings,
        post_forward=backends.post_forward,
    )
    return ctx, default_memory


def _cast_buffers(state: FSDPState, modules: list[nn.Module]) -> None:
    dtype = state.config.mp.buffer_dtype
    if dtype is None:
        return
    for mod in modules:
        for name, buf in mod._buffers.items():
            if buf is not None and buf.is_floating_point():
                mod._buffers[name] = buf.to(dtype)
