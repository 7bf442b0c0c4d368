"""The sharded layout that fsdp-ckpt reads, and gathering full parameters from it.

`sharded_layout(model)` lists, for every original parameter, its FQN, global shape and dtype,
and the n-D box of it this rank holds (per-dimension ``offsets`` and ``sizes``) together with
the local tensor holding it (a 1-D view of the unit's local shard, the box in row-major order:
writing into it changes the model). `full_parameters(model)` all-gathers every unit and returns
full CPU copies; `model_backend(model)` is the backend spanning every rank of the model.

Note [boxes of a 2-D mesh]
    What a rank holds of a parameter of global shape ``G`` is always a box: per dimension
    ``i`` an offset ``o[i]`` and a size ``s[i]``, stored contiguously in row-major order.

    - Tensor parallelism first cuts the tp piece of tp rank ``t`` of ``T`` (Note [flat buffer
      on a 2-D mesh] in ``_tensor_parallel.py``). ``Replicate()``: the whole parameter,
      ``o = 0``, ``s = G``. ``Shard(k)``: ``torch.chunk`` along ``k``: with
      ``c = ceil(G[k] / T)``, ``o[k] = min(t * c, G[k])`` and ``s[k] = max(0, min(c, G[k] -
      t * c))``, the other dimensions whole. A plain parameter is its own piece (``o = 0``,
      ``s = G``). The sizes must equal the local tensor's shape the unit laid out, or this
      raises rather than guess.
    - The unit's flat buffer then holds dp chunk ``d`` of that piece along the shard
      dimension ``k'`` (0, or ``shard_placement_fn``'s): ``r = ceil(s[k'] / dp)`` rows per
      rank, so ``o[k'] += min(d * r, s[k'])`` and ``s[k'] = max(0, min(r, s[k'] - d * r))``.

    E.g. a (10, 6) column-parallel weight at (dp 2, tp 2): tp pieces are rows 0-4 and 5-9;
    rank (d 1, t 0) holds rows 3-4 (``o = (3, 0)``, ``s = (2, 6)``). A (6, 10) row-parallel
    weight: rank (d 0, t 1) holds ``o = (0, 5)``, ``s = (3, 5)``, which is not a contiguous
    slice of the flattened parameter: `ParamShard.flat_start` raises for it, so a reader of
    flat slices (fsdp-ckpt 0.1, Hugging Face loading) fails loudly instead of misplacing it.

    Ranks holding the same box are replicas; ``replicate_rank`` numbers them, and exactly one
    (``replicate_rank == 0``) should write it: the hybrid replica index ``h``, times the tp
    size ``T`` when tp replicates the parameter, plus the tp coordinate ``t`` then
    (``h * T + t``). A parameter tp replicates is one with ``Replicate()`` over tp, or a plain
    parameter of a model with tensor parallelism (an un-parallelised LayerNorm): every tp rank
    keeps a whole copy of it, which is why FSDP2's DCP saves deduplicate across tp ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["ParamShard", "sharded_layout", "full_parameters", "model_backend"]


@dataclass(frozen=True)
class ParamShard:
    """One original parameter as this rank holds it: the box ``offsets``/``sizes`` of its
    global shape (Note [boxes of a 2-D mesh])."""

    fqn: str
    global_shape: torch.Size  # the parameter's shape as users see it (tp DTensors' included)
    dtype: torch.dtype
    offsets: tuple[int, ...]  # per dimension, the first index held here
    sizes: tuple[int, ...]  # per dimension, the extent held here (a 0 means nothing)
    local: torch.Tensor  # 1-D view of the unit's local shard: the box in row-major order
    unit_fqn: str
    shard_rank: int
    shard_count: int
    replicate_rank: int  # 0: this rank's copy of the box is the one to write
    tp_rank: int = 0  # coordinate on the tensor-parallel mesh (0 without tp)
    tp_size: int = 1

    @property
    def length(self) -> int:
        """Elements held here (0 when none)."""
        return math.prod(self.sizes)

    @property
    def is_flat(self) -> bool:
        """Whether the box is one contiguous slice of the flattened parameter (always true
        without tensor parallelism and with dim-0 shards)."""
        return _flat_start(self.global_shape, self.offsets, self.sizes) is not None

    @property
    def flat_start(self) -> int:
        """First element held, in the flattened parameter. ValueError when the box is not a
        contiguous slice of it (a tp piece cut on another dimension): read offsets/sizes."""
        start = _flat_start(self.global_shape, self.offsets, self.sizes)
        if start is None:
            raise ValueError(
                f"parameter {self.fqn}: this rank holds the box offsets {self.offsets}, sizes "
                f"{self.sizes} of shape {tuple(self.global_shape)}, which is not a contiguous "
                "slice of the flattened parameter (tensor parallelism or shard_placement_fn "
                "cut another dimension); read ParamShard.offsets and .sizes instead")
        return start


def _flat_start(shape: tuple[int, ...], offsets: tuple[int, ...],
                sizes: tuple[int, ...]) -> int | None:
    """The box's first element in the flattened tensor when the box is contiguous there
    (dimensions of size 1, then one partial dimension, then whole ones); else None."""
    if math.prod(sizes) == 0:
        return 0
    partial = [d for d in range(len(shape)) if sizes[d] != shape[d]]
    if partial and any(sizes[d] != 1 for d in range(partial[-1])):
        return None  # a dimension before the last partial one holds more than one index
    start, stride = 0, 1
    for d in reversed(range(len(shape))):
        start += offsets[d] * stride
        stride *= shape[d]
    return start


def _fsdp_states(model: nn.Module) -> list:
    states = [m._fsdp_state for m in model.modules() if getattr(m, "_fsdp_state", None)]
    if not states:
        raise ValueError("model has no fully_shard units")
    root = states[0]
    if root.unit is None:
        root._init_tree(root)
    return list(dict.fromkeys(states))


def _tp_piece(slot: Any, fqn: str) -> tuple[list[int], list[int], int, bool]:
    """(offsets, sizes) of ``slot``'s tp piece in the parameter, this rank's tp coordinate,
    and whether tp replicates the parameter (Note [boxes of a 2-D mesh])."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    tp = slot.tp
    shape = list(tp.shape)
    offsets, sizes = [0] * len(shape), list(shape)
    t = tp.mesh.get_local_rank()
    placement = tp.placements[0]
    if type(placement) is Shard:  # not _StridedShard, a subclass
        k = placement.dim % len(shape)
        n, parts = shape[k], tp.mesh.size()
        c = -(-n // parts)
        offsets[k], sizes[k] = min(t * c, n), max(0, min(c, n - t * c))
    elif not isinstance(placement, Replicate) or isinstance(placement, _StridedShard):
        raise ValueError(f"parameter {fqn}: tensor-parallel placement {placement} over "
                         f"{tp.mesh}: the layout describes Shard(k) and Replicate() pieces only")
    if tuple(sizes) != tuple(slot.shape):
        raise ValueError(f"parameter {fqn}: tp piece {t} of shape {tuple(slot.shape)} is not "
                         f"torch.chunk's piece {tuple(sizes)} of {tuple(shape)} over "
                         f"{placement}; cannot say which elements it holds")
    return offsets, sizes, t, isinstance(placement, Replicate)


def _model_tp_mesh(states: list) -> Any:
    """The one tensor-parallel mesh of the model's parameters (None without tp)."""
    found = None
    for state in states:
        for g in state.unit.groups:
            for slot, fqn in zip(g.flat.layout.slots, g.flat.fqns):
                if slot.tp is None:
                    continue
                if found is None:
                    found = (slot.tp.mesh, fqn)
                elif slot.tp.mesh != found[0]:
                    raise ValueError(
                        f"parameters {found[1]} and {fqn} are tensor-parallel over different "
                        f"meshes ({found[0]} and {slot.tp.mesh}); the layout describes one tp "
                        "mesh per model")
    return None if found is None else found[0]


def sharded_layout(model: nn.Module) -> list[ParamShard]:
    """Every original parameter's box on this rank, in unit order then layout order."""
    out: list[ParamShard] = []
    states = _fsdp_states(model)
    tp_mesh = _model_tp_mesh(states)
    tp_rank = 0 if tp_mesh is None else tp_mesh.get_local_rank()
    tp_size = 1 if tp_mesh is None else tp_mesh.size()
    for state in states:
        unit = state.unit
        rep = unit.ctx.replicate
        hybrid = 0 if rep is None else rep.rank
        for g in unit.groups:
            flat = g.flat
            for slot, fqn in zip(flat.layout.slots, flat.fqns):
                if slot.tp is None:  # plain: replicated over tp in a tp model
                    offsets, sizes, replicated = [0] * len(slot.shape), list(slot.shape), True
                else:
                    offsets, sizes, _, replicated = _tp_piece(slot, fqn)
                k, idx = slot.shard_dim, flat.shard_index
                rows = slot.local_rows(idx)
                offsets[k] += min(idx * slot.chunk_rows, sizes[k])
                sizes[k] = rows
                n = math.prod(sizes)
                start = slot.local_offset if n else 0
                rank = hybrid * tp_size + tp_rank if replicated else hybrid
                out.append(ParamShard(
                    fqn, slot.global_shape, flat.dtype, tuple(offsets), tuple(sizes),
                    flat.local_shard[start:start + n], state.fqn, idx,
                    flat.layout.shard_count, rank, tp_rank, tp_size))
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
    """Full values of every parameter by FQN (CPU copies), gathered one unit at a time
    (a tensor-parallel parameter then over its tp group too).

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
                if slot.tp is not None:
                    with torch.no_grad():
                        value = slot.tp.wrap(value).full_tensor()
                result[fqn] = value.detach().to("cpu", copy=True)
    return result


# World backends of tensor-parallel models, by the (dp..., tp) mesh (kept alive here).
_SPMD_WORLDS: dict[int, tuple[Any, Any]] = {}


def model_backend(model: nn.Module) -> object:
    """The backend spanning every rank of a sharded model (its root unit's world; with
    tensor parallelism, the ranks of its (dp..., tp) mesh), for collectives over the whole
    model, such as a checkpoint's agreement. Initialises the model if its first forward has
    not run yet."""
    states = _fsdp_states(model)
    for state in states:
        for g in state.unit.groups:
            for slot, param in zip(g.flat.layout.slots, g.flat.params):
                if slot.tp is not None:
                    return _spmd_world(param.device_mesh, state.unit.ctx.device)
    return states[0].unit.ctx.world


def _spmd_world(mesh: Any, device: torch.device) -> Any:
    found = _SPMD_WORLDS.get(id(mesh))
    if found is None or found[0] is not mesh:
        from ._mesh_resolve import _world_of

        found = _SPMD_WORLDS[id(mesh)] = (mesh, _world_of(mesh, device))
    return found[1]
