"""The sharded layout that fsdp-ckpt reads, and gathering full parameters from it.

`sharded_layout(model)` lists, for every original parameter, its FQN, global shape and dtype,
and the n-D box of it this rank holds (per-dimension ``offsets`` and ``sizes``) together with
the local tensor holding it (a 1-D view of the unit's local shard, the box in row-major order:
writing into it changes the model). `full_parameters(model)` all-gathers every unit and returns
full CPU copies; `model_backend(model)` is the backend spanning every rank of the model.

Note [boxes of a 2-D mesh]
    What a rank holds of a parameter of global shape ``G`` is always a box: per dimension
    ``i`` an offset ``o[i]`` and a size ``s[i]``, stored contiguously in row-major order.

    - Tensor parallelism first cuts the tp piece (Note [flat buffer on a 2-D mesh] in
      ``_tensor_parallel.py``), starting from ``o = 0``, ``s = G``: for each model-parallel
      mesh dim in order (the tp mesh's one dim; an SPMD mesh's dims outside
      ``dp_mesh_dims``, Note [SPMD mesh]) of ``T`` ranks where this rank is ``t``,
      ``Replicate()`` keeps the box and ``Shard(k)`` takes ``torch.chunk``'s piece ``t``
      along ``k``: with ``n = s[k]`` and ``c = ceil(n / T)``, ``o[k] += min(t * c, n)`` and
      ``s[k] = max(0, min(c, n - t * c))``. A plain parameter is its own piece. The sizes
      must equal the local tensor's shape the unit laid out, or this raises rather than
      guess.
    - The unit's flat buffer then holds dp chunk ``d`` of that piece along the shard
      dimension ``k'`` (0, or ``shard_placement_fn``'s): ``r = ceil(s[k'] / dp)`` rows per
      rank, so ``o[k'] += min(d * r, s[k'])`` and ``s[k'] = max(0, min(r, s[k'] - d * r))``.

    E.g. a (10, 6) column-parallel weight at (dp 2, tp 2): tp pieces are rows 0-4 and 5-9;
    rank (d 1, t 0) holds rows 3-4 (``o = (3, 0)``, ``s = (2, 6)``). A (6, 10) row-parallel
    weight: rank (d 0, t 1) holds ``o = (0, 5)``, ``s = (3, 5)``, which is not a contiguous
    slice of the flattened parameter: `ParamShard.flat_start` raises for it, so a reader of
    flat slices (fsdp-ckpt 0.1, Hugging Face loading) fails loudly instead of misplacing it.

    Ranks holding the same box are replicas; ``replicate_rank`` numbers them, and exactly one
    (``replicate_rank == 0``) should write it: ``h * R + r``, with ``h`` the hybrid replica
    index, ``R`` the number of ranks of the model-parallel dims that replicate the parameter
    (``Replicate()`` there) and ``r`` this rank's coordinate over them (flattened). A plain
    parameter of a model with tensor parallelism (an un-parallelised LayerNorm) is replicated
    over the tp mesh: every tp rank keeps a whole copy of it, which is why FSDP2's DCP saves
    deduplicate across tp ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from ._flat_param import FlatParameter
    from ._unit import FSDPUnit

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
    tp_rank: int = 0  # coordinate over the model-parallel (tp) mesh dims, flattened
    tp_size: int = 1  # ranks of those dims (1 without tp)

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
                "cut another dimension); read ParamShard.offsets and .sizes instead"
            )
        return start


def _flat_start(
    shape: tuple[int, ...], offsets: tuple[int, ...], sizes: tuple[int, ...]
) -> int | None:
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


def _fsdp_states(model: nn.Module) -> list[Any]:
    # FSDPStates whose ``unit`` the callers use unchecked: set for every state once the tree
    # is initialised. An early ``unshard()`` (before any forward) builds one unit under a
    # provisional root; the tree is built here then, as the first forward would (it used to
    # be skipped, and the other units' ``unit`` was None).
    states: list[Any] = [m._fsdp_state for m in model.modules() if getattr(m, "_fsdp_state", None)]
    if not states:
        raise ValueError("model has no fully_shard units")
    root = states[0]
    if root.unit is None or (root.root is not None and root.root.provisional):
        root._init_tree(root)
    return list(dict.fromkeys(states))


def _model_parallel_dims(tp: Any) -> list[int]:
    """The mesh dims of a tp layout that are not data-parallel (all of a tp mesh's; those
    of an SPMD mesh outside ``dp_mesh_dims``: Note [SPMD mesh] in ``_tensor_parallel.py``)."""
    dp = tp.spmd.dp if getattr(tp, "spmd", None) is not None else frozenset()
    return [i for i in range(tp.mesh.ndim) if i not in dp]


def _tp_piece(slot: Any, fqn: str) -> tuple[list[int], list[int], int, int, int]:
    """(offsets, sizes) of ``slot``'s tp piece in the parameter, this rank's coordinate over
    the model-parallel mesh dims (flattened) and, over those of them that replicate the
    parameter, its index and their size (Note [boxes of a 2-D mesh])."""
    from torch.distributed.tensor import Replicate, Shard

    tp = slot.tp
    shape = list(tp.shape)
    offsets, sizes = [0] * len(shape), list(shape)
    coord = tp.mesh.get_coordinate()
    mp_rank, rep_rank, rep_size = 0, 0, 1
    for i in _model_parallel_dims(tp):
        placement, parts, t = tp.placements[i], tp.mesh.size(i), coord[i]
        mp_rank = mp_rank * parts + t
        if type(placement) is Shard:  # not _StridedShard, a subclass: torch.chunk, in turn
            k = placement.dim % len(shape)
            n = sizes[k]
            c = -(-n // parts)
            offsets[k] += min(t * c, n)
            sizes[k] = max(0, min(c, n - t * c))
        elif type(placement) is Replicate:
            rep_rank, rep_size = rep_rank * parts + t, rep_size * parts
        else:
            raise ValueError(
                f"parameter {fqn}: placement {placement} on mesh dim {i} of "
                f"{tp.mesh}: the layout describes Shard(k) and Replicate() pieces "
                "only"
            )
    if tuple(sizes) != tuple(slot.shape):
        raise ValueError(
            f"parameter {fqn}: its local piece of shape {tuple(slot.shape)} is "
            f"not torch.chunk's piece {tuple(sizes)} of {tuple(shape)} over "
            f"{tp.placements}; cannot say which elements it holds"
        )
    return offsets, sizes, mp_rank, rep_rank, rep_size


def _model_tp_mesh(states: list[Any]) -> Any:
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
                        "mesh per model"
                    )
    return None if found is None else found[0]


def _plain_replicas(tp_mesh: Any, fqn: str) -> tuple[int, int]:
    """(index, count) of this rank among the tp ranks holding a plain parameter whole."""
    if tp_mesh is None:
        return 0, 1
    if tp_mesh.ndim != 1:
        raise ValueError(
            f"parameter {fqn} is a plain tensor in a model whose other parameters "
            f"are DTensors on {tp_mesh}: cannot tell which ranks hold copies of it"
        )
    return tp_mesh.get_local_rank(), tp_mesh.size()


def sharded_layout(model: nn.Module) -> list[ParamShard]:
    """Every original parameter's box on this rank, in unit order then layout order."""
    out: list[ParamShard] = []
    states = _fsdp_states(model)
    tp_mesh = _model_tp_mesh(states)
    for state in states:
        unit = state.unit
        rep = unit.ctx.replicate
        # A fault-tolerant replicate dimension (fsdp_comm.FaultTolerantReplicate, issue #31):
        # each replica group is a world of its own and saves a whole copy of its own, so every
        # group is replica 0 to a checkpoint (its rank is only its place in this step's quorum).
        hybrid = 0 if rep is None or getattr(rep, "fault_tolerant", False) else rep.rank
        for g in unit.groups:
            flat = g.flat
            for slot, fqn in zip(flat.layout.slots, flat.fqns):
                if slot.tp is None:  # plain: every tp rank of a tp model holds it whole
                    offsets, sizes = [0] * len(slot.shape), list(slot.shape)
                    rep_rank, rep_size = _plain_replicas(tp_mesh, fqn)
                    mp_rank, mp_size = rep_rank, rep_size
                else:
                    offsets, sizes, mp_rank, rep_rank, rep_size = _tp_piece(slot, fqn)
                    mp_size = math.prod(slot.tp.mesh.size(i) for i in _model_parallel_dims(slot.tp))
                k, idx = slot.shard_dim, flat.shard_index
                offsets[k] += min(idx * slot.chunk_rows, sizes[k])
                sizes[k] = slot.local_rows(idx)
                n = math.prod(sizes)
                start = slot.local_offset if n else 0
                out.append(
                    ParamShard(
                        fqn,
                        slot.global_shape,
                        flat.dtype,
                        tuple(offsets),
                        tuple(sizes),
                        flat.local_shard[start : start + n],
                        state.fqn,
                        idx,
                        flat.layout.shard_count,
                        hybrid * rep_size + rep_rank,
                        mp_rank,
                        mp_size,
                    )
                )
    return out


def gather_full(unit: FSDPUnit, flat: FlatParameter) -> torch.Tensor:
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
