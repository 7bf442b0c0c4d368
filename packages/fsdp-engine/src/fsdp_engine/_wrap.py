"""Wrap policies and `FullyShardedDataParallel`, the paper's wrapper entry point built on
`fully_shard`."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from torch import nn

from ._fully_shard import FSDPModule, fully_shard
from ._policies import MixedPrecisionPolicy, OffloadPolicy, ShardingStrategy

__all__ = ["WrapPolicy", "ModuleWrapPolicy", "SizeBasedWrapPolicy", "CallableWrapPolicy",
           "FullyShardedDataParallel", "apply_wrap_policy"]


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
        if isinstance(self.min_num_params, bool) or not isinstance(self.min_num_params, int) \
                or self.min_num_params < 1:
            raise ValueError(f"min_num_params must be an int >= 1, got {self.min_num_params!r}")

    def should_wrap(self, module: nn.Module, unwrapped_params: int) -> bool:
        return unwrapped_params >= self.min_num_params


@dataclass(frozen=True)
class CallableWrapPolicy(WrapPolicy):
    """``fn(module) -> bool`` decides."""

    fn: Callable[[nn.Module], bool]

    def should_wrap(self, module: nn.Module, unwrapped_params: int) -> bool:
        return bool(self.fn(module))


def _as_policy(policy: Any) -> WrapPolicy | None:
    if policy is None or isinstance(policy, WrapPolicy):
        return policy
    if isinstance(policy, (set, frozenset, list, tuple)):
        return ModuleWrapPolicy(policy)
    if callable(policy):
        return CallableWrapPolicy(policy)
    raise TypeError(f"auto_wrap_policy must be a WrapPolicy, a set of module classes or a "
                    f"callable, got {type(policy).__name__}")


def apply_wrap_policy(
    root: nn.Module, policy: WrapPolicy, wrap: Callable[[nn.Module], Any]
) -> None:
    """Call ``wrap`` on every submodule the policy picks, children before parents (not root)."""

    def visit(module: nn.Module) -> int:
        unwrapped = sum(visit(child) for child in module.children())
        unwrapped += sum(p.numel() for p in module.parameters(recurse=False))
        if module is not root and not isinstance(module, FSDPModule) and \
                policy.should_wrap(module, unwrapped):
            wrap(module)
            return 0
        return unwrapped

    visit(root)


class FullyShardedDataParallel(FSDPModule):
    """``FullyShardedDataParallel(module, ...)`` shards ``module`` in place and returns it.

    The result is the same module object (parameter names unchanged), now also an instance of
    this class and of `FSDPModule`. ``auto_wrap_policy`` picks the submodules that become their
    own units (a `WrapPolicy`, a set of block classes, or a callable); ``sharding_strategy`` maps
    to `fully_shard` settings: FULL_SHARD, SHARD_GRAD_OP (keep parameters from forward to
    backward), NO_SHARD (replicate; a mesh of shape (world, 1)) and HYBRID_SHARD (``mesh`` must
    be a 2-D `fsdp_comm.Mesh`).
    """

    def __new__(cls, module: nn.Module, *, mesh: Any = None, auto_wrap_policy: Any = None,
                sharding_strategy: ShardingStrategy = ShardingStrategy.FULL_SHARD,
                mixed_precision: MixedPrecisionPolicy | None = None,
                cpu_offload: OffloadPolicy | None = None, comm: Any = None,
                memory: Any = None, forward_prefetch: bool = True,
                param_init_fn: Callable[[nn.Module], None] | None = None,
                sync_module_states: bool = False) -> Any:
        mesh = _mesh_for(sharding_strategy, mesh if mesh is not None else comm)
        reshard = sharding_strategy is not ShardingStrategy.SHARD_GRAD_OP
        kwargs = dict(mesh=mesh, reshard_after_forward=reshard, mp_policy=mixed_precision,
                      offload_policy=cpu_offload, memory=memory, param_init_fn=param_init_fn,
                      sync_module_states=sync_module_states)
        policy = _as_policy(auto_wrap_policy)
        if policy is not None:
            apply_wrap_policy(module, policy, lambda m: _wrap_one(m, kwargs, forward_prefetch))
        return _wrap_one(module, kwargs, forward_prefetch)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # __new__ returned the (already built) wrapped module itself; Python now calls
        # __init__ on it with the wrapper's arguments, which must not rebuild anything.
        pass


def _wrap_one(module: nn.Module, kwargs: dict[str, Any], forward_prefetch: bool) -> nn.Module:
    fully_shard(module, **kwargs, wrapper_class=FullyShardedDataParallel)
    module._fsdp_state.settings.forward_prefetch = forward_prefetch
    return module


def _mesh_for(strategy: ShardingStrategy, mesh: Any) -> Any:
    from fsdp_comm import Backend, Mesh, get_backend, init_mesh

    if not isinstance(strategy, ShardingStrategy):
        raise TypeError(f"sharding_strategy must be a ShardingStrategy, got {strategy!r}")
    if strategy is ShardingStrategy.HYBRID_SHARD:
        if not isinstance(mesh, Mesh):
            raise ValueError("HYBRID_SHARD needs mesh=init_mesh((replicas, shard_size), ...), "
                             f"got {type(mesh).__name__}")
        return mesh
    if strategy is ShardingStrategy.NO_SHARD:
        world = mesh.world if isinstance(mesh, Mesh) else (mesh or get_backend("torch"))
        return init_mesh((world.world_size, 1), backend=world)
    if isinstance(mesh, Mesh):
        return mesh.world
    if mesh is not None and not isinstance(mesh, Backend):
        raise TypeError(f"mesh must be an fsdp_comm Backend or Mesh, got {type(mesh).__name__}")
    return mesh


