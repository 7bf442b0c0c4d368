"""`Mesh`: a 2-D (replicate x shard) arrangement of ranks with a backend per dimension."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ._backend import Backend
from ._registry import get_backend

__all__ = ["Mesh", "init_mesh"]

_log = logging.getLogger("fsdp.comm")


@dataclass(frozen=True)
class Mesh:
    """Ranks laid out row-major as ``shape = (replicate, shard)``.

    Shard groups are consecutive ranks (``[0..S)``, ``[S..2S)``, ...); replicate groups take one
    rank from each shard group (``[0, S, 2S, ...]``). ``shard`` and ``replicate`` are this rank's
    sub-backends; ``world`` is the backend over all ranks.
    """

    world: Backend
    shard: Backend
    replicate: Backend
    shape: tuple[int, int]

    @property
    def coordinate(self) -> tuple[int, int]:
        """This rank's ``(replicate index, shard index)``."""
        return self.world.rank // self.shape[1], self.world.rank % self.shape[1]

    @property
    def ndim(self) -> int:
        return 2


def init_mesh(
    shape: Sequence[int] | int, *, backend: str | Backend = "torch", **options: Any
) -> Mesh:
    """Build a `Mesh` of ``shape = (replicate, shard)`` over ``backend``.

    ``backend`` is a registry name (created with ``options``) or an existing `Backend` whose
    ranks the mesh covers. Collective: every rank calls it with the same shape. An int shape
    (or a 1-tuple) means ``(1, shape)``: pure sharding.
    """
    world = backend if isinstance(backend, Backend) else get_backend(backend, **options)
    if options and isinstance(backend, Backend):
        raise ValueError(f"options {sorted(options)} are only used when backend is a name")
    replicate, shard = _check_shape(shape, world.world_size)
    shard_groups = [tuple(range(i * shard, (i + 1) * shard)) for i in range(replicate)]
    replicate_groups = [tuple(range(j, world.world_size, shard)) for j in range(shard)]
    my_shard = _make_groups(world, shard_groups)
    my_replicate = _make_groups(world, replicate_groups)
    mesh = Mesh(world=world, shard=my_shard, replicate=my_replicate, shape=(replicate, shard))
    _log.info(
        "mesh (replicate %d x shard %d) over %s: rank %d at %s",
        replicate,
        shard,
        world.name,
        world.rank,
        mesh.coordinate,
    )
    return mesh


def _make_groups(world: Backend, groups: list[tuple[int, ...]]) -> Backend:
    if len(groups) == 1 and len(groups[0]) == world.world_size:
        return world  # the whole world: no new group needed
    mine: Backend | None = None
    for ranks in groups:  # every rank creates every group, in the same order
        sub = world.new_group(ranks)
        if sub is not None:
            mine = sub
    if mine is None:
        raise AssertionError(f"rank {world.rank} is in none of the groups {groups}")
    return mine


def _check_shape(shape: Sequence[int] | int, world_size: int) -> tuple[int, int]:
    dims = (shape,) if isinstance(shape, int) else tuple(shape)
    if len(dims) == 1:
        dims = (1, dims[0])
    if len(dims) != 2 or any(isinstance(d, bool) or not isinstance(d, int) or d < 1 for d in dims):
        raise ValueError(f"shape must be (replicate, shard) with positive ints, got {shape!r}")
    if dims[0] * dims[1] != world_size:
        raise ValueError(
            f"shape {dims} needs replicate * shard == world size {world_size}, got "
            f"{dims[0] * dims[1]}"
        )
    return dims[0], dims[1]
