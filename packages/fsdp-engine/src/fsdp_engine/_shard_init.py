"""Sharding a module's parameters when `fully_shard` is called (FSDP2's timing): the
parameters of the module's subtree not already in a unit are laid out (Note [rank-major
layout]), each rank keeps its rows, and every registration of each parameter is replaced by
a DTensor parameter over the local shard. A model on the ``meta`` device stays there (its
DTensors too) until ``to_empty`` or, unit by unit, a ``param_init_fn`` or the lazy
initialisation materialises it (``_deferred_init.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ._dtensor_param import device_mesh_for
from ._flat_param import FlatLayout, FlatParameter
from ._mesh_resolve import Backends
from ._policies import CPUOffloadPolicy, OffloadPolicy
from ._shared_params import take_over_shared
from ._tensor_parallel import check_tp_mesh, tensor_parallel_of, tp_parameter

__all__ = ["Owned", "managed_params", "shard_params"]

#: (first FQN, every (module, name) registering it, the parameter), per parameter.
Owned = list[tuple[str, tuple[tuple[nn.Module, str], ...], nn.Parameter]]


def managed_params(modules: list[nn.Module], unit_name: str) -> Owned:
    """Parameters of the modules' subtrees that no unit holds yet, in registration order,
    each with every place it is registered (tied weights, also across the modules of a
    grouped call); parameters an earlier call sharded and this call contains both uses of
    are taken over (Note [shared parameters])."""
    uses: dict[int, list[tuple[str, nn.Module, str]]] = {}
    params: dict[int, nn.Parameter] = {}
    for top in modules:
        for mod_name, mod in top.named_modules(remove_duplicate=False):
            for pname, p in mod._parameters.items():
                if (
                    p is None
                    or getattr(p, "_fsdp_flat", None) is not None
                    or getattr(p, "_fsdp_ignored", False)
                ):
                    continue
                fqn = f"{mod_name}.{pname}" if mod_name else pname
                if getattr(p, "_fsdp_sharded_as", None) is not None and id(p) not in params:
                    taken = take_over_shared(modules, p, unit_name)
                    if taken is None:
                        continue  # refused at the first forward (check_ties)
                    sharded, earlier = taken
                    p._fsdp_replaced_by = None
                    uses[id(p)] = [(fqn, m, n) for m, n in earlier]
                    params[id(p)] = sharded
                uses.setdefault(id(p), []).append((fqn, mod, pname))
                params[id(p)] = params.get(id(p), p)
    return [
        (use[0][0], tuple(dict.fromkeys((m, n) for _, m, n in use)), params[pid])
        for pid, use in uses.items()
    ]


def shard_params(
    owned: Owned,
    backends: Backends,
    offload: OffloadPolicy,
    *,
    sync_module_states: bool,
    unit_name: str,
    placement_fn: Callable[[nn.Parameter], Any] | None = None,
    spmd: Any = None,
) -> list[FlatParameter]:
    """One FlatParameter per group (trainable, frozen) of ``owned``; the modules' parameters
    are replaced by DTensor parameters over it. ``placement_fn``: FSDP2's
    ``shard_placement_fn`` (Note [shard dims])."""
    trainable = [o for o in owned if o[2].requires_grad]
    frozen = [o for o in owned if not o[2].requires_grad]
    flats = []
    for group in (trainable, frozen):
        if group:
            dims = (
                None
                if placement_fn is None
                else [shard_dim_of(placement_fn, fqn, p) for fqn, _, p in group]
            )
            flats.append(
                _shard_group(group, backends, offload, sync_module_states, unit_name, dims, spmd)
            )
    return flats


def shard_dim_of(placement_fn: Callable[[nn.Parameter], Any], fqn: str, param: nn.Parameter) -> int:
    """The dimension ``placement_fn`` shards ``param`` on (None: 0), made non-negative."""
    from torch.distributed.tensor import Shard

    placement = placement_fn(param)
    if placement is None:
        return 0
    if not isinstance(placement, Shard):
        raise ValueError(
            f"shard_placement_fn must return a Shard placement or None, got {placement!r} for {fqn}"
        )
    dim = placement.dim
    if not -param.ndim <= dim < param.ndim:
        # FSDP2 raises this (an AssertionError, with these words) too.
        raise AssertionError(
            f"Shard dim {dim} is invalid for {param.ndim}D tensor: {fqn} "
            f"of shape {tuple(param.shape)}"
        )
    return dim % param.ndim


def _check_contiguous(group: Owned, unit_name: str) -> None:
    """FSDP2 refuses non-contiguous parameters (channels_last convolutions); so does this
    engine, with FSDP2's words: a shard of such a parameter in its memory order is not its
    dim-0 slice."""
    for fqn, _, p in group:
        if p.device.type != "meta" and not p.is_contiguous():
            raise NotImplementedError(
                f"FSDP does not support non-contiguous parameters yet: fully_shard({unit_name}) "
                f"got {fqn} of shape {tuple(p.shape)} and stride {p.stride()}; make it "
                "contiguous first (module.to(memory_format=torch.contiguous_format))"
            )


def _check_uniform(group: Owned, unit_name: str) -> None:
    dtypes = {p.dtype for _, _, p in group}
    devices = {p.device.type for _, _, p in group}
    if len(dtypes) > 1 or len(devices) > 1:
        detail = ", ".join(f"{fqn}: {p.dtype} on {p.device}" for fqn, _, p in group)
        raise ValueError(
            f"fully_shard({unit_name or '<root>'}): parameters of one unit must share one dtype "
            f"and device (flattened together); got {detail}"
        )


def _shard_group(
    group: Owned,
    backends: Backends,
    offload: OffloadPolicy,
    sync_module_states: bool,
    unit_name: str,
    dims: list[int] | None = None,
    spmd: Any = None,
) -> FlatParameter:
    _check_contiguous(group, unit_name)
    _check_uniform(group, unit_name)
    shard = backends.shard
    params = [p for _, _, p in group]
    tps = [tensor_parallel_of(p, fqn, unit_name, spmd) for fqn, _, p in group]
    if spmd is None:
        check_tp_mesh(backends.device_mesh, tps, unit_name)
    for dim, (fqn, _, p), tp in zip(dims or (), group, tps):
        if tp is not None:
            p = p._local_tensor  # type: ignore[attr-defined]  # a DTensor (tp is not None)
        if dim and p.shape[dim] % shard.world_size:
            # FSDP2 refuses this too, with these words, and its tests expect them; the layout
            # itself would handle it (Note [shard dims]).
            raise NotImplementedError(
                f"FSDP does not support uneven sharding on dim {dim}: {p.shape} (world size: "
                f"{shard.world_size}); parameter {fqn} of fully_shard({unit_name})"
            )
    if dims is not None and any(dims) and backends.post_forward is not None:
        raise ValueError(
            f"fully_shard({unit_name}): shard_placement_fn sharding on a dimension other than "
            "0 cannot be combined with an int reshard_after_forward"
        )
    layout = FlatLayout.build(
        group, shard.world_size, params[0].dtype, dims, tps if any(tps) else None
    )
    meta = params[0].device.type == "meta"
    device = torch.device("meta") if meta else shard.device
    local = torch.zeros(layout.shard_numel, dtype=params[0].dtype, device=device)
    if not meta:
        source = backends.world if sync_module_states and backends.world.world_size > 1 else None
        fill_local_shard(layout, local, shard.rank, params, broadcast_from=source)
        if isinstance(offload, CPUOffloadPolicy) and device.type != "cpu":
            local = local.to("cpu")
            local = (
                local.pin_memory() if offload.pin_memory and torch.cuda.is_available() else local
            )
    spec = device_mesh_for(shard, backends.replicate, backends.world, backends.device_mesh)
    sharded = [
        spec.parameter(layout.local_view(local, slot, shard.rank), slot, p.requires_grad)
        for slot, p in zip(layout.slots, params)
    ]
    flat = FlatParameter(layout, local, shard.rank, sharded, spec)
    flat.shard_group = shard
    for slot, old, new in zip(layout.slots, params, sharded):
        new._fsdp_flat = flat  # type: ignore[attr-defined]  # clip_grad_norm_ finds the group
        old._fsdp_sharded_as = (  # type: ignore[attr-defined]
            f"{slot.fqn} of fully_shard({unit_name})"
        )
        old._fsdp_replaced_by = new  # type: ignore[attr-defined]  # Note [shared parameters]
        for mod, name in slot.uses:
            mod._parameters[name] = new
    return flat


def fill_local_shard(
    layout: FlatLayout,
    local: torch.Tensor,
    shard_index: int,
    full: Sequence[torch.Tensor],
    *,
    broadcast_from: Any = None,
) -> None:
    """Copy this rank's rows of each full value in ``full`` into ``local``.
    ``broadcast_from``: a backend whose rank 0's values every rank takes first."""
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        for slot, value in zip(layout.slots, full):
            if (
                isinstance(value, DTensor)
                and getattr(value, "_fsdp_flat", None) is None
                and (slot.tp is None or value.device_mesh != slot.tp.mesh)
            ):
                raise AssertionError(
                    f"parameter {slot.fqn}: a DTensor on {value.device_mesh} "
                    f"({value.placements}) where the layout expects "
                    f"{'a plain tensor' if slot.tp is None else slot.tp.mesh}"
                )
            value = value.detach()
            if (
                slot.tp is not None
                and isinstance(value, DTensor)
                and value.device_mesh == slot.tp.mesh
            ):
                value = value._local_tensor  # Note [flat buffer on a 2-D mesh]: its tp piece
            elif isinstance(value, DTensor):  # Note [shared parameters]: rows already here
                rows = value._local_tensor
                if tuple(rows.shape) == slot.local_shape(slot.local_rows(shard_index)):
                    layout.local_view(local, slot, shard_index).copy_(rows)
                    continue
                value = value.full_tensor()
            if broadcast_from is not None:
                value = value.to(local.device, copy=True).contiguous()
                broadcast_from.broadcast(value, src=0)
            layout.local_view(local, slot, shard_index).copy_(slot.rows_of(value, shard_index))


