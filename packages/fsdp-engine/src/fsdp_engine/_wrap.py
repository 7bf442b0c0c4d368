"""Wrap policies and `FullyShardedDataParallel`, the paper's wrapper entry point built on
`fully_shard`, which takes torch FSDP1's arguments (Note [FSDP1 arguments])."""

from __future__ import annotations

import inspect
import warnings
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import BackwardPrefetch

from ._fully_shard import FSDPModule, fully_shard
from ._policies import ShardingStrategy, as_mp_policy, as_offload_policy

__all__ = [
    "WrapPolicy",
    "ModuleWrapPolicy",
    "SizeBasedWrapPolicy",
    "CallableWrapPolicy",
    "FullyShardedDataParallel",
    "apply_wrap_policy",
]

# Note [FSDP1 arguments]
# ~~~~~~~~~~~~~~~~~~~~~~
# `FullyShardedDataParallel` takes torch.distributed.fsdp.FullyShardedDataParallel's
# arguments, in its order, and maps each onto `fully_shard` (or says clearly why it cannot):
#
#   process_group      ProcessGroup -> a `torch` backend over it (one per group, cached);
#                      (shard_group, replicate_group) -> a 2-D mesh, HYBRID_SHARD only
#   device_mesh        1-D: shard over it; 2-D (replicate, shard): HYBRID_SHARD
#   sharding_strategy  torch's or our ShardingStrategy: FULL_SHARD, SHARD_GRAD_OP
#                      (reshard_after_forward=False), NO_SHARD (mesh (world, 1)),
#                      HYBRID_SHARD, _HYBRID_SHARD_ZERO2 (hybrid, no reshard after forward)
#   auto_wrap_policy   our WrapPolicy or a set of classes; FSDP1's callables
#                      (module, recurse, nonwrapped_numel) run as FSDP1's _recursive_wrap does;
#                      torch's ModuleWrapPolicy/CustomPolicy (their _run_policy, which FSDP1
#                      calls too; a CustomPolicy's dict overrides that unit's arguments);
#                      a plain fn(module) -> bool (CallableWrapPolicy)
#   mixed_precision    -> mp_policy, cpu_offload -> offload_policy (FSDP1 classes accepted)
#   device_id          must name the device the backend communicates on (where shards live);
#                      a unit's CPU parameters and buffers move there, as FSDP1 moves them
#   param_init_fn, sync_module_states -> fully_shard's (called per module owning meta
#                      tensors, after they got uninitialised storage on the backend's device)
#   forward_prefetch   the unit's forward prefetch setting (default True here)
#   backward_prefetch  BACKWARD_PRE (the engine's order) or None (no backward prefetch);
#                      BACKWARD_POST is warned about and runs as BACKWARD_PRE
#   limit_all_gathers  accepted: the memory layer's rate limiter always bounds gathers
#   use_orig_params    True accepted; False warned: parameter names are always the originals
#   ignored_modules/ignored_states  not supported unless empty


class WrapPolicy:
    """Decides which submodules become units. ``should_wrap(module, unwrapped_params)`` is
    asked children first; ``unwrapped_params`` counts parameters of the module's subtree not
    yet in a unit."""

    def should_wrap(self, module: nn.Module, unwrapped_params: int) -> bool:
        raise NotImplementedError


@dataclass(frozen=True)
class ModuleWrapPolicy(WrapPolicy):
    """Every instance of these classes (transformer blocks, say) becomes a unit."""

    module_classes: frozenset[type]

    def __init__(self, module_classes: Iterable[type]) -> None:
        classes = frozenset(module_classes)
        bad = [c for c in classes if not (isinstance(c, type) and issubclass(c, nn.Module))]
        if bad or not classes:
            raise TypeError(f"module_classes must be nn.Module subclasses, got {bad or 'none'}")
        object.__setattr__(self, "module_classes", classes)

    def should_wrap(self, module: nn.Module, unwrapped_params: int) -> bool:
        return isinstance(module, tuple(self.module_classes))


