"""`ShardSpec`: how a unit's sharded parameters look to callers: DTensors on a torch
`DeviceMesh`, sharded on dim 0 (``Shard(0)``, or ``(Replicate(), Shard(0))`` on a hybrid
mesh), with their original global shape: what FSDP2 gives, so that ``model.state_dict()``,
torch.distributed.checkpoint, ``clip_grad_norm_`` and optimizers see what they expect.

The DTensor is metadata over a local tensor that is a view of the unit's flat shard
(Note [rank-major layout] in ``_flat_param.py``); nothing here communicates. On backends
without a torch process group (``threads``, ``fake``, ``cupy-nccl``) the mesh is built
without one: local DTensor operations (optimizer steps) work, operations that would
communicate through the mesh (``full_tensor()``) do not.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["ShardSpec", "device_mesh_for"]

# DeviceMeshes built for backends, by shard backend: (the replicate backend, weakly, or None;
# the mesh). Keyed by both: over one world backend, a 1-D mesh (it is the shard group) and a
# (world, 1) mesh (it is the replicate group: NO_SHARD) are different meshes; keyed by one
# backend, a NO_SHARD model built after a sharded one got the 1-D mesh for its 2-D
# placements, and its optimizer step failed in DTensor's sharding propagation.
_MESHES: weakref.WeakKeyDictionary[Any, list[tuple[Any, DeviceMesh]]] = weakref.WeakKeyDictionary()


@dataclass(eq=False)
class ShardSpec:
    """The mesh and placements of one unit's parameters."""

    mesh: DeviceMesh
    hybrid: bool
    _specs: dict[tuple[torch.Size, torch.dtype, int], DTensorSpec] = field(default_factory=dict)

    @functools.cached_property
    def placements(self) -> tuple[Any, ...]:
        return self.placements_for(0)

    def placements_for(self, dim: int) -> tuple[Any, ...]:
        return (Replicate(), Shard(dim)) if self.hybrid else (Shard(dim),)

    def _spec(self, shape: torch.Size, dtype: torch.dtype, dim: int = 0) -> DTensorSpec:
        key = (shape, dtype, dim)
        spec = self._specs.get(key)
        if spec is None:
            stride = torch.empty(shape, device="meta").stride()
            spec = self._specs[key] = DTensorSpec(
                self.mesh, self.placements_for(dim), TensorMeta(shape, stride, dtype)
            )
        return spec

    def dtensor(self, local: torch.Tensor, slot: Any) -> DTensor:
        """A DTensor of ``slot``'s global shape over ``local`` (no copy, no communication);
        on the (dp, tp) mesh for a tensor-parallel slot (Note [flat buffer on a 2-D mesh])."""
        tp = slot.tp
        # torch leaves DTensor.__init__ unannotated.
        if tp is not None:
            return DTensor(  # type: ignore[no-untyped-call]
                local,
                tp.spmd_spec(self.mesh, self.hybrid, local.dtype, slot.shard_dim),
                requires_grad=False,
            )
        return DTensor(  # type: ignore[no-untyped-call]
            local, self._spec(slot.shape, local.dtype, slot.shard_dim), requires_grad=False
        )

    def parameter(self, local: torch.Tensor, slot: Any, requires_grad: bool) -> nn.Parameter:
        return nn.Parameter(self.dtensor(local, slot), requires_grad=requires_grad)


def device_mesh_for(
    shard: Any, replicate: Any | None, world: Any, given: DeviceMesh | None = None
) -> ShardSpec:
    """The DeviceMesh of a unit's backends (``given`` when the user passed one)."""
    hybrid = replicate is not None or (given is not None and given.ndim == 2)
    if given is not None:
        return ShardSpec(given, hybrid)
    return ShardSpec(_cached_mesh(shard, replicate, world), hybrid)


def _cached_mesh(shard: Any, replicate: Any | None, world: Any) -> DeviceMesh:
    built = _MESHES.setdefault(shard, [])
    for ref, mesh in built:
        if ref is None if replicate is None else (ref is not None and ref() is replicate):
            return mesh
    mesh = _build_mesh(shard, replicate, world)
    built.append((None if replicate is None else weakref.ref(replicate), mesh))
    return mesh


def _build_mesh(shard: Any, replicate: Any | None, world: Any) -> DeviceMesh:
    device_type = shard.device.type
    groups = [getattr(b, "process_group", None) for b in (replicate, shard) if b is not None]
    if all(g is not None for g in groups):
        pgs = cast("list[ProcessGroup]", groups)  # none is None: checked just above
        ranks = _global_ranks(shard, replicate)
        if replicate is None:
            return DeviceMesh.from_group(pgs[0], device_type)
        return DeviceMesh.from_group(
            pgs, device_type, mesh=ranks, mesh_dim_names=("replicate", "shard")
        )
    # No torch process group behind the backend: a mesh for local DTensor operations only.
    size = shard.world_size * (1 if replicate is None else replicate.world_size)
    ranks = torch.arange(size, dtype=torch.int)
    if replicate is not None:
        ranks = ranks.view(replicate.world_size, shard.world_size)
    rank = world.rank if replicate is not None else shard.rank
    return DeviceMesh(device_type, ranks, _init_backend=False, _rank=rank)


def _global_ranks(shard: Any, replicate: Any | None) -> torch.Tensor:
    """Global ranks laid out (replicate, shard): shard groups are rows."""
    import torch.distributed as dist

    mine = torch.tensor(dist.get_process_group_ranks(shard.process_group), dtype=torch.int)
    if replicate is None:
        return mine
    rows = torch.empty(replicate.world_size, shard.world_size, dtype=torch.int)
    gathered = [torch.zeros_like(mine) for _ in range(replicate.world_size)]
    dist.all_gather(gathered, mine, group=replicate.process_group)
    for i, row in enumerate(gathered):
        rows[i] = row
    return rows
