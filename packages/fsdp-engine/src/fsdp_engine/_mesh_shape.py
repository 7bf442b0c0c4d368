"""`strategy_mesh_shape`: the (replicate, shard) sizes a sharding strategy runs on.

The one place that turns a strategy name and a world size into a mesh shape: ``fsdp train``,
``fsdp plan`` and the benchmarks all ask it, then build ``fsdp_comm.init_mesh(shape)`` (or use
the 1-D world for full sharding). Pure arithmetic: no process groups are created here.
"""

from __future__ import annotations

from typing import NamedTuple

from ._policies import STRATEGY_NAMES, ShardingStrategy

__all__ = ["MeshShape", "MeshShapeError", "strategy_mesh_shape"]


class MeshShapeError(ValueError):
    """A strategy that cannot be laid out on the ranks given. ``argument`` names the input at
    fault (``strategy``, ``world_size``, ``shard_size`` or ``gpus_per_node``), ``message``
    says the rule and the value received."""

    def __init__(self, argument: str, message: str) -> None:
        super().__init__(f"{argument}: {message}")
        self.argument = argument
        self.message = message


class MeshShape(NamedTuple):
    """Mesh sizes: ``replicate`` groups of ``shard`` consecutive ranks (``init_mesh`` takes
    it as its shape)."""

    replicate: int
    shard: int


def _strategy_name(strategy: str | ShardingStrategy) -> str:
    if isinstance(strategy, ShardingStrategy):
        return strategy.value
    name = str(strategy).lower().replace("-", "_")
    if name not in STRATEGY_NAMES:
        raise MeshShapeError(
            "strategy", f"unknown strategy {strategy!r}; choose from {', '.join(STRATEGY_NAMES)}"
        )
    return name


def _count(value: object, argument: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise MeshShapeError(argument, f"must be an int >= 1, got {value!r}")
    return value


def _hybrid_shard(world_size: int, shard_size: int | None, gpus_per_node: int | None) -> int:
    """Hybrid sharding's group: ``shard_size``, else a node (``gpus_per_node``, at most the
    world), else half the world (at least one rank). When it does not divide the world, the
    fault is ``shard_size``'s if given, else the world size's (a node is a given)."""
    if shard_size is not None:
        size, source = _count(shard_size, "shard_size"), "shard_size"
    elif gpus_per_node is not None:
        size, source = min(_count(gpus_per_node, "gpus_per_node"), world_size), "gpus_per_node"
    else:
        size, source = max(1, world_size // 2), "world_size"
    if world_size % size:
        where = {
            "shard_size": "the shard size",
            "gpus_per_node": "GPUs per node",
            "world_size": "half the world, the default",
        }[source]
        argument = "shard_size" if source == "shard_size" else "world_size"
        raise MeshShapeError(
            argument,
            f"hybrid_shard needs the world size ({world_size}) to be "
            f"a multiple of the shard group ({size}, {where})",
        )
    return size


def strategy_mesh_shape(
    strategy: str | ShardingStrategy,
    world_size: int,
    *,
    shard_size: int | None = None,
    gpus_per_node: int | None = None,
) -> MeshShape:
    """The (replicate, shard) sizes ``strategy`` runs on over ``world_size`` ranks.

    ``full_shard`` and ``shard_grad_op``: ``(1, W)``; ``no_shard``: ``(W, 1)`` (shard groups of
    one rank, gradients all-reduced); ``hybrid_shard``: ``(W / S, S)`` with ``S`` the
    ``shard_size`` if given, else ``gpus_per_node`` (capped at ``W``), else half the world.
    ``shard_size`` applies to hybrid sharding only. Raises `MeshShapeError` (a ValueError
    naming the argument) on anything that does not lay out."""
    name = _strategy_name(strategy)
    world_size = _count(world_size, "world_size")
    if gpus_per_node is not None:
        _count(gpus_per_node, "gpus_per_node")
    if name != "hybrid_shard":
        if shard_size is not None:
            raise MeshShapeError(
                "shard_size",
                f"applies to hybrid_shard only, got strategy {name} with shard_size {shard_size!r}",
            )
        return MeshShape(world_size, 1) if name == "no_shard" else MeshShape(1, world_size)
    shard = _hybrid_shard(world_size, shard_size, gpus_per_node)
    return MeshShape(world_size // shard, shard)