@dataclass(frozen=True)
class SizeBasedWrapPolicy(WrapPolicy):
    """A module becomes a unit once its not-yet-wrapped parameters reach ``min_num_params``."""

    min_num_params: int = 100_000_000

    def __post_init__(self) -> None:
        if (
            isinstance(self.min_num_params, bool)
            or not isinstance(self.min_num_params, int)
            or self.min_num_params < 1
        ):
            raise ValueError(f"min_num_params must be an int >= 1, got {self.min_num_params!r}")

    def should_wrap(self, module: nn.Module, unwrapped_params: int) -> bool:
        return unwrapped_params >= self.min_num_params


@dataclass(frozen=True)
class CallableWrapPolicy(WrapPolicy):
    """``fn(module) -> bool`` decides."""

    fn: Callable[[nn.Module], bool]

    def should_wrap(self, module: nn.Module, unwrapped_params: int) -> bool:
        return bool(self.fn(module))


@dataclass(frozen=True)
class _FSDP1Callable:
    """An FSDP1 auto-wrap callable ``fn(module=, recurse=, nonwrapped_numel=) -> bool``."""

    fn: Callable[..., bool]


def _is_fsdp1_callable(fn: Callable[..., Any]) -> bool:
    """FSDP1 calls its policies with the keywords module, recurse and nonwrapped_numel; a
    callable that binds them is one (``partial(transformer_auto_wrap_policy, ...)``,
    ``always_wrap_policy``), one that takes just a module is ``fn(module) -> bool``."""
    try:
        inspect.signature(fn).bind(module=None, recurse=True, nonwrapped_numel=0)
    except (TypeError, ValueError):
        return False
    return True


def _as_policy(policy: Any) -> Any:
    """A `WrapPolicy`, an `_FSDP1Callable`, a torch policy object (has ``_run_policy``) or
    None."""
    if policy is None or isinstance(policy, WrapPolicy):
        return policy
    if isinstance(policy, (set, frozenset, list, tuple)):
        return ModuleWrapPolicy(policy)
    if callable(getattr(policy, "_run_policy", None)):
        return policy  # torch's ModuleWrapPolicy, CustomPolicy (FSDP1 calls _run_policy too)
    if callable(policy):
        return _FSDP1Callable(policy) if _is_fsdp1_callable(policy) else CallableWrapPolicy(policy)
    raise TypeError(
        "auto_wrap_policy must be a WrapPolicy, a set of module classes, torch's "
        "ModuleWrapPolicy/CustomPolicy, an FSDP1 callable (module, recurse, "
        "nonwrapped_numel) -> bool or a callable fn(module) -> bool, got "
        f"{type(policy).__name__}"
    )


def apply_wrap_policy(
    root: nn.Module, policy: WrapPolicy, wrap: Callable[[nn.Module], Any]
) -> None:
    """Call ``wrap`` on every submodule the policy picks, children before parents (not root)."""

    def visit(module: nn.Module) -> int:
        unwrapped = sum(visit(child) for child in module.children())
        unwrapped += sum(p.numel() for p in module.parameters(recurse=False))
        if (
            module is not root
            and not isinstance(module, FSDPModule)
            and not isinstance(module, (nn.ModuleList, nn.ModuleDict))
            and policy.should_wrap(module, unwrapped)
        ):  # containers have no forward to hook
            wrap(module)
            return 0
        return unwrapped

    visit(root)


def _fsdp1_recursive_wrap(
    root: nn.Module, fn: Callable[..., bool], wrap: Callable[[nn.Module], Any]
) -> None:
    """FSDP1's ``_recursive_wrap`` with ``only_wrap_children=True`` at the root: ask
    ``fn(recurse=True)`` with the subtree's parameter count whether to descend, wrap the
    children, then ask ``fn(recurse=False)`` with what they left unwrapped whether to wrap the
    module. Modules that are units already count as wrapped and are not entered."""

    def visit(module: nn.Module, only_children: bool) -> int:  # returns the numel wrapped
        total = sum(p.numel() for p in module.parameters())
        if not only_children and isinstance(module, FSDPModule):
            return total
        if not fn(module=module, recurse=True, nonwrapped_numel=total):
            return 0
        wrapped = sum(visit(child, False) for child in module.children())
        if not only_children and fn(module=module, recurse=False, nonwrapped_numel=total - wrapped):
            wrap(module)
            return total
        return wrapped

    visit(root, True)