def materialize_into_shards(
    flats: list[FlatParameter],
    device: torch.device,
    init: Callable[[list[tuple[str, nn.Module]]], object],
    *,
    broadcast_from: Any = None,
) -> None:
    """Give meta flats real shards: register full meta parameters on the modules, let
    ``init`` materialise and initialise them (``materialize_modules`` with
    ``reset_parameters`` or a ``param_init_fn``), keep this rank's rows, and put the DTensor
    parameters back. One group's full parameters exist at a time."""
    for flat in flats:
        if not flat.on_meta:
            continue
        full = [
            nn.Parameter(
                torch.empty(s.shape, dtype=flat.dtype, device="meta"), requires_grad=p.requires_grad
            )
            if s.tp is None
            else tp_parameter(
                s.tp, torch.empty(s.shape, dtype=flat.dtype, device="meta"), p.requires_grad
            )
            for s, p in zip(flat.layout.slots, flat.params)
        ]
        scope: dict[nn.Module, str] = {}
        for slot, f in zip(flat.layout.slots, full):
            for mod, name in slot.uses:
                mod._parameters[name] = f
                scope.setdefault(mod, slot.fqn.rpartition(".")[0])
        try:
            init([(name, mod) for mod, name in scope.items()])
            local = torch.zeros(flat.layout.shard_numel, dtype=flat.dtype, device=device)
            fill_local_shard(
                flat.layout, local, flat.shard_index, full, broadcast_from=broadcast_from
            )
        finally:
            for slot, p in zip(flat.layout.slots, flat.params):
                for mod, name in slot.uses:
                    mod._parameters[name] = p
        del full
        flat.set_shard(local)
