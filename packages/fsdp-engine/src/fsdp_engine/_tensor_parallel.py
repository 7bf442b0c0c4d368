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

Note [SPMD mesh]
    FSDP2's other spelling (torch 2.13): ``fully_shard(model, mesh=M,
    dp_mesh_dims=DataParallelMeshDims(shard=..., replicate=...))`` where the parameters are
    already DTensors on the whole mesh ``M`` (``distribute_module``), ``Replicate()`` on its
    data-parallel dims. The arithmetic is the one above with the tp piece being the local
    tensor on ``M``: the unit communicates over ``M``'s shard dims (flattened when several)
    and replicate dims (hybrid sharding; ``(replicate, 1)`` when only replicating), and a
    sharded parameter keeps ``M`` and its placements with the shard dim's ``Replicate()``
    turned into ``Shard(d)`` (``_StridedShard`` when a model-parallel dim after it cuts
    ``d``); several shard dims become one flattened dim of the DTensor's mesh, as in FSDP2.
    The module computes with DTensors of the layout it was given; in backward a gradient is
    redistributed on the model-parallel dims only, its data-parallel dims being what the
    unit's reduce-scatter sums (FSDP2 skips them too). Every parameter must be a DTensor on
    ``M`` itself, ``Replicate()`` on the data-parallel dims, and ``reshard_after_forward``
    cannot be an int: FSDP2's rules and words.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = [
    "SpmdDims",
    "TensorParallel",
    "tensor_parallel_of",
    "wrap_tp_views",
    "spmd_mesh",
    "resolve_spmd",
]

# Concatenated meshes by (dp mesh, tp mesh): DTensors compare meshes by value, but building
# one is not free. Keyed by id, so each entry keeps its key meshes and a hit checks them (an
# id is reused once its mesh is gone).
_SPMD: dict[tuple[int, int], tuple[Any, Any, Any]] = {}
# Replication-only SPMD meshes' (replicate, 1) data-parallel meshes, by replicate mesh.
_DDP_MESHES: dict[int, tuple[Any, Any]] = {}


@dataclass(frozen=True, eq=False)
class SpmdDims:
    """``fully_shard(mesh=M, dp_mesh_dims=...)`` (FSDP2's SPMD mesh): the parameters are
    DTensors on ``M`` itself, ``Replicate()`` on its data-parallel dims. ``shard``/
    ``replicate``: indices of those dims in ``M``; ``flat_shard``: the flattened mesh of
    several shard dims (None for one)."""

    mesh: Any
    shard: tuple[int, ...]
    replicate: tuple[int, ...]
    flat_shard: Any = None

    @property
    def dp(self) -> frozenset[int]:
        return frozenset(self.shard + self.replicate)