def _apply_torch_policy(
    root: nn.Module,
    policy: Any,
    root_kwargs: dict[str, Any],
    wrap: Callable[[nn.Module, dict[str, Any]], Any],
) -> None:
    """Wrap what torch's policy object picks, post-order like FSDP1's ``_post_order_apply``,
    passing each unit the arguments its policy changed (a CustomPolicy's dict)."""
    targets = policy._run_policy(root, set(), dict(root_kwargs))
    seen = {id(root)}

    def visit(module: nn.Module) -> None:
        for child in module.children():
            if id(child) not in seen and not isinstance(child, FSDPModule):
                seen.add(id(child))
                visit(child)
        if module is not root and module in targets:
            given = targets[module]
            wrap(
                module,
                {k: v for k, v in given.items() if k not in root_kwargs or root_kwargs[k] is not v},
            )

    visit(root)


@dataclass(frozen=True)
class _UnitConfig:
    """Everything one unit is built with, from the wrapper's arguments."""

    shard_kwargs: dict[str, Any]
    forward_prefetch: bool
    backward_prefetch: bool
    device: torch.device | None  # device_id's device: where a unit's CPU states move


_OVERRIDABLE = (
    "process_group",
    "sharding_strategy",
    "cpu_offload",
    "backward_prefetch",
    "mixed_precision",
    "param_init_fn",
    "device_id",
    "sync_module_states",
    "forward_prefetch",
    "limit_all_gathers",
    "use_orig_params",
    "device_mesh",
    "mesh",
    "comm",
    "memory",
)


class FullyShardedDataParallel(FSDPModule):
    """``FullyShardedDataParallel(module, ...)`` shards ``module`` in place and returns it.

    The result is the same module object (parameter names unchanged), now also an instance of
    this class and of `FSDPModule`. It takes torch FSDP1's arguments, in FSDP1's order
    (Note [FSDP1 arguments] in ``_wrap.py``), and this package's ``mesh`` (an
    `fsdp_comm.Backend`, `fsdp_comm.Mesh` or torch DeviceMesh), ``comm`` and ``memory``.
    ``auto_wrap_policy`` picks the submodules that become their own units (a `WrapPolicy`, a
    set of block classes, FSDP1's policy callables and objects, or ``fn(module) -> bool``);
    ``sharding_strategy`` (ours or torch's enum) maps to `fully_shard` settings: FULL_SHARD,
    SHARD_GRAD_OP (keep parameters from forward to backward), NO_SHARD (replicate; a mesh of
    shape (world, 1)) and HYBRID_SHARD (a 2-D mesh, 2-D device_mesh or process_group tuple).
    Arguments that cannot work raise ValueError or TypeError naming them.
    """

    def __new__(
        cls,
        module: nn.Module,
        process_group: Any = None,
        sharding_strategy: Any = None,
        cpu_offload: Any = None,
        auto_wrap_policy: Any = None,
        backward_prefetch: BackwardPrefetch | None = BackwardPrefetch.BACKWARD_PRE,
        mixed_precision: Any = None,
        ignored_modules: Iterable[Any] | None = None,
        param_init_fn: Callable[[nn.Module], None] | None = None,
        device_id: int | torch.device | None = None,
        sync_module_states: bool = False,
        forward_prefetch: bool = True,
        limit_all_gathers: bool = True,
        use_orig_params: bool | None = None,
        ignored_states: Iterable[Any] | None = None,
        device_mesh: DeviceMesh | None = None,
        *,
        mesh: Any = None,
        comm: Any = None,
        memory: Any = None,
    ) -> Any:
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
        _check_empty("ignored_modules", ignored_modules)
        _check_empty("ignored_states", ignored_states)
        args = dict(
            process_group=process_group,
            sharding_strategy=sharding_strategy,
            cpu_offload=cpu_offload,
            backward_prefetch=backward_prefetch,
            mixed_precision=mixed_precision,
            param_init_fn=param_init_fn,
            device_id=device_id,
            sync_module_states=sync_module_states,
            forward_prefetch=forward_prefetch,
            limit_all_gathers=limit_all_gathers,
            use_orig_params=use_orig_params,
            device_mesh=device_mesh,
            mesh=mesh,
            comm=comm,
            memory=memory,
        )
        config = _resolve(args)
        policy = _as_policy(auto_wrap_policy)
        if isinstance(policy, WrapPolicy):
            apply_wrap_policy(module, policy, lambda m: _wrap_one(m, config))
        elif isinstance(policy, _FSDP1Callable):
            _fsdp1_recursive_wrap(module, policy.fn, lambda m: _wrap_one(m, config))
        elif policy is not None:
            configs: dict[tuple[tuple[str, int], ...], _UnitConfig] = {}

            def wrap(m: nn.Module, overrides: dict[str, Any]) -> None:
                _check_overrides(m, overrides)
                key = tuple(sorted((k, id(v)) for k, v in overrides.items()))
                if key not in configs:
                    configs[key] = _resolve({**args, **overrides}) if overrides else config
                _wrap_one(m, configs[key])

            root_kwargs = {
                **args,
                "ignored_modules": ignored_modules,
                "ignored_states": ignored_states,
                "auto_wrap_policy": None,
            }
            _apply_torch_policy(module, policy, root_kwargs, wrap)
        return _wrap_one(module, config)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # __new__ returned the (already built) wrapped module itself; Python now calls
        # __init__ on it with the wrapper's arguments, which must not rebuild anything.
        pass


