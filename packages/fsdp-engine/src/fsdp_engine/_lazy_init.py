"""Lazy initialisation at the root's first forward (or first explicit unshard).

Only then is the whole tree of units known, so only then can each parameter go to the right
unit: the lowest common ancestor of every unit whose modules use it (tied embeddings used by
the input embedding and the output head belong to the unit containing both). Each unit's
parameters are then flattened and sharded; its context gets the backends and memory manager.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ._context import UnitContext
from ._deferred_init import materialize_modules
from ._flat_param import FlatLayout, FlatParameter
from ._mesh_resolve import BackendResolver
from ._policies import CPUOffloadPolicy
from ._state import FSDPState, RootState
from ._unit import FSDPUnit

__all__ = ["lazy_init"]


def _states_in(module: nn.Module) -> Iterator[tuple[str, FSDPState]]:
    for name, mod in module.named_modules():
        state = getattr(mod, "_fsdp_state", None)
        if state is not None:
            yield name, state


def _unit_tree(root: nn.Module) -> tuple[dict[nn.Module, FSDPState],
                                          dict[FSDPState, FSDPState | None]]:
    """Module -> the unit covering it (nearest fully_shard ancestor or itself), and each
    unit's parent unit."""
    owner: dict[nn.Module, FSDPState] = {}
    parents: dict[FSDPState, FSDPState | None] = {}

    def visit(mod: nn.Module, current: FSDPState | None) -> None:
        state = getattr(mod, "_fsdp_state", None)
        if state is not None and state is not current:
            parents.setdefault(state, current)
            current = state
        assert current is not None
        owner[mod] = current
        for child in mod.children():
            visit(child, current)

    visit(root, None)
    return owner, parents


def _ancestry(state: FSDPState, parents: dict[FSDPState, FSDPState | None]) -> list[FSDPState]:
    chain = [state]
    while parents[chain[-1]] is not None:
        chain.append(parents[chain[-1]])  # type: ignore[arg-type]
    return chain[::-1]


def _lowest_common(states: list[FSDPState],
                   parents: dict[FSDPState, FSDPState | None]) -> FSDPState:
    paths = [_ancestry(s, parents) for s in states]
    common = paths[0][0]
    for level in zip(*paths):
        if any(s is not level[0] for s in level):
            break
        common = level[0]
    return common


Owned = list[tuple[str, tuple[tuple[nn.Module, str], ...], nn.Parameter]]


def _assign_params(root: nn.Module, owner: dict[nn.Module, FSDPState],
                   parents: dict[FSDPState, FSDPState | None]) -> dict[FSDPState, Owned]:
    """Each parameter (by identity) to the lowest common unit of the modules that use it."""
    uses: dict[int, list[tuple[str, nn.Module, str]]] = {}
    params: dict[int, nn.Parameter] = {}
    for mod_name, mod in root.named_modules(remove_duplicate=False):
        for pname, p in mod._parameters.items():
            if p is not None:
                fqn = f"{mod_name}.{pname}" if mod_name else pname
                uses.setdefault(id(p), []).append((fqn, mod, pname))
                params[id(p)] = p
    assigned: dict[FSDPState, Owned] = {}
    for pid, use in uses.items():
        state = _lowest_common([owner[m] for _, m, _ in use], parents)
        slots = list(dict.fromkeys((m, n) for _, m, n in use))
        assigned.setdefault(state, []).append((use[0][0], tuple(slots), params[pid]))
    return assigned


