"""`fully_shard` (FSDP2's annotator) and `FSDPModule`, the methods it adds.

Our `FSDPModule` derives from torch's ``torch.distributed.fsdp.FSDPModule``, so code that
asks ``isinstance(m, FSDPModule)`` with torch's class (torchtitan, Accelerate, pipelining)
takes its FSDP path; every public method of torch's class is implemented here (none reaches
torch's private state).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule as _TorchFSDPModule

from ._mesh_resolve import check_mesh, check_reshard_after_forward, resolve_backends
from ._pipelining import register_for_pipelining
from ._policies import as_mp_policy, as_offload_policy
from ._settings import UnitSettings
from ._shard_init import managed_params, shard_params
from ._state import FSDPState, StateConfig
from ._tensor_parallel import resolve_spmd

__all__ = ["fully_shard", "FSDPModule", "UnshardHandle"]

_CLASS_CACHE: dict[tuple[type, type], type] = {}


class UnshardHandle:
    """Returned by ``FSDPModule.unshard(async_op=True)``; ``wait()`` finishes the all-gather
    and registers the full parameters on the module."""

    def __init__(self, state: FSDPState) -> None:
        self._state = state

    def wait(self) -> None:
        unit = self._state.unit
        assert unit is not None
        unit.wait_unshard()
        if not self._state.root or not self._state.root.in_forward:
            unit.install_full_params()


class FSDPModule(_TorchFSDPModule):
    """Methods every module passed to `fully_shard` gains (its class becomes
    ``FSDP<OriginalClass>``, a subclass of both, and of torch's ``FSDPModule``)."""

    _orig_cls_mro_index = 3  # [FSDP<Orig>, FSDPModule, torch's FSDPModule, Orig, ...]
    _fsdp_state: FSDPState

    def _lazy_state(self) -> FSDPState:
        state = self._fsdp_state
        if state.unit is None:
            from ._lazy_init import init_unit_alone

            init_unit_alone(state)
        return state

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:  # type: ignore[override]
        """All-gather this unit's parameters now and register them, full, on the module
        (until `reshard` or the end of its next forward)."""
        state = self._lazy_state()
        assert state.unit is not None
        state.unit.start_unshard()
        handle = UnshardHandle(state)
        if async_op:
            return handle
        handle.wait()
        return None

    def reshard(self) -> None:
        """Free this unit's gathered parameters; the module shows its DTensors again."""
        unit = self._fsdp_state.unit
        if unit is None:  # never gathered: the parameters are sharded already
            return
        unit.restore_sharded_params()
        unit.reshard(after_forward=False, aliases=True)

    def _apply(self, *args: Any, **kwargs: Any) -> Any:
        # nn.Module's own (``to``, ``to_empty``, ``double``...): torch's FSDPModule._apply
        # reaches into torch's private FSDP state. Shards these calls move are taken back
        # into flat buffers at the first forward (``FlatParameter.adopt_locals``).
        self.reshard()
        # The MRO after torch's FSDPModule is the user's nn.Module class (`fully_shard`
        # makes FSDP<Orig>), which mypy cannot see from this mixin.
        return super(_TorchFSDPModule, self)._apply(*args, **kwargs)  # type: ignore[misc]

    def _get_fsdp_state(self) -> Any:
        raise NotImplementedError(
            f"{type(self).__name__} is sharded by fsdp_engine, not torch's fully_shard: "
            "torch's private FSDP state does not exist (use the public FSDPModule methods)"
        )

    def _units(self, recurse: bool) -> list[FSDPState]:
        if not recurse:
            return [self._fsdp_state]
        return list(
            dict.fromkeys(
                m._fsdp_state
                for m in self.modules()  # type: ignore[attr-defined]
                if isinstance(m, FSDPModule)
            )
        )

    def _set(self, name: str, value: Any, recurse: bool) -> None:
        for state in self._units(recurse):
            setattr(state.settings, name, value)

    def set_requires_gradient_sync(
        self, requires_gradient_sync: bool, *, recurse: bool = True
    ) -> None:
        """False: backward accumulates unsharded gradients locally with no communication
        (gradient accumulation without sync); the next backward with True reduces them all."""
        self._set("requires_grad_sync", bool(requires_gradient_sync), recurse)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Context manager form of ``set_requires_gradient_sync(False)``."""
        self.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.set_requires_gradient_sync(True)

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Free (True) or keep (False) the gathered parameters after forward."""
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(
                f"reshard_after_forward must be a bool here, got "
                f"{reshard_after_forward!r} (an int group size is fixed at "
                "fully_shard time)"
            )
        self._set("reshard_after_forward", reshard_after_forward, recurse)
        self._set("reshard_after_forward_auto", False, recurse)

    def set_reshard_after_backward(
        self, reshard_after_backward: bool, *, recurse: bool = True
    ) -> None:
        self._set("reshard_after_backward", bool(reshard_after_backward), recurse)

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """False: do not re-gather this unit for backward (only when backward needs none of
        its parameters)."""
        self._fsdp_state.settings.unshard_in_backward = bool(unshard_in_backward)

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """False: skip the all-reduce across replicas of a hybrid mesh in this backward."""
        self._set("requires_all_reduce", bool(requires_all_reduce), recurse)

    # Ours only (torch's list[FSDPModule] would admit units of torch's fully_shard): a
    # narrower argument than the method overridden, hence the ignores.
    def set_modules_to_forward_prefetch(self, modules: Sequence[FSDPModule]) -> None:  # type: ignore[override]
        """Explicit forward prefetch: all-gather these units when this one's forward starts."""
        self._fsdp_state.forward_prefetch = [_state_of(m, "modules") for m in modules]

    def set_modules_to_backward_prefetch(self, modules: Sequence[FSDPModule]) -> None:  # type: ignore[override]
        """Explicit backward prefetch: all-gather these when this unit's backward starts."""
        self._fsdp_state.backward_prefetch = [_state_of(m, "modules") for m in modules]

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Accepted for FSDP2 compatibility; every backward here ends with the same clean-up."""
        self._fsdp_state.is_last_backward = bool(is_last_backward)

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """Divide gradients by ``factor`` instead of the data-parallel world size."""
        self.set_gradient_divide_factor(factor)

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide gradients by ``factor`` instead of the data-parallel world size."""
        if not factor > 0:
            raise ValueError(f"factor must be > 0, got {factor!r}")
        self._set("divide_factor", float(factor), True)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Accepted for FSDP2 compatibility: the backends already reduce with a sum and a
        scale where the library lacks pre-multiplied sums (fsdp-comm's capabilities)."""
        self._set("force_sum_reduction", bool(enable), True)

    def set_post_optim_event(self, event: Any) -> None:
        """Accepted for FSDP2 compatibility: all-gathers here are issued on the same stream
        order as the optimizer step, so no event is needed."""

    def set_all_reduce_hook(
        self, hook: Callable[[torch.Tensor], None], *, stream: Any = None
    ) -> None:
        """Call ``hook(reduced)`` on this unit's reduced gradient shard (1-D, the reduce
        dtype) before it is added into ``.grad``: after the replicas' all-reduce with hybrid
        sharding, else right after the reduce-scatter (where a custom all-reduce across
        replicas goes). ``stream``: the stream the hook runs in (not with hybrid sharding,
        whose all-reduce stream it runs in)."""
        if not callable(hook):
            raise TypeError(f"hook must be callable, got {type(hook).__name__}")
        state = self._fsdp_state
        if stream is not None and state.config.backends.replicate is not None:
            raise ValueError("stream cannot be set when using native HSDP")
        state.settings.all_reduce_hook = hook
        state.settings.all_reduce_hook_stream = stream

    def set_custom_all_gather(self, comm: Any) -> None:
        raise NotImplementedError(
            "set_custom_all_gather: pass an fsdp_comm Backend as mesh= "
            "(any implementation) to change the all-gather"
        )

    def set_custom_reduce_scatter(self, comm: Any) -> None:
        raise NotImplementedError(
            "set_custom_reduce_scatter: pass an fsdp_comm Backend as "
            "mesh= (any implementation) to change the reduce-scatter"
        )

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """Accepted for FSDP2 compatibility: buffers come from the memory layer (memory=)."""

    # The override errors ignored on the three no-ops below and on `set_symm_mem_for_comm`:
    # torch 2.13's signatures add ``recurse=`` (or ``backend=``) and rename an argument.
    def set_reduce_scatter_max_input_buffers(
        self, max_input_buffers: int, *, recurse: bool = True
    ) -> None:
        """Accepted for FSDP2 compatibility (its signature and argument checks): reductions in
        flight are bounded by the engine's deterministic rule (MAX_REDUCTIONS_IN_FLIGHT) and
        the memory layer."""
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):
            raise TypeError(
                f"max_input_buffers must be an int, got {type(max_input_buffers).__name__}"
            )
        if max_input_buffers < 1:
            raise ValueError(f"max_input_buffers must be a positive int, got {max_input_buffers}")

    def set_reduce_scatter_unused_params(
        self, reduce_scatter_unused_params: bool, *, recurse: bool = True
    ) -> None:
        """Accepted for FSDP2 compatibility: unused parameters always reduce zeros here (the
        whole flat gradient is reduced)."""

    def set_separate_reduce_scatter_group(
        self, enable: bool = True, *, recurse: bool = True
    ) -> None:
        """Accepted for FSDP2 compatibility: all-gathers and reductions already run on
        separate work handles of the backend."""

    def _set_unshard_async_op(self, async_op: bool) -> None:
        """Accepted for FSDP2 compatibility: gathers are always asynchronous here."""

    def reset_iter_state(self) -> None:
        """Forget this iteration's bookkeeping (after an aborted forward/backward)."""
        root = self._fsdp_state.root
        if root is not None:
            for state in root.states:
                state.pre_backward_done, state.forward_depth = False, 0
            root.backward_queued, root.in_forward, root.draining = False, 0, []

    def set_symm_mem_for_comm(self, backend: str = "NCCL") -> None:
        """Accepted for FSDP2 compatibility: symmetric-memory collectives are the backend's
        business (pass an fsdp_comm Backend that uses them as mesh=)."""


def _no_deepcopy(self: Any, memo: Any) -> Any:
    # FSDP2's words and type: a copy would share the flat shards, hooks and state of the
    # original (and torch's FSDPModule.__new__ cannot rebuild the module anyway).
    raise AssertionError(
        "FSDP does not support deepcopy. Please use state dict for "
        "serialization (or deepcopy the model before fully_shard)"
    )


def _state(module: nn.Module) -> FSDPState | None:
    """``fully_shard.state(module)``: the state `fully_shard` attached to ``module`` (one per
    call, shared by the modules of a grouped call), or None. Its fields are this engine's,
    not torch's private ones."""
    state: FSDPState | None = getattr(module, "_fsdp_state", None)
    return state


def _state_of(module: Any, arg: str) -> FSDPState:
    state: FSDPState | None = getattr(module, "_fsdp_state", None)
    if state is None:
        raise ValueError(
            f"{arg} must be modules passed to fully_shard, got {type(module).__name__}"
        )
    return state


def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh: Any = None,
    reshard_after_forward: bool | int | None = None,
    shard_placement_fn: Callable[[nn.Parameter], Any] | None = None,
    mp_policy: Any = None,
    offload_policy: Any = None,
    ignored_params: set[nn.Parameter] | None = None,
    comm: Any = None,
    memory: Any = None,
    param_init_fn: Callable[[nn.Module], None] | None = None,
    sync_module_states: bool = False,
    wrapper_class: type = FSDPModule,
    dp_mesh_dims: Any = None,
) -> Any:
    """Make ``module`` (or a list of modules, gathered together) an FSDP unit: its parameters
    not already in a unit are sharded on dim 0 now and become DTensors of their original
    shape (FSDP2's contract), kept as views of one flat shard per rank (the paper's).

    Call it bottom-up (each transformer block, then the whole model).
    ``shard_placement_fn(param) -> Shard(dim) | None`` shards a parameter on another dimension
    (MoE experts on dim 1, say; None: dim 0), as in FSDP2 (Note [shard dims]). ``mesh``: None (the
    default torch.distributed group), a torch ``DeviceMesh`` (1-D, or 2-D replicate x shard),
    an `fsdp_comm.Backend` or an `fsdp_comm.Mesh`. ``comm`` is an alias of a 1-D ``mesh``.
    ``reshard_after_forward``: True frees gathered parameters after forward, False keeps them
    until backward, an int reshards to groups of that many ranks; None (the default) frees
    them too, except in the root and in the unit whose forward ends last, whose backward
    comes first (Note [last unit stays]; FSDP2 keeps only the root).
    ``mp_policy``/``offload_policy``: this package's or torch's classes.
    ``memory``: an fsdp_memory manager (default: one per tree). A model on the ``meta``
    device gets meta DTensors: ``model.to_empty(device=...)`` then your init, or
    ``load_state_dict(sd, assign=True)`` (FSDP2's ways), or ``param_init_fn(module)`` here
    (``fsdp_engine.reset_parameters``, say), which initialises this unit now, one unit at a
    time (the paper's way); parameters still on meta at the first forward are an error.
    ``sync_module_states=True`` gives every rank rank 0's initial values.
    Tensor parallelism: parameters that are already DTensors on a tp mesh (from
    ``parallelize_module``) are sharded over ``mesh``, the data-parallel DeviceMesh of the
    same root mesh (Note [flat buffer on a 2-D mesh]); or pass the whole mesh with
    ``dp_mesh_dims`` (torch's ``DataParallelMeshDims``, or any object with ``shard`` and
    ``replicate`` dim names) when every parameter is a DTensor on it (Note [SPMD mesh]).
    Returns
    ``module``, whose class now also derives from `FSDPModule`; parameter names are
    unchanged.
    """
    modules = list(module) if isinstance(module, (list, tuple)) else [module]
    _check_modules(modules, ignored_params, shard_placement_fn)
    for p in ignored_params or ():
        p._fsdp_ignored = True  # type: ignore[attr-defined]  # also for later calls
    if comm is not None and mesh is not None and comm is not mesh:
        raise ValueError("pass mesh or comm, not both (comm is the 1-D mesh)")
    mesh = mesh if mesh is not None else comm
    name = type(modules[0]).__name__
    spmd = None
    if dp_mesh_dims is not None:  # Note [SPMD mesh]
        mesh, spmd = resolve_spmd(mesh, dp_mesh_dims, reshard_after_forward, name)
    check_mesh(mesh)
    rf = True if reshard_after_forward is None else reshard_after_forward
    check_reshard_after_forward(rf, None, name)
    mp, offload = as_mp_policy(mp_policy), as_offload_policy(offload_policy)
    backends = resolve_backends(mesh, rf, name)
    owned = managed_params(modules, name)
    init_now = param_init_fn is not None and any(p.device.type == "meta" for _, _, p in owned)
    if init_now:
        _init_now(modules, owned, backends.shard.device, param_init_fn)
    flats = shard_params(
        owned,
        backends,
        offload,
        sync_module_states=sync_module_states,
        unit_name=name,
        placement_fn=shard_placement_fn,
        spmd=spmd,
    )
    del owned
    if init_now:
        from ._lazy_init import trim_after_init

        trim_after_init(backends.shard.device)
    settings = UnitSettings(
        reshard_after_forward=rf, reshard_after_forward_auto=reshard_after_forward is None
    )
    config = StateConfig(
        backends=backends,
        mp=mp,
        offload=offload,
        memory=memory,
        settings=settings,
        flats=flats,
        param_init_fn=param_init_fn,
        sync_module_states=sync_module_states,
    )
    from ._lazy_init import lazy_init

    state = FSDPState(modules, config, lazy_init)
    for m in modules:
        object.__setattr__(m, "_fsdp_state", state)
        register_for_pipelining(m, state)
        key = (type(m), wrapper_class)
        if key not in _CLASS_CACHE:
            _CLASS_CACHE[key] = type(
                f"FSDP{type(m).__name__}", (wrapper_class, type(m)), {"__deepcopy__": _no_deepcopy}
            )
        m.__class__ = _CLASS_CACHE[key]
    return module