def _check_empty(name: str, value: Any) -> None:
    if value is None:
        return
    items = list(value)
    if items:
        raise ValueError(
            f"{name} is not supported by fsdp_engine (got {len(items)} "
            f"{'entry' if len(items) == 1 else 'entries'}: "
            f"{', '.join(type(i).__name__ for i in items[:3])}{'...' if len(items) > 3 else ''}):"
            " every parameter of a wrapped module is sharded; freeze parameters with "
            "requires_grad=False or keep those modules outside the module you wrap"
        )


def _check_overrides(module: nn.Module, overrides: dict[str, Any]) -> None:
    bad = sorted(k for k in overrides if k not in _OVERRIDABLE)
    if bad:
        raise TypeError(
            f"auto_wrap_policy gave {type(module).__name__} the arguments {bad}, "
            f"which a unit cannot override here (allowed: {list(_OVERRIDABLE)})"
        )


def _wrap_one(module: nn.Module, config: _UnitConfig) -> nn.Module:
    if config.device is not None and config.device.type != "cpu":
        _move_states(module, config.device)
    fully_shard(module, **config.shard_kwargs, wrapper_class=FullyShardedDataParallel)
    assert isinstance(module, FSDPModule)  # its class now derives from wrapper_class
    module._fsdp_state.settings.forward_prefetch = config.forward_prefetch
    if not config.backward_prefetch:
        module.set_modules_to_backward_prefetch([])
    return module


def _move_states(module: nn.Module, device: torch.device) -> None:
    """Move the CPU parameters and buffers of ``module``'s modules not yet in a unit to
    ``device`` (FSDP1 moves a module to ``device_id``), keeping the parameter objects."""
    stack = [module]
    while stack:
        m = stack.pop()
        stack.extend(c for c in m.children() if not isinstance(c, FSDPModule))
        for p in m._parameters.values():
            if p is not None and p.device.type == "cpu":
                p.data = p.data.to(device)
        for name, b in m._buffers.items():
            if b is not None and b.device.type == "cpu":
                m._buffers[name] = b.to(device)


def _warn(message: str) -> None:
    warnings.warn(message, UserWarning, stacklevel=4)