@dataclass(frozen=True, eq=False)
class TensorParallel:
    """A parameter's DTensor layout when `fully_shard` found it: tensor parallelism's (the
    tp mesh), or the whole SPMD mesh's (``spmd``: Note [SPMD mesh])."""

    mesh: Any
    placements: tuple[Any, ...]
    shape: torch.Size
    stride: tuple[int, ...]
    spmd: SpmdDims | None = None
    _specs: dict[Any, Any] = field(default_factory=dict, repr=False)

    def split_factor(self, dim: int, after: int = -1) -> int:
        """How many model-parallel pieces dimension ``dim`` is cut into by the mesh dims
        after ``after`` that are not data-parallel (``_StridedShard``'s split factor when
        the dp shards cut the same dimension)."""
        from torch.distributed.tensor import Shard

        dp = self.spmd.dp if self.spmd is not None else frozenset()
        n = 1
        for i, p in enumerate(self.placements):
            if (
                i > after
                and i not in dp
                and isinstance(p, Shard)
                and p.dim % len(self.shape) == dim
            ):
                n *= self.mesh.size(i)
        return n

    @functools.cached_property
    def norm_group(self) -> Any:
        """The process group a gradient norm's partial sum goes over after the dp group
        (None: no model-parallel dim shards this parameter; each such rank holds all of
        it)."""
        from torch.distributed.tensor import Shard

        dp = self.spmd.dp if self.spmd is not None else frozenset()
        dims = [i for i, p in enumerate(self.placements) if i not in dp and isinstance(p, Shard)]
        if not dims:
            return None
        if self.mesh.ndim == 1:
            return self.mesh.get_group()
        names = tuple(self.mesh.mesh_dim_names[i] for i in dims)
        sub = self.mesh[names]
        return sub.get_group() if len(names) == 1 else sub._flatten().get_group()

    def spmd_spec(self, dp_mesh: Any, hybrid: bool, dtype: torch.dtype, dim: int) -> Any:
        """The DTensorSpec of the sharded parameter: on the (dp..., tp) mesh (Note [flat
        buffer on a 2-D mesh]), or on the SPMD mesh (Note [SPMD mesh])."""
        key = (id(dp_mesh), hybrid, dtype, dim)
        spec = self._specs.get(key)
        if spec is None:
            from torch.distributed.tensor import Replicate
            from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

            meta = TensorMeta(self.shape, self.stride, dtype)
            if self.spmd is not None:
                spec = self._spmd_mesh_spec(dim, meta)
            else:
                dp: tuple[Any, ...] = (self._dp_placement(dim, -1),)
                if hybrid:
                    dp = (Replicate(), *dp)
                spec = DTensorSpec(spmd_mesh(dp_mesh, self.mesh), (*dp, *self.placements), meta)
            self._specs[key] = spec
        return spec

    def _dp_placement(self, dim: int, at: int) -> Any:
        from torch.distributed.tensor import Shard
        from torch.distributed.tensor.placement_types import _StridedShard

        sf = self.split_factor(dim, at)
        return _StridedShard(dim, split_factor=sf) if sf > 1 else Shard(dim)

    def _spmd_mesh_spec(self, dim: int, meta: Any) -> Any:
        """FSDP2's placements on the SPMD mesh: the dp shard dim's ``Replicate()`` becomes
        ``Shard(dim)`` (``_StridedShard`` when model-parallel dims after it cut ``dim``);
        several shard dims are one flattened dim of the spec's mesh."""
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor._dtensor_spec import DTensorSpec

        spmd = self.spmd
        assert spmd is not None
        placements = list(self.placements)
        for i in spmd.shard:
            placements[i] = self._dp_placement(dim, i)
        if len(spmd.shard) <= 1:
            return DTensorSpec(self.mesh, tuple(placements), meta)
        names = self.mesh.mesh_dim_names
        meshes, out, done = [], [], False
        for i, name in enumerate(names):
            if i in spmd.shard:
                if not done:
                    meshes.append(spmd.flat_shard)
                    out.append(placements[i])
                    done = True
                continue
            meshes.append(self.mesh[name])
            out.append(placements[i])
        return DTensorSpec(DeviceMesh._concatenate(meshes), tuple(out), meta)

    def view_spec(self, dtype: torch.dtype) -> Any:
        """The DTensorSpec the module computes with: the layout `fully_shard` found."""
        spec = self._specs.get(dtype)
        if spec is None:
            from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

            spec = self._specs[dtype] = DTensorSpec(
                self.mesh, self.placements, TensorMeta(self.shape, self.stride, dtype)
            )
        return spec

    def grad_placements(self, got: tuple[Any, ...]) -> tuple[Any, ...]:
        """The placements a gradient must have before its local tensor is this rank's:
        the parameter's own on model-parallel dims (a ``Partial`` summed there), what it
        has on data-parallel dims (the unit's reduction sums those)."""
        from torch.distributed.tensor import Replicate

        dp = self.spmd.dp if self.spmd is not None else frozenset()
        return tuple(
            g if i in dp else (Replicate() if p.is_partial() else p)
            for i, (p, g) in enumerate(zip(self.placements, got))
        )

    def wrap(self, local: torch.Tensor) -> torch.Tensor:
        """The piece the module computes with, as the DTensor `fully_shard` found
        (differentiable: its gradient comes back as this rank's local gradient)."""
        return _ToDTensor.apply(local, self)  # type: ignore[no-untyped-call,no-any-return]