def lazy_init(state: FSDPState) -> None:
    """Initialise the tree whose root is ``state`` (the first unit to run)."""
    root_state = RootState()
    state.is_root = True
    names = dict((s, n) for n, s in _states_in(state.module))
    for other in names:
        if other.unit is not None:
            raise ValueError(
                f"fully_shard module {names[other] or '<root>'} was already initialised under "
                "another root; call the outermost fully_shard module first")
    owner, parents = _unit_tree(state.module)
    assigned = _assign_params(state.module, owner, parents)
    resolver = BackendResolver()
    default_memory = None
    for s, name in names.items():
        s.fqn, s.root = name, root_state
        root_state.states.append(s)
        ctx, default_memory = _make_context(s, resolver, default_memory)
        owners_of_params = {id(mod) for _, uses, _ in assigned.get(s, []) for mod, _ in uses}
        scope = [(n, m) for n, m in state.module.named_modules()
                 if owner.get(m) is s or id(m) in owners_of_params]
        materialize_modules(scope, ctx.device, s.config.param_init_fn)
        s.unit = _build_unit(s, ctx, assigned.get(s, []))
        s.unit.on_backward_done = s.after_unit_backward
        for g in s.unit.groups:
            for p in g.flat.params:
                p._fsdp_unit = s.unit  # type: ignore[attr-defined]  (clip_grad_norm_ finds the group)
        _apply_settings(s)
        _cast_buffers(s, [m for m, o in owner.items() if o is s])


def _make_context(state: FSDPState, resolver: BackendResolver,
                  default_memory: Any) -> tuple[UnitContext, Any]:
    backends = resolver.resolve(state.config.mesh, state.config.reshard_after_forward, state.fqn)
    memory = state.config.memory
    if memory is None:
        if default_memory is None:
            from fsdp_memory import MemoryManager

            default_memory = MemoryManager(backends.shard.device)
        memory = default_memory
    ctx = UnitContext(
        shard=backends.shard, replicate=backends.replicate, world=backends.world, memory=memory,
        device=backends.shard.device, mp=state.config.mp, offload=state.config.offload,
        reshard_after_forward=state.config.reshard_after_forward,
        post_forward=backends.post_forward,
    )
    return ctx, default_memory


def _build_unit(state: FSDPState, ctx: UnitContext, owned: Owned) -> FSDPUnit:
    trainable = [o for o in owned if o[2].requires_grad]
    frozen = [o for o in owned if not o[2].requires_grad]
    flats = []
    for group in (trainable, frozen):
        if group:
            flats.append(_shard_group(state, ctx, group))
    return FSDPUnit.create(state.fqn, ctx, flats)


def _shard_group(state: FSDPState, ctx: UnitContext, group: Owned) -> FlatParameter:
    dtypes = {p.dtype for _, _, p in group}
    devices = {p.device.type for _, _, p in group}
    if len(dtypes) > 1 or len(devices) > 1:
        detail = ", ".join(f"{fqn}: {p.dtype} on {p.device}" for fqn, _, p in group)
        raise ValueError(
            f"fully_shard({state.fqn or '<root>'}): parameters of one unit must share one dtype "
            f"and device (flattened together); got {detail}")
    layout = FlatLayout.build([(f, uses, p) for f, uses, p in group], ctx.shard.world_size,
                              group[0][2].dtype)
    params = [p for _, _, p in group]
    source = ctx.world if state.config.sync_module_states and ctx.world.world_size > 1 else None
    flat = FlatParameter.shard_from_full(layout, params, ctx.shard.rank, ctx.device,
                                         broadcast_from=source)
    if isinstance(ctx.offload, CPUOffloadPolicy) and ctx.device.type != "cpu":
        flat.move_shard_to_host(pin=ctx.offload.pin_memory and torch.cuda.is_available())
    return flat


def _cast_buffers(state: FSDPState, modules: list[nn.Module]) -> None:
    dtype = state.config.mp.buffer_dtype
    if dtype is None:
        return
    for mod in modules:
        for name, buf in mod._buffers.items():
            if buf is not None and buf.is_floating_point():
                mod._buffers[name] = buf.to(dtype)


def _apply_settings(state: FSDPState) -> None:
    unit = state.unit
    assert unit is not None
    settings = state.unit_settings
    unit.requires_grad_sync = settings.get("requires_grad_sync", True)
    unit.reshard_after_backward = settings.get("reshard_after_backward", True)
    if "divide_factor" in settings:
        unit.ctx.divide_factor = settings["divide_factor"]
