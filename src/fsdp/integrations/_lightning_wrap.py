"""Sharding a LightningModule the way `FSDPStrategy` does, without Lightning itself.

`shard_module` applies activation checkpointing, then `fully_shard` to every submodule the wrap
policy picks (deepest first), then to the root, and makes the root's ``*_step`` methods gather
and free parameters as its ``forward`` does. `materialize` gives a model built on the ``meta``
device real storage and calls each module's ``reset_parameters()`` (FSDP2's meta-device flow).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

__all__ = [
    "Policy",
    "STEP_METHODS",
    "as_predicate",
    "checkpoint_activations",
    "has_meta",
    "is_sharded",
    "materialize",
    "shard_module",
    "tp_size",
]

# A set (or list, tuple) of module classes, one class, or a callable(module) -> bool.
Policy = Any
# Lightning calls these on the LightningModule directly, not through ``forward``.
STEP_METHODS = ("training_step", "validation_step", "test_step", "predict_step")


def as_predicate(policy: Policy, what: str) -> Callable[[nn.Module], bool] | None:
    """``policy`` as a callable(module) -> bool; None for no policy."""
    if policy is None:
        return None
    if isinstance(policy, type) and issubclass(policy, nn.Module):
        policy = {policy}
    if isinstance(policy, (set, frozenset, list, tuple)):
        classes = tuple(policy)
        bad = [c for c in classes if not (isinstance(c, type) and issubclass(c, nn.Module))]
        if bad:
            raise TypeError(f"{what}: every entry must be an nn.Module subclass, got {bad!r}")
        return lambda m: isinstance(m, classes)
    if callable(policy):
        return policy  # type: ignore[no-any-return]
    raise TypeError(
        f"{what} must be a set of nn.Module classes or a callable(module) -> bool, "
        f"got {type(policy).__name__}"
    )


def is_sharded(model: nn.Module) -> bool:
    return getattr(model, "_fsdp_state", None) is not None


def _picked(model: nn.Module, predicate: Callable[[nn.Module], bool] | None) -> list[nn.Module]:
    if predicate is None:
        return []
    return [m for name, m in model.named_modules() if name and predicate(m)]


def checkpoint_activations(modules: Iterable[nn.Module]) -> None:
    """Recompute each module's forward in backward (``torch.utils.checkpoint``, non-reentrant).

    The module's ``forward`` is replaced on the instance, so parameter names stay as they were
    (``checkpoint_wrapper`` would add ``_checkpoint_wrapped_module.`` to every name, and a
    checkpoint saved with activation checkpointing would no longer load without it). The
    engine's gather and free run in the module's hooks, outside the recomputed region; in
    backward the unit is gathered before its recomputation runs.
    """
    from torch.utils.checkpoint import checkpoint

    for module in modules:
        if getattr(module, "_fsdp_lightning_checkpointed", False):
            continue
        inner = module.forward

        @functools.wraps(inner)
        def forward(*args: Any, _inner: Any = inner, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():
                return _inner(*args, **kwargs)
            return checkpoint(_inner, *args, use_reentrant=False, **kwargs)

        module.forward = forward
        module._fsdp_lightning_checkpointed = True  # type: ignore[assignment]


def shard_module(
    model: nn.Module,
    *,
    mesh: Any,
    wrap: Callable[[nn.Module], bool] | None,
    checkpointing: Callable[[nn.Module], bool] | None,
    **unit_kwargs: Any,
) -> nn.Module:
    """Shard ``model`` in place (units deepest first, then the root) and return it."""
    from fsdp_engine import fully_shard, register_fsdp_forward_method

    checkpoint_activations(_picked(model, checkpointing))
    units = [m for m in _picked(model, wrap) if not is_sharded(m)]
    for unit in reversed(units):  # named_modules is pre-order: reversed, children come first
        fully_shard(unit, mesh=mesh, **unit_kwargs)
    fully_shard(model, mesh=mesh, **unit_kwargs)
    for name in STEP_METHODS:
        if callable(getattr(model, name, None)):
            # Note [Lightning steps gather the root]: Lightning calls the steps directly, not
            # through forward, and a step may use the root's own parameters (a head applied in
            # the step) or call self(x) (the engine's Note [nested forward]).
            register_fsdp_forward_method(model, name)
    return model


def has_meta(model: nn.Module) -> bool:
    return any(t.is_meta for t in (*model.parameters(), *model.buffers()))


def materialize(model: nn.Module, device: torch.device) -> list[str]:
    """Allocate a (sharded) model built on ``meta`` on ``device`` and run each module's
    ``reset_parameters()``; returns the classes with state but no ``reset_parameters``."""
    if not has_meta(model):
        return []
    model.to_empty(device=device)
    uninitialized = set()
    for module in model.modules():
        own = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
        if not own:
            continue
        reset = getattr(module, "reset_parameters", None)
        if callable(reset):
            reset()
        else:
            uninitialized.add(type(module).__name__)
    return sorted(uninitialized)


def tp_size(tp: Any, dp: Any, mesh: Any) -> int:
    """`FSDPStrategy`'s ``tensor_parallel_size``, checked with ``data_parallel_size`` and
    ``device_mesh`` (ValueError naming the argument, the rule and the value)."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(
            f"tensor_parallel_size must be an int >= 1 (ranks per tensor-parallel "
            f"group), got {tp!r}"
        )
    if dp != "auto" and (isinstance(dp, bool) or not isinstance(dp, int) or dp < 1):
        raise ValueError(f"data_parallel_size must be 'auto' or an int >= 1, got {dp!r}")
    hybrid = (
        isinstance(mesh, tuple)
        and len(mesh) == 2
        and all(isinstance(n, int) and not isinstance(n, bool) for n in mesh)
    )
    if tp > 1 and mesh is not None and not hybrid:
        raise ValueError(
            f"tensor_parallel_size={tp} builds the mesh itself: device_mesh must "
            f"be None or (replicate, shard) with it, got {type(mesh).__name__}"
        )
    return tp