class _ToDTensor(torch.autograd.Function):
    """``local`` as a DTensor of the parameter's layout; in backward the gradient DTensor
    redistributed on the model-parallel dims (``DTensor.from_local``'s backward, except
    that data-parallel dims are left to the unit's reduction, as FSDP2 does)."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        ctx.tp = tp
        ctx.set_materialize_grads(False)
        return DTensor(  # type: ignore[no-untyped-call]  # DTensor.__init__ is unannotated
            local.view_as(local), tp.view_spec(local.dtype), requires_grad=local.requires_grad
        )

    @staticmethod
    def backward(ctx: Any, grad: Any) -> tuple[Any, None]:
        if grad is None:
            return None, None
        from torch.distributed.tensor import DTensor

        if not isinstance(grad, DTensor):
            return grad, None
        want = ctx.tp.grad_placements(grad.placements)
        if tuple(grad.placements) != want:
            grad = grad.redistribute(grad.device_mesh, want)
        local = grad._local_tensor
        wait = getattr(local, "wait", None)  # an AsyncCollectiveTensor
        if callable(wait) and type(local).__name__ == "AsyncCollectiveTensor":
            local = wait()
        return local, None


def tensor_parallel_of(
    param: torch.Tensor, fqn: str, unit_name: str, spmd: SpmdDims | None = None
) -> TensorParallel | None:
    """The layout of a parameter tensor parallelism made (a DTensor this engine did not make),
    or None for a plain parameter; with ``spmd``, the parameter's layout on the SPMD mesh
    (every parameter must then be a DTensor on it)."""
    from torch.distributed.tensor import DTensor, Replicate

    is_dtensor = isinstance(param, DTensor) and getattr(param, "_fsdp_flat", None) is None
    if spmd is not None:
        if not is_dtensor:
            raise ValueError(
                f"fully_shard({unit_name}): when dp_mesh_dims is provided, all parameters must "
                "be DTensors on the full SPMD mesh (e.g. via distribute_module); got a plain "
                f"tensor for parameter {fqn}"
            )
        assert isinstance(param, DTensor)  # is_dtensor
        if param.device_mesh is not spmd.mesh:
            raise ValueError(
                f"fully_shard({unit_name}): expected parameter {fqn}'s DTensor mesh to be the "
                "same mesh passed to fully_shard with dp_mesh_dims, but got a different "
                f"mesh object ({param.device_mesh})"
            )
        for i in spmd.shard + spmd.replicate:
            if not isinstance(param.placements[i], Replicate):
                assert spmd.mesh.mesh_dim_names is not None  # `resolve_spmd` checked
                raise ValueError(
                    f"fully_shard({unit_name}): parameter {fqn}: Expected Replicate() on "
                    f"data-parallel dim '{spmd.mesh.mesh_dim_names[i]}' (index {i}) but got "
                    f"{param.placements[i]}"
                )
        return TensorParallel(spmd.mesh, tuple(param.placements), param.shape, param.stride(), spmd)
    if not is_dtensor:
        return None
    assert isinstance(param, DTensor)  # is_dtensor
    mesh = param.device_mesh
    if mesh.ndim != 1:
        raise NotImplementedError(
            f"fully_shard({unit_name}): parameter {fqn} is a DTensor on a {mesh.ndim}-D mesh "
            f"{mesh} ({param.placements}); fully_shard composes with 1-D tensor parallelism "
            "(or pass the whole mesh with dp_mesh_dims)"
        )
    if mesh.mesh_dim_names is None:
        raise ValueError(
            f"fully_shard({unit_name}): parameter {fqn} is a DTensor on a mesh without "
            "mesh_dim_names; tensor parallelism with FSDP needs named mesh dims "
            "(init_device_mesh(..., mesh_dim_names=('dp', 'tp')))"
        )
    return TensorParallel(mesh, tuple(param.placements), param.shape, param.stride())


def spmd_mesh(dp_mesh: Any, tp_mesh: Any) -> Any:
    """The mesh of the sharded DTensors: the dp mesh's dims, then the tp mesh's."""
    key = (id(dp_mesh), id(tp_mesh))
    hit = _SPMD.get(key)
    if hit is not None and hit[0] is dp_mesh and hit[1] is tp_mesh:
        return hit[2]
    from torch.distributed.device_mesh import DeviceMesh

    mesh = DeviceMesh._concatenate([dp_mesh, tp_mesh])
    _SPMD[key] = (dp_mesh, tp_mesh, mesh)
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
            f"got {dp_mesh!r}"
        )
    for tp in tps:
        if tp is None:
            continue
        try:
            spmd_mesh(dp_mesh, tp.mesh)
        except RuntimeError as exc:
            raise ValueError(
                f"fully_shard({unit_name}): the data-parallel mesh {dp_mesh} and the "
                f"tensor-parallel mesh {tp.mesh} must be distinct dims of one root mesh: "
                f"{exc}"
            ) from exc


def wrap_tp_views(
    tps: tuple[TensorParallel | None, ...], views: list[torch.Tensor]
) -> list[torch.Tensor]:
    """``views`` with each tensor-parallel parameter's view wrapped as its tp DTensor."""
    return [v if tp is None else tp.wrap(v) for v, tp in zip(views, tps)]


