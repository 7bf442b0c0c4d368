"""`fsdp_engine.strategy_mesh_shape`: the one strategy-to-mesh rule that ``fsdp train``,
``fsdp plan`` and the benchmarks share."""

from __future__ import annotations

import pytest
from fsdp_comm import FakeBackend, init_mesh
from fsdp_engine import (
    STRATEGY_NAMES,
    MeshShape,
    MeshShapeError,
    ShardingStrategy,
    strategy_mesh_shape,
)


@pytest.mark.parametrize(
    "strategy, world, kwargs, shape",
    [
        ("full_shard", 8, {}, (1, 8)),
        ("shard_grad_op", 8, {}, (1, 8)),
        ("no_shard", 8, {}, (8, 1)),
        ("hybrid_shard", 8, {}, (2, 4)),  # half the world by default
        ("hybrid_shard", 1, {}, (1, 1)),
        ("hybrid_shard", 3, {}, (3, 1)),
        ("hybrid_shard", 64, {"gpus_per_node": 8}, (8, 8)),
        ("hybrid_shard", 4, {"gpus_per_node": 8}, (1, 4)),  # a node caps at the world
        ("hybrid_shard", 64, {"shard_size": 16, "gpus_per_node": 8}, (4, 16)),
        ("full_shard", 64, {"gpus_per_node": 8}, (1, 64)),
        ("HYBRID-SHARD", 8, {"shard_size": 2}, (4, 2)),
        (ShardingStrategy.NO_SHARD, 4, {}, (4, 1)),
    ],
)
def test_shapes(
    strategy: object, world: int, kwargs: dict[str, int], shape: tuple[int, int]
) -> None:
    got = strategy_mesh_shape(strategy, world, **kwargs)  # type: ignore[arg-type]
    assert got == shape and isinstance(got, MeshShape)
    assert got.replicate * got.shard == world


@pytest.mark.parametrize(
    "strategy, world, kwargs, argument, words",
    [
        ("zero3", 8, {}, "strategy", "full_shard, shard_grad_op, no_shard, hybrid_shard"),
        ("full_shard", 0, {}, "world_size", "got 0"),
        ("full_shard", True, {}, "world_size", "got True"),
        ("full_shard", 8, {"shard_size": 4}, "shard_size", "applies to hybrid_shard only"),
        ("hybrid_shard", 4, {"shard_size": 3}, "shard_size", "multiple of the shard group (3"),
        ("hybrid_shard", 8, {"shard_size": 0}, "shard_size", "got 0"),
        ("hybrid_shard", 12, {"gpus_per_node": 8}, "world_size", "(12) to be a multiple"),
        ("hybrid_shard", 5, {}, "world_size", "half the world"),
        ("no_shard", 8, {"gpus_per_node": 0}, "gpus_per_node", "got 0"),
    ],
)
def test_errors_name_the_argument(
    strategy: str, world: int, kwargs: dict[str, int], argument: str, words: str
) -> None:
    with pytest.raises(MeshShapeError) as info:
        strategy_mesh_shape(strategy, world, **kwargs)
    assert info.value.argument == argument
    assert words in info.value.message and str(info.value).startswith(f"{argument}: ")
    assert isinstance(info.value, ValueError)


def test_names_are_the_enums() -> None:
    assert STRATEGY_NAMES == tuple(s.value for s in ShardingStrategy)


def test_init_mesh_takes_the_shape() -> None:
    for strategy, shape in (("no_shard", (4, 1)), ("hybrid_shard", (2, 2))):
        mesh = init_mesh(
            strategy_mesh_shape(strategy, 4), backend=FakeBackend(rank=0, world_size=4)
        )
        assert tuple(mesh.shape) == shape
        assert mesh.shard.world_size == shape[1] and mesh.replicate.world_size == shape[0]


def test_train_plan_and_bench_share_it() -> None:
    """No copy of the rule is left where it used to live."""
    import inspect

    import fsdp.bench.engines as bench
    import fsdp.plan._memory as plan_memory
    import fsdp.train._train as train

    assert not hasattr(train, "shard_group_size")
    for module in (train, plan_memory, bench):
        assert "strategy_mesh_shape" in inspect.getsource(module), module.__name__
    assert train.STRATEGIES == STRATEGY_NAMES
