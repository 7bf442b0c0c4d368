"""`summon_full_params` and `register_fsdp_forward_method`: full parameters outside forward."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

from torch import nn

__all__ = ["summon_full_params", "register_fsdp_forward_method"]


def _states(model: nn.Module) -> list[Any]:
    from ._layout import _fsdp_states

    return _fsdp_states(model)


@contextlib.contextmanager
def summon_full_params(model: nn.Module, *, writeback: bool = True) -> Iterator[None]:
    """Inside the block every parameter of ``model`` has its full shape and value (gathered in
    its own dtype, one buffer per unit). With ``writeback`` in-place changes are copied back
    to the shards on exit. Collective: every rank enters it. Not for use inside forward."""
    from ._layout import gather_full
    from ._shard_init import fill_local_shard
    from ._tensor_parallel import tp_parameter

    gathered = []
    for state in _states(model):
        unit = state.unit
        for g in unit.groups:
            full = gather_full(unit, g.flat)
            views = [g.flat.layout.full_view(full, s) for s in g.flat.layout.slots]
            # Tensor-parallel parameters show their whole tp piece, as a tp DTensor.
            shown = [
                nn.Parameter(v, requires_grad=p.requires_grad)
                if s.tp is None
                else tp_parameter(s.tp, v, p.requires_grad)
                for v, p, s in zip(views, g.flat.params, g.flat.layout.slots)
            ]
            for slots, name, _, i in g.flat.bindings:
                slots[name] = shown[i]
            gathered.append((g.flat, views))
    try:
        yield
    finally:
        for flat, views in gathered:
            if writeback:
                fill_local_shard(flat.layout, flat.local_shard, flat.shard_index, views)
            for slots, name, param, _ in flat.bindings:
                slots[name] = param


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Make ``module.<method_name>`` (``generate``, say) gather and free parameters like
    ``forward`` does. ``module`` must have been passed to `fully_shard`."""
    state = getattr(module, "_fsdp_state", None)
    if state is None:
        raise ValueError(
            f"register_fsdp_forward_method: {type(module).__name__} was not passed to fully_shard"
        )
    method = getattr(module, method_name, None)
    if not callable(method):
        raise ValueError(
            f"register_fsdp_forward_method: {type(module).__name__} has no method {method_name!r}"
        )

    @functools.wraps(method)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = state._pre_forward(module, args, kwargs)
        output = None
        try:
            output = method(*args, **kwargs)
        finally:
            output = state._post_forward(module, args, output)
        return output

    object.__setattr__(module, method_name, wrapped)