def tp_parameter(tp: TensorParallel, local: torch.Tensor, requires_grad: bool) -> nn.Parameter:
    """A registered unsharded parameter (``unshard()``) of a tensor-parallel slot."""
    from torch.distributed.tensor import DTensor

    return nn.Parameter(
        DTensor(local, tp.view_spec(local.dtype), requires_grad=False),  # type: ignore[no-untyped-call]
        requires_grad=requires_grad,
    )


def resolve_spmd(
    mesh: Any, dp_mesh_dims: Any, reshard_after_forward: Any, unit_name: str
) -> tuple[Any, SpmdDims]:
    """``fully_shard(mesh=M, dp_mesh_dims=...)`` (Note [SPMD mesh]): the data-parallel mesh
    the unit communicates on (the shard dims, flattened when several; the replicate dims in
    front for hybrid sharding; ``(replicate, 1)`` for replication only) and the dims."""
    from torch.distributed.device_mesh import DeviceMesh

    shard = _names(getattr(dp_mesh_dims, "shard", None))
    replicate = _names(getattr(dp_mesh_dims, "replicate", None))
    if not shard and not replicate:
        raise ValueError(
            "dp_mesh_dims: at least one of shard or replicate must be set in DataParallelMeshDims"
        )
    if not isinstance(mesh, DeviceMesh) or mesh.mesh_dim_names is None:
        raise ValueError(
            f"fully_shard({unit_name}): dp_mesh_dims needs mesh to be the whole "
            f"SPMD DeviceMesh with mesh_dim_names, got {mesh!r}"
        )
    names = tuple(mesh.mesh_dim_names)
    for name in shard + replicate:
        if name not in names:
            raise ValueError(
                f"fully_shard({unit_name}): dp_mesh_dims name {name!r} not found "
                f"in mesh.mesh_dim_names {names}"
            )
    if not isinstance(reshard_after_forward, bool) and reshard_after_forward is not None:
        raise NotImplementedError(
            f"fully_shard({unit_name}): reshard_after_forward as int "
            f"({reshard_after_forward}) is not supported with dp_mesh_dims (an SPMD mesh)"
        )
    shard_mesh = _sub(mesh, shard)
    rep_mesh = _sub(mesh, replicate)
    if shard_mesh is not None and rep_mesh is not None:
        dp = DeviceMesh._concatenate([rep_mesh, shard_mesh])
    elif shard_mesh is not None:
        dp = shard_mesh
    else:
        from fsdp_comm import TorchBackend

        from ._wrap import _no_shard_mesh

        assert rep_mesh is not None
        hit = _DDP_MESHES.get(id(rep_mesh))
        if hit is not None and hit[0] is rep_mesh:
            dp = hit[1]
        else:
            dp = _no_shard_mesh(TorchBackend(rep_mesh.get_group()))
            _DDP_MESHES[id(rep_mesh)] = (rep_mesh, dp)
    spmd = SpmdDims(
        mesh,
        tuple(names.index(n) for n in shard),
        tuple(names.index(n) for n in replicate),
        shard_mesh if len(shard) > 1 else None,
    )
    return dp, spmd


def _names(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, str) else tuple(value)


def _sub(mesh: Any, names: tuple[str, ...]) -> Any:
    if not names:
        return None
    sub = mesh[names if len(names) > 1 else names[0]]
    return sub._flatten() if len(names) > 1 else sub
