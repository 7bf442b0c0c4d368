"""Turning `fully_shard`'s ``mesh`` argument into the backends a unit communicates on."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["Backends", "BackendResolver", "check_mesh", "check_reshard_after_forward"]


@dataclass(frozen=True)
class Backends:
    shard: Any
    replicate: Any | None
    world: Any
    post_forward: Any | None


def check_mesh(mesh: Any) -> None:
    """Fail at `fully_shard` time on a mesh argument of the wrong kind."""
    from fsdp_comm import Backend, Mesh

    if mesh is not None and not isinstance(mesh, (Backend, Mesh)):
        raise TypeError("mesh must be None (the default torch.distributed group), an "
                        "fsdp_comm.Backend (1-D: full sharding) or an fsdp_comm.Mesh (2-D: "
                        f"hybrid sharding), got {type(mesh).__name__}")


def check_reshard_after_forward(value: Any, shard_size: int | None, fqn: str) -> None:
    if isinstance(value, bool):
        return
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"fully_shard({fqn or '<root>'}): reshard_after_forward must be True, "
                         f"False or a positive int, got {value!r}")
    if shard_size is not None and shard_size % value != 0:
        raise ValueError(
            f"fully_shard({fqn or '<root>'}): reshard_after_forward={value} must divide the "
            f"shard group size {shard_size} (parameters are resharded to groups of that many "
            "consecutive ranks)")


class BackendResolver:
    """Resolves meshes for one tree, creating each post-forward group once."""

    def __init__(self) -> None:
        self._default: Any = None
        self._post_forward: dict[tuple[int, int], Any] = {}

    def resolve(self, mesh: Any, reshard_after_forward: bool | int, fqn: str) -> Backends:
        from fsdp_comm import Mesh

        if mesh is None:
            mesh = self._default_backend()
        if isinstance(mesh, Mesh):
            rep = mesh.replicate if mesh.replicate.world_size > 1 else None
            shard, world = mesh.shard, mesh.world
        else:
            shard, rep, world = mesh, None, mesh
        check_reshard_after_forward(reshard_after_forward, shard.world_size, fqn)
        return Backends(shard, rep, world, self._post_forward_group(shard, reshard_after_forward))

    def _default_backend(self) -> Any:
        if self._default is None:
            from fsdp_comm import get_backend

            self._default = get_backend("torch")
        return self._default

    def _post_forward_group(self, shard: Any, k: bool | int) -> Any:
        if isinstance(k, bool) or k in (1, shard.world_size):
            return None
        key = (id(shard), k)
        if key not in self._post_forward:
            mine = None
            for start in range(0, shard.world_size, k):  # collective: every rank, every group
                sub = shard.new_group(tuple(range(start, start + k)))
                mine = sub if sub is not None else mine
            self._post_forward[key] = mine
        return self._post_forward[key]
