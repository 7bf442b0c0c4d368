"""Deferred initialisation: a model built on the ``meta`` device is materialised one unit at a
time during lazy initialisation, and each unit is sharded at once, so no rank ever holds more
than one unit's full parameters.

The original ``nn.Parameter`` objects are kept (their ``.data`` is replaced), so an optimizer
made before the first forward still holds the right objects. Each module that owns meta
parameters or buffers directly is initialised by ``param_init_fn(module)`` when given, else by
its ``reset_parameters()`` (or ``_reset_parameters()``, as ``nn.MultiheadAttention`` names it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

__all__ = ["materialize_modules", "reset_parameters"]


def _has_meta(module: nn.Module) -> bool:
    tensors = [*module._parameters.values(), *module._buffers.values()]
    return any(t is not None and t.device.type == "meta" for t in tensors)


def reset_parameters(module: nn.Module) -> None:
    """A ``param_init_fn`` for `fully_shard`: the module's own ``reset_parameters()`` (or
    ``_reset_parameters()``, as ``nn.MultiheadAttention`` names it). Called only for modules
    that own meta parameters or buffers; one without either method is a ``ValueError``."""
    for name in ("reset_parameters", "_reset_parameters"):
        fn = getattr(module, name, None)
        if callable(fn):
            fn()
            return
    raise ValueError(
        f"module {type(module).__name__} has parameters on the meta device but no "
        "reset_parameters(); pass a param_init_fn= that initialises it"
    )


def _init_fn(
    module: nn.Module, fqn: str, param_init_fn: Callable[[nn.Module], None] | None
) -> Callable[[], None]:
    if param_init_fn is not None:
        return lambda: param_init_fn(module)
    for name in ("reset_parameters", "_reset_parameters"):
        fn = getattr(module, name, None)
        if callable(fn):
            return fn  # type: ignore[no-any-return]
    raise ValueError(
        f"module {fqn or '<root>'} ({type(module).__name__}) has parameters on the meta device "
        "but no reset_parameters(); pass param_init_fn= to initialise it"
    )


def _empty_like(p: nn.Parameter, device: torch.device) -> nn.Parameter:
    """An uninitialised parameter like meta ``p`` on ``device``: a DTensor of the same layout
    for a tensor-parallel piece (swap_tensors needs the same kind of tensor)."""
    local = getattr(p, "_local_tensor", None)
    if local is None:
        return nn.Parameter(
            torch.empty(p.shape, dtype=p.dtype, device=device), requires_grad=p.requires_grad
        )
    from torch.distributed.tensor import DTensor

    value = DTensor(  # type: ignore[no-untyped-call]  # torch leaves DTensor.__init__ untyped
        torch.empty(local.shape, dtype=p.dtype, device=device),
        p._spec,  # type: ignore[attr-defined]
        requires_grad=False,
    )
    return nn.Parameter(value, requires_grad=p.requires_grad)


def materialize_modules(
    modules: Sequence[tuple[str, nn.Module]],
    device: torch.device,
    param_init_fn: Callable[[nn.Module], None] | None,
) -> int:
    """Give every meta parameter and buffer of ``modules`` (not of their children) real
    storage on ``device`` and initialise it; returns how many modules were initialised."""
    done = 0
    for fqn, module in modules:
        if not _has_meta(module):
            continue
        init = _init_fn(module, fqn, param_init_fn)
        for p in module._parameters.values():
            if p is not None and p.device.type == "meta":
                # .data cannot move a tensor off meta; swap_tensors keeps the object identity
                # (torch leaves swap_tensors unannotated).
                torch.utils.swap_tensors(p, _empty_like(p, device))  # type: ignore[no-untyped-call]
        for name, b in module._buffers.items():
            if b is not None and b.device.type == "meta":
                module._buffers[name] = torch.empty(b.shape, dtype=b.dtype, device=device)
        with torch.no_grad():
            init()
        done += 1
    return done