def _resolve(args: dict[str, Any]) -> _UnitConfig:
    """FSDP1's arguments -> `fully_shard`'s, checked (Note [FSDP1 arguments])."""
    name = _strategy_name(args["sharding_strategy"])
    kind, reshard = _STRATEGIES[name]
    mesh = _mesh_for(kind, name, args)
    device = _check_device_id(args["device_id"], mesh)
    mp = args["mixed_precision"]
    mp_policy = _converted("mixed_precision", as_mp_policy, mp)
    offload = _converted("cpu_offload", as_offload_policy, args["cpu_offload"])
    if getattr(mp, "keep_low_precision_grads", False):
        _warn(
            "mixed_precision.keep_low_precision_grads=True is ignored: gradients are reduced "
            "in reduce_dtype and accumulate in the parameters' full precision"
        )
    for flag in ("sync_module_states", "forward_prefetch", "limit_all_gathers"):
        if not isinstance(args[flag], bool):
            raise TypeError(f"{flag} must be a bool, got {args[flag]!r}")
    use_orig = args["use_orig_params"]
    if use_orig is not None and not isinstance(use_orig, bool):
        raise TypeError(f"use_orig_params must be a bool, got {use_orig!r}")
    if use_orig is False:
        _warn(
            "use_orig_params=False is ignored: parameters always keep their original names "
            "and objects here (no FlatParameter or _fsdp_wrapped_module prefixes)"
        )
    prefetch = args["backward_prefetch"]
    if prefetch is not None and not isinstance(prefetch, BackwardPrefetch):
        raise TypeError(
            "backward_prefetch must be BackwardPrefetch.BACKWARD_PRE, "
            f"BackwardPrefetch.BACKWARD_POST or None, got {prefetch!r}"
        )
    if prefetch is BackwardPrefetch.BACKWARD_POST:
        _warn(
            "backward_prefetch=BACKWARD_POST is ignored: units prefetch the next unit's "
            "parameters when their own backward starts (BACKWARD_PRE)"
        )
    init = args["param_init_fn"]
    if init is not None and not callable(init):
        raise TypeError(f"param_init_fn must be callable or None, got {type(init).__name__}")
    kwargs = dict(
        mesh=mesh,
        reshard_after_forward=reshard,
        mp_policy=mp_policy,
        offload_policy=offload,
        memory=args["memory"],
        param_init_fn=init,
        sync_module_states=args["sync_module_states"],
    )
    return _UnitConfig(kwargs, args["forward_prefetch"], prefetch is not None, device)


def _converted(arg: str, convert: Callable[[Any], Any], value: Any) -> Any:
    try:
        return convert(value)
    except TypeError as exc:
        raise TypeError(f"{arg}: {exc}") from None


# FSDP1 strategy name -> (mesh kind, reshard_after_forward)
_STRATEGIES = {
    "FULL_SHARD": ("shard", None),  # None: fully_shard's default (Note [last unit stays])
    "SHARD_GRAD_OP": ("shard", False),
    "NO_SHARD": ("replicate", True),
    "HYBRID_SHARD": ("hybrid", None),
    "_HYBRID_SHARD_ZERO2": ("hybrid", False),
}


def _strategy_name(strategy: Any) -> str:
    from torch.distributed.fsdp import ShardingStrategy as TorchStrategy

    if strategy is None:
        return "FULL_SHARD"
    if isinstance(strategy, (ShardingStrategy, TorchStrategy)):
        return strategy.name
    raise TypeError(
        "sharding_strategy must be a ShardingStrategy (fsdp_engine's or "
        "torch.distributed.fsdp's: FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, "
        f"HYBRID_SHARD, _HYBRID_SHARD_ZERO2) or None, got {strategy!r}"
    )


_GROUP_BACKENDS: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
_NO_SHARD_MESHES: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def _group_backend(group: Any) -> Any:
    """The `torch` backend over a process group (the default group's is the one `fully_shard`
    uses for ``mesh=None``); one per group, so every unit on it shares one backend."""
    import torch.distributed as dist
    from fsdp_comm import TorchBackend

    from ._mesh_resolve import _default_backend

    if group == dist.group.WORLD:
        return _default_backend()
    found = _GROUP_BACKENDS.get(group)
    if found is None:
        found = _GROUP_BACKENDS[group] = TorchBackend(group)
    return found


