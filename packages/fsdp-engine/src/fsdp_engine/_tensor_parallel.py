"""`TensorParallel`: a parameter that was already a DTensor on another mesh when `fully_shard`
saw it (tensor parallelism's ``parallelize_module``), and what the unit does with it.

Note [flat buffer on a 2-D mesh]
    With a (dp, tp) mesh, tensor parallelism has already cut every parameter it manages:
    rank (d, t) holds the tp piece ``P_t`` (a DTensor's local tensor, ``Shard(0)``,
    ``Shard(1)`` or ``Replicate()`` over tp). `fully_shard(mesh=dp_mesh)` then treats ``P_t``
    as the parameter: the unit's flat buffer on rank (d, t) holds the dim-0 chunk ``d`` of
    each ``P_t`` (``ceil(rows(P_t) / dp)`` rows, Note [rank-major layout]), and the unit's
    all-gather and reduce-scatter run over the dp group of its tp coordinate only: still one
    of each per unit, now ``1/tp`` of the bytes. So a unit of ``N`` parameters stores
    ``N / (dp * tp)`` elements per rank (plus padding), gathers ``N / tp`` and computes on
    the tp pieces as tensor parallelism would without FSDP.

    What callers see is FSDP2's: each parameter is one DTensor on the concatenated mesh
    (``DeviceMesh._concatenate([dp_mesh, tp_mesh])``, dims ``("dp", "tp")``) with the
    parameter's global shape and placements ``(dp placement, *tp placements)``. The dp
    placement is ``Shard(0)``, except where tp also shards dim 0 (column-parallel weights):
    the rows rank (d, t) holds are then chunk ``d`` of tp piece ``t``, which is
    ``_StridedShard(0, split_factor=tp)``: e.g. rows 0-3 of a (16, k) weight at (dp 2, tp 2)
    sit on rank (0, 0), rows 4-7 on (1, 0), rows 8-11 on (0, 1). On a hybrid mesh a
    ``Replicate()`` comes first. Optimizers, ``state_dict``, DCP, ``full_tensor()`` and
    torch's ``clip_grad_norm_`` read that.

    Inside forward the module sees its tp piece as tensor parallelism made it: a view of
    the gathered buffer wrapped by ``DTensor.from_local`` on the tp mesh with the tp
    placements, so tensor-parallel ops, sequence parallelism and loss parallelism run
    unchanged. ``from_local``'s backward redistributes a gradient that comes back in
    another placement (``Partial`` under sequence parallelism) to the parameter's own
    before it reaches the unit, as FSDP2 does with ``redistribute``.

    The gradient norm (`clip_grad_norm_`) sums this rank's squares over the dp group, then
    over the tp group for parameters tp shards; a parameter tp replicates is counted once.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = ["TensorParallel", "tensor_parallel_of", "wrap_tp_views", "spmd_mesh"]

# Concatenated meshes by (dp mesh, tp mesh): DTensors compare meshes by value, but building
# one is not free.
_SPMD: dict[tuple[int, int], Any] = {}


@dataclass(frozen=True, eq=False)
class TensorParallel:
    """A parameter's tensor-parallel DTensor layout: the mesh, placements, global shape and
    stride it had when `fully_shard` found it."""

    mesh: Any
    placements: tuple[Any, ...]
    shape: torch.Size
    stride: tuple[int, ...]
    _specs: dict[Any, Any] = field(default_factory=dict, repr=False)

    def split_factor(self, dim: int) -> int:
        """How many tp pieces dimension ``dim`` is cut into (``_StridedShard``'s split
        factor when the dp shards cut the same dimension)."""
        from torch.distributed.tensor import Shard

        n = 1
        for i, p in enumerate(self.placements):
            if isinstance(p, Shard) and p.dim % len(self.shape) == dim:
                n *= self.mesh.size(i)
        return n

    @functools.cached_property
    def norm_group(self) -> Any:
        """The process group a gradient norm's partial sum goes over after the dp group
        (None: tp replicates this parameter, every tp rank holds all of it)."""
        from torch.distributed.tensor import Shard

        if not any(isinstance(p, Shard) for p in self.placements):
            return None
        return self.mesh.get_group()

    def spmd_spec(self, dp_mesh: Any, hybrid: bool, dtype: torch.dtype, dim: int) -> Any:
        """The DTensorSpec of the sharded parameter on the (dp..., tp) mesh (Note [flat
        buffer on a 2-D mesh])."""
        key = (id(dp_mesh), hybrid, dtype, dim)
        spec = self._specs.get(key)
        if spec is None:
            from torch.distributed.tensor import Replicate, Shard
            from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
            from torch.distributed.tensor.placement_types import _StridedShard

            sf = self.split_factor(dim)
            dp: tuple[Any, ...] = (_StridedShard(dim, split_factor=sf) if sf > 1
                                   else Shard(dim),)
            if hybrid:
                dp = (Replicate(), *dp)
            spec = self._specs[key] = DTensorSpec(
                spmd_mesh(dp_mesh, self.mesh), (*dp, *self.placements),
                TensorMeta(self.shape, self.stride, dtype))
        return spec

    def wrap(self, local: torch.Tensor) -> torch.Tensor:
        """The tp piece the module computes with: ``local`` on the tp mesh, differentiable."""
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(local, self.mesh, self.placements, run_check=False,
                                  shape=self.shape, stride=self.stride)


def tensor_parallel_of(param: torch.Tensor, fqn: str, unit_name: str) -> TensorParallel | None:
    """The layout of a parameter tensor parallelism made (a DTensor this engine did not make),
    or None for a plain parameter."""
    from torch.distributed.tensor import DTensor

    if not isinstance(param, DTensor) or getattr(param, "_fsdp_flat", None) is not None:
        return None
    mesh = param.device_mesh
    if mesh.ndim != 1:
        raise NotImplementedError(
            f"fully_shard({unit_name}): parameter {fqn} is a DTensor on a {mesh.ndim}-D mesh "
            f"{mesh} ({param.placements}); fully_shard composes with 1-D tensor parallelism")
    if mesh.mesh_dim_names is None:
        raise ValueError(
            f"fully_shard({unit_name}): parameter {fqn} is a DTensor on a mesh without "
            "mesh_dim_names; tensor parallelism with FSDP needs named mesh dims "
            "(init_device_mesh(..., mesh_dim_names=('dp', 'tp')))")
    return TensorParallel(mesh, tuple(param.placements), param.shape, param.stride())


def spmd_mesh(dp_mesh: Any, tp_mesh: Any) -> Any:
    """The mesh of the sharded DTensors: the dp mesh's dims, then the tp mesh's."""
    key = (id(dp_mesh), id(tp_mesh))
    mesh = _SPMD.get(key)
    if mesh is None:
        from torch.distributed.device_mesh import DeviceMesh

        mesh = _SPMD[key] = DeviceMesh._concatenate([dp_mesh, tp_mesh])
    return mesh


def check_tp_mesh(dp_mesh: Any, tps: list[TensorParallel | None], unit_name: str) -> None:
    """Tensor-parallel parameters need the data-parallel DeviceMesh of the same root mesh."""
    first = next((tp for tp in tps if tp is not None), None)
    if first is None:
        return
    if dp_mesh is None or dp_mesh.mesh_dim_names is None:
        raise ValueError(
            f"fully_shard({unit_name}): its parameters are tensor-parallel DTensors on "
            f"{first.mesh}; mesh must be the data-parallel DeviceMesh of the same root mesh "
            "(world_mesh['dp'], or world_mesh['replicate', 'shard'] for hybrid sharding), "
            f"got {dp_mesh!r}")
    for tp in tps:
        if tp is None:
            continue
        try:
            spmd_mesh(dp_mesh, tp.mesh)
        except RuntimeError as exc:
            raise ValueError(
                f"fully_shard({unit_name}): the data-parallel mesh {dp_mesh} and the "
                f"tensor-parallel mesh {tp.mesh} must be distinct dims of one root mesh: "
                f"{exc}") from exc


def wrap_tp_views(tps: tuple[TensorParallel | None, ...], views: list[torch.Tensor]
                  ) -> list[torch.Tensor]:
    """``views`` with each tensor-parallel parameter's view wrapped as its tp DTensor."""
    return [v if tp is None else tp.wrap(v) for v, tp in zip(views, tps)]


def tp_parameter(tp: TensorParallel, local: torch.Tensor, requires_grad: bool) -> nn.Parameter:
    """A registered unsharded parameter (``unshard()``) of a tensor-parallel slot."""
    from torch.distributed.tensor import DTensor

    return nn.Parameter(DTensor.from_local(local, tp.mesh, tp.placements, run_check=False,
                                           shape=tp.shape, stride=tp.stride),
                        requires_grad=requires_grad)
