"""`fully_shard` (FSDP2-style annotator) and `FSDPModule`, the methods it adds."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from torch import nn

from ._mesh_resolve import check_mesh, check_reshard_after_forward
from ._policies import MixedPrecisionPolicy, OffloadPolicy
from ._state import FSDPState, StateConfig

__all__ = ["fully_shard", "FSDPModule", "UnshardHandle"]

_CLASS_CACHE: dict[tuple[type, type], type] = {}


class UnshardHandle:
    """Returned by ``FSDPModule.unshard(async_op=True)``; ``wait()`` finishes the all-gather."""

    def __init__(self, state: FSDPState) -> None:
        self._state = state

    def wait(self) -> None:
        assert self._state.unit is not None
        self._state.unit.wait_unshard()


class FSDPModule:
    """Methods every module passed to `fully_shard` gains (its class becomes
    ``FSDP<OriginalClass>``, a subclass of both)."""

    _fsdp_state: FSDPState

    def _lazy_state(self) -> FSDPState:
        state = self._fsdp_state
        if state.unit is None:
            from ._lazy_init import lazy_init

            lazy_init(state)
        return state

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather this unit's parameters now (before its forward would)."""
        state = self._lazy_state()
        assert state.unit is not None
        state.unit.start_unshard()
        handle = UnshardHandle(state)
        if async_op:
            return handle
        handle.wait()
        return None

    def reshard(self) -> None:
        """Free this unit's gathered parameters."""
        state = self._lazy_state()
        assert state.unit is not None
        state.unit.reshard(after_forward=False, aliases=True)

    def _units(self, recurse: bool) -> list[FSDPState]:
        if not recurse:
            return [self._fsdp_state]
        return [m._fsdp_state for m in self.modules()  # type: ignore[attr-defined]
                if isinstance(m, FSDPModule)]

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *,
                                   recurse: bool = True) -> None:
        """False: backward accumulates unsharded gradients locally with no communication
        (gradient accumulation without sync); the next backward with True reduces them all."""
        for state in self._units(recurse):
            state.unit_settings["requires_grad_sync"] = bool(requires_gradient_sync)
            if state.unit is not None:
                state.unit.requires_grad_sync = bool(requires_gradient_sync)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Context manager form of ``set_requires_gradient_sync(False)``."""
        self.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.set_requires_gradient_sync(True)

    def set_reshard_after_backward(self, reshard_after_backward: bool, *,
                                   recurse: bool = True) -> None:
        for state in self._units(recurse):
            state.unit_settings["reshard_after_backward"] = bool(reshard_after_backward)
            if state.unit is not None:
                state.unit.reshard_after_backward = bool(reshard_after_backward)

    def set_modules_to_forward_prefetch(self, modules: Sequence[FSDPModule]) -> None:
        """Explicit forward prefetch: all-gather these units when this one's forward starts."""
        self._fsdp_state.forward_prefetch = [_state_of(m, "modules") for m in modules]

    def set_modules_to_backward_prefetch(self, modules: Sequence[FSDPModule]) -> None:
        """Explicit backward prefetch: all-gather these when this unit's backward starts."""
        self._fsdp_state.backward_prefetch = [_state_of(m, "modules") for m in modules]

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Accepted for FSDP2 compatibility; every backward here ends with the same clean-up."""
        self._fsdp_state.is_last_backward = bool(is_last_backward)

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """Divide gradients by ``factor`` instead of the data-parallel world size."""
        if not factor > 0:
            raise ValueError(f"factor must be > 0, got {factor!r}")
        for state in self._units(True):
            state.unit_settings["divide_factor"] = float(factor)
            if state.unit is not None:
                state.unit.ctx.divide_factor = float(factor)


def _state_of(module: Any, arg: str) -> FSDPState:
    state = getattr(module, "_fsdp_state", None)
    if state is None:
        raise ValueError(f"{arg} must be modules passed to fully_shard, got "
                         f"{type(module).__name__}")
    return state


def fully_shard(
    module: nn.Module,
    *,
    mesh: Any = None,
    reshard_after_forward: bool | int = True,
    mp_policy: MixedPrecisionPolicy | None = None,
    offload_policy: OffloadPolicy | None = None,
    comm: Any = None,
    memory: Any = None,
    param_init_fn: Callable[[nn.Module], None] | None = None,
    sync_module_states: bool = False,
    wrapper_class: type = FSDPModule,
) -> nn.Module:
    """Make ``module`` an FSDP unit: its parameters not already in a unit are flattened and
    sharded over ``mesh`` at the first forward of the outermost unit.

    Call it bottom-up (each transformer block, then the whole model). ``mesh``: None (the
    default torch.distributed group), an `fsdp_comm.Backend` (full sharding) or an
    `fsdp_comm.Mesh` (hybrid: shard inside groups, replicate across). ``comm`` is an alias of a
    1-D ``mesh``. ``reshard_after_forward``: True frees gathered parameters after forward,
    False keeps them until backward, an int reshards to groups of that many ranks. ``memory``:
    an fsdp_memory manager (default: one per tree). A model built on the ``meta`` device is
    materialised unit by unit at initialisation (``param_init_fn(module)`` or each module's
    ``reset_parameters()``) and sharded at once. ``sync_module_states=True`` gives every rank
    rank 0's initial values. Returns ``module``, whose class now also
    derives from `FSDPModule`; parameter names are unchanged. (``wrapper_class`` is for
    `FullyShardedDataParallel`, which marks its modules with its own class.)
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
    if isinstance(module, FSDPModule):
        raise ValueError(f"fully_shard: {type(module).__name__} is already an FSDP unit; "
                         "call fully_shard once per module")
    if comm is not None and mesh is not None and comm is not mesh:
        raise ValueError("pass mesh or comm, not both (comm is the 1-D mesh)")
    mesh = mesh if mesh is not None else comm
    check_mesh(mesh)
    check_reshard_after_forward(reshard_after_forward, None, type(module).__name__)
    for name, value, cls in (("mp_policy", mp_policy, MixedPrecisionPolicy),
                             ("offload_policy", offload_policy, OffloadPolicy)):
        if value is not None and not isinstance(value, cls):
            raise TypeError(f"{name} must be a {cls.__name__}, got {type(value).__name__}")
    config = StateConfig(mesh=mesh, reshard_after_forward=reshard_after_forward,
                         mp=mp_policy or MixedPrecisionPolicy(),
                         offload=offload_policy or OffloadPolicy(), memory=memory,
                         param_init_fn=param_init_fn, sync_module_states=sync_module_states)
    state = FSDPState(module, config)
    object.__setattr__(module, "_fsdp_state", state)
    cls = type(module)
    key = (cls, wrapper_class)
    if key not in _CLASS_CACHE:
        _CLASS_CACHE[key] = type(f"FSDP{cls.__name__}", (wrapper_class, cls), {})
    module.__class__ = _CLASS_CACHE[key]
    return module