def _mesh_for(kind: str, name: str, args: dict[str, Any]) -> Any:
    """What `fully_shard`'s ``mesh`` gets for this strategy and these mesh arguments."""
    from fsdp_comm import Backend, Mesh
    from torch.distributed import ProcessGroup

    given = {
        k: args[k] for k in ("mesh", "comm", "process_group", "device_mesh") if args[k] is not None
    }
    if len({id(v) for v in given.values()}) > 1:
        raise ValueError(
            f"pass one of mesh, comm, process_group and device_mesh, got {sorted(given)}"
        )
    arg, value = next(iter(given.items()), ("mesh", None))
    if arg == "process_group":
        if isinstance(value, (tuple, list)):
            if len(value) != 2 or not all(isinstance(g, ProcessGroup) for g in value):
                raise TypeError(
                    "process_group must be a ProcessGroup or a tuple (shard_group, "
                    f"replicate_group) of two, got {_describe(value)}"
                )
            if kind != "hybrid":
                raise ValueError(
                    f"process_group=(shard_group, replicate_group) is for "
                    f"HYBRID_SHARD and _HYBRID_SHARD_ZERO2, not {name}: pass one "
                    "ProcessGroup"
                )
            return _hybrid_from_groups(value[0], value[1])
        if not isinstance(value, ProcessGroup):
            raise TypeError(
                "process_group must be a torch.distributed ProcessGroup or a tuple "
                "(shard_group, replicate_group), got "
                f"{type(value).__name__} (pass an fsdp_comm Backend or Mesh as "
                "mesh=, a DeviceMesh as device_mesh=)"
            )
        if kind == "hybrid":
            raise ValueError(
                f"{name} with process_group needs a tuple (shard_group, "
                "replicate_group), got one ProcessGroup (FSDP1's rule); or pass "
                "a 2-D device_mesh or mesh=init_mesh((replicas, shard_size))"
            )
        value = _group_backend(value)
    elif value is not None and not isinstance(value, (Backend, Mesh, DeviceMesh)):
        if arg == "device_mesh":
            raise TypeError(f"device_mesh must be a torch DeviceMesh, got {type(value).__name__}")
        raise TypeError(
            f"{arg} must be an fsdp_comm Backend or Mesh or a torch DeviceMesh, got "
            f"{type(value).__name__}"
        )
    if isinstance(value, DeviceMesh) and value.ndim not in (1, 2):
        raise ValueError(
            f"{arg}: a DeviceMesh must be 1-D (shard) or 2-D (replicate, shard), "
            f"got {value.ndim} dimensions"
        )
    two_d = isinstance(value, Mesh) or (isinstance(value, DeviceMesh) and value.ndim == 2)
    if kind == "hybrid":
        if not two_d:
            raise ValueError(
                f"{name} needs mesh=init_mesh((replicas, shard_size), ...), a 2-D device_mesh "
                "(replicate, shard) or process_group=(shard_group, replicate_group); got "
                f"{arg}={_describe(value)}"
            )
        if isinstance(value, DeviceMesh) and value.mesh_dim_names is None:
            # FSDP1 takes a 2-D mesh without names (FSDP2, and so fully_shard, do not): the
            # same groups, named.
            value = DeviceMesh.from_group(
                [value.get_group(0), value.get_group(1)],
                value.device_type,
                mesh=value.mesh,
                mesh_dim_names=("replicate", "shard"),
            )
        return value
    if isinstance(value, DeviceMesh):
        if value.ndim == 2:
            raise ValueError(
                f"{arg}: a 2-D DeviceMesh (replicate, shard) is hybrid sharding; "
                f"pass sharding_strategy=HYBRID_SHARD, not {name}"
            )
        if kind == "shard":
            return value
        value = _group_backend(value.get_group())
    if isinstance(value, Mesh):
        value = value.world
    if kind == "shard":
        return value
    return _no_shard_mesh(value)