def _check_modules(modules: list[Any], ignored: Any, placement_fn: Any) -> None:
    if not modules:
        raise ValueError("fully_shard: module must be an nn.Module or a non-empty list of them")
    for m in modules:
        if not isinstance(m, nn.Module):
            raise TypeError(f"module must be an nn.Module, got {type(m).__name__}")
        if isinstance(m, FSDPModule):
            # FSDP2 raises an AssertionError with these words; its tests expect that type.
            raise AssertionError(
                "Each distinct composable distributed API can only be applied to a module "
                f"once. fully_shard: {type(m).__name__} is already an FSDP unit; call "
                "fully_shard once per module"
            )
        if isinstance(m, (nn.ModuleList, nn.ModuleDict)):
            raise ValueError(
                f"fully_shard does not support containers that do not implement forward: "
                f"{type(m).__name__} (its forward never runs, so its parameters would never "
                "be gathered); shard the modules in it, or the module that calls them"
            )
    if ignored is not None and (
        not isinstance(ignored, (set, frozenset))
        or not all(isinstance(p, nn.Parameter) for p in ignored)
    ):
        raise TypeError(
            f"ignored_params must be a set of nn.Parameter, got {type(ignored).__name__}"
        )
    if placement_fn is not None and not callable(placement_fn):
        raise TypeError(
            f"shard_placement_fn must be a callable (parameter -> Shard or None), "
            f"got {type(placement_fn).__name__}"
        )


def _init_now(
    modules: list[nn.Module],
    owned: Any,
    device: torch.device,
    fn: Callable[[nn.Module], None] | None,
) -> None:
    """The paper's deferred init: materialise and initialise this unit's modules now (full,
    one unit at a time); they are sharded right after."""
    from ._deferred_init import materialize_modules

    users = {id(mod) for _, uses, _ in owned for mod, _ in uses}
    scope = [(n, m) for root in modules for n, m in root.named_modules() if id(m) in users]
    materialize_modules(scope, device, fn)


fully_shard.state = _state  # type: ignore[attr-defined]  # torch's contract gives FSDP2 one
