"""The sharded layout that fsdp-ckpt reads, and gathering full parameters from it.

`sharded_layout(model)` lists, for every original parameter, its FQN, global shape and dtype,
and the slice of its flattened values this rank holds (``flat_start``, ``length``) together
with the local tensor holding it (a view of the unit's local shard: writing into it changes
the model). `full_parameters(model)` all-gathers every unit and returns full CPU copies.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["ParamShard", "sharded_layout", "full_parameters", "model_backend"]


@dataclass(frozen=True)
class ParamShard:
    """One original parameter as this rank holds it."""

    fqn: str
    global_shape: torch.Size
    dtype: torch.dtype
    flat_start: int  # first element (of the flattened parameter) held here
    length: int  # elements held here (0 when none)
    local: torch.Tensor  # 1-D view of the unit's local shard (length elements)
    unit_fqn: str
    shard_rank: int
    shard_count: int
    replicate_rank: int


def _fsdp_states(model: nn.Module) -> list:
    states = [m._fsdp_state for m in model.modules() if getattr(m, "_fsdp_state", None)]
    if not states:
        raise ValueError("model has no fully_shard units")
    root = states[0]
    if root.unit is None:
        root._init_tree(root)
    return list(dict.fromkeys(states))


def sharded_layout(model: nn.Module) -> list[ParamShard]:
    """Every original parameter's shard on this rank, in unit order then layout order."""
    out: list[ParamShard] = []
    for state in _fsdp_states(model):
        unit = state.unit
        rep = unit.ctx.replicate
        for g in unit.groups:
            flat = g.flat
            for slot, fqn in zip(flat.layout.slots, flat.fqns):
                if slot.shard_dim:
                    raise ValueError(
                        f"parameter {fqn} is sharded on dim {slot.shard_dim} "
                        "(shard_placement_fn); this layout (fsdp-ckpt, HF export) describes "
                        "dim-0 shards only: save it with torch.distributed.checkpoint")
                start, pstart, length = flat.layout.local_piece(slot, flat.shard_index)
                out.append(ParamShard(
                    fqn, slot.shape, flat.dtype, pstart, length,
                    flat.local_shard[start:start + length], state.fqn, flat.shard_index,
                    flat.layout.shard_count, 0 if rep is None else rep.rank))
    return out


def gather_full(unit: object, flat: object) -> torch.Tensor:
    """All-gather ``flat``'s shards into a new parameter-major buffer (collective)."""
    layout = flat.layout
    device = unit.ctx.device
    gathered = torch.empty(layout.padded_numel, dtype=flat.dtype, device=device)
    unit.ctx.shard.all_gather_into_tensor(gathered, flat.local_shard.to(device))
    if layout.is_identity:
        return gathered
    full = torch.empty_like(gathered)
    layout.to_param_major(gathered, full)
    return full


def full_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full values of every parameter by FQN (CPU copies), gathered one unit at a time.

    Collective: every rank calls it. Shared parameters appear under their first FQN.
    """
    result: dict[str, torch.Tensor] = {}
    for state in _fsdp_states(model):
        unit = state.unit
        for g in unit.groups:
            flat = g.flat
            full = gather_full(unit, flat)
            for slot, fqn in zip(flat.layout.slots, flat.fqns):
                value = flat.layout.full_view(full, slot)
                result[fqn] = value.detach().to("cpu", copy=True)
    return result


def model_backend(model: nn.Module) -> object:
    """The backend spanning every rank of a sharded model (its root unit's world), for
    collectives over the whole model, such as a checkpoint's agreement. Initialises the model
    if its first forward has not run yet."""
    return _fsdp_states(model)[0].unit.ctx.world