def _no_shard_mesh(world: Any) -> Any:
    """NO_SHARD: a (world, 1) mesh, shard groups of one rank (one mesh per world backend).
    Over a torch process group it is a 2-D DeviceMesh (replicate, shard), FSDP2's way of
    writing NO_SHARD; over other backends an `fsdp_comm.Mesh`."""
    import torch.distributed as dist
    from fsdp_comm import init_mesh

    from ._mesh_resolve import _default_backend

    world = _default_backend() if world is None else world
    found = _NO_SHARD_MESHES.get(world)
    if found is None:
        group = getattr(world, "process_group", None)
        if group is None:
            found = init_mesh((world.world_size, 1), backend=world)
        else:
            ranks = torch.tensor(dist.get_process_group_ranks(group), dtype=torch.int)
            mine = dist.new_group([dist.get_rank()], use_local_synchronization=True)
            found = DeviceMesh.from_group(
                [group, mine], world.device.type, mesh=ranks.view(-1, 1), mesh_dim_names=_DIM_NAMES
            )
        _NO_SHARD_MESHES[world] = found
    return found


_DIM_NAMES = ("replicate", "shard")
_HYBRID_MESHES: dict[tuple[int, int], tuple[Any, Any, DeviceMesh]] = {}


def _hybrid_from_groups(shard_group: Any, replicate_group: Any) -> DeviceMesh:
    """FSDP1's (intra-node shard group, inter-node replicate group) as a 2-D DeviceMesh
    (replicate, shard) laid out row-major: shard groups of consecutive ranks."""
    import torch.distributed as dist

    from ._mesh_resolve import _default_backend

    key = (id(shard_group), id(replicate_group))
    if key in _HYBRID_MESHES:
        return _HYBRID_MESHES[key][2]
    shard = list(dist.get_process_group_ranks(shard_group))
    replicate = list(dist.get_process_group_ranks(replicate_group))
    world, rank, size = dist.get_world_size(), dist.get_rank(), len(shard)
    start = rank // size * size
    if (
        size * len(replicate) != world
        or shard != list(range(start, start + size))
        or replicate != list(range(rank % size, world, size))
    ):
        raise ValueError(
            "process_group=(shard_group, replicate_group) must lay the world's ranks out "
            "row-major: shard groups of consecutive ranks, replicate groups of every "
            f"shard-size-th rank, covering all {world} ranks; rank {rank} got shard group "
            f"{shard} and replicate group {replicate}"
        )
    ranks = torch.arange(world, dtype=torch.int).view(len(replicate), size)
    mesh = DeviceMesh.from_group(
        [replicate_group, shard_group],
        _default_backend().device.type,
        mesh=ranks,
        mesh_dim_names=_DIM_NAMES,
    )
    _HYBRID_MESHES[key] = (shard_group, replicate_group, mesh)  # the groups keep their ids
    return mesh


def _describe(value: Any) -> str:
    if isinstance(value, (tuple, list)):
        return f"({', '.join(type(v).__name__ for v in value)})"
    return "None" if value is None else type(value).__name__


def _mesh_device(mesh: Any) -> torch.device:
    from fsdp_comm import Mesh

    from ._mesh_resolve import _default_backend

    device: torch.device
    if mesh is None:
        device = _default_backend().device
    elif isinstance(mesh, DeviceMesh):
        device = torch.device(mesh.device_type)
    elif isinstance(mesh, Mesh):
        device = mesh.shard.device
    else:
        device = mesh.device
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _check_device_id(device_id: Any, mesh: Any) -> torch.device | None:
    """FSDP1's device_id must be where this backend communicates (where the shards live)."""
    if device_id is None:
        return None
    if isinstance(device_id, bool) or not isinstance(device_id, (int, str, torch.device)):
        raise TypeError(
            f"device_id must be an int, a torch.device or None, got {type(device_id).__name__}"
        )
    have = _mesh_device(mesh)
    if isinstance(device_id, int):
        ok = have.type != "cpu" and have.index == device_id
    else:
        want = torch.device(device_id)
        if want.type == "cuda" and want.index is None and have.type == "cuda":
            want = torch.device("cuda", torch.cuda.current_device())
        ok = want.type == have.type and want.index in (None, have.index)
    if not ok:
        raise ValueError(
            f"device_id={device_id!r} does not match the device the process group communicates "
            f"on, {have}, where the shards live (an int device_id is an accelerator index): "
            f"pass device_id=None or torch.device({str(have)!r}), or a process group or mesh "
            "on that device"
        )
    return have
