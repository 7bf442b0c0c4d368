"""FSDPModule.unshard() / reshard(): what the module holds in between."""

from __future__ import annotations

import pytest

from .harness import (
    assert_losses,
    assert_sharded,
    assert_tensors,
    cases,
    mean_losses,
    reference_init,
    reference_shapes,
    reference_train,
    section,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]


def _values(key: tuple) -> dict:
    """The full parameters the unit must hold: the initial ones, or after one step."""
    if key[2]:  # trained
        return reference_train("adamw_foreach", 1)["params_after"][0]
    return reference_init()


def _block(values: dict, prefix: str) -> dict:
    return {n[len(prefix) :]: v for n, v in values.items() if n.startswith(prefix)}


def _assert_full(snapshot: dict, values: dict, prefix: str, what: str) -> None:
    """Plain (not DTensor) nn.Parameters of the original shape holding the full values."""
    shapes = reference_shapes()
    assert sorted(snapshot) == sorted(values), (what, sorted(snapshot))
    for name, desc in snapshot.items():
        assert not desc["is_dtensor"], f"{what} {name} is still a {desc['type']}"
        assert desc["is_parameter"], f"{what} {name} is a {desc['type']}, not an nn.Parameter"
        assert (desc["shape"], desc["ndim"]) == shapes[prefix + name], (what, name, desc)


def _assert_dtensors(snapshot: dict, prefix: str, world: int, rank: int, what: str) -> None:
    for name, desc in snapshot.items():
        assert desc["is_parameter"], f"{what} {name} is not an nn.Parameter"
        assert_sharded(desc, prefix + name, "1d", world, rank)


@pytest.mark.parametrize(("impl", "world", "key"), cases("unshard"))
def test_unshard_registers_full_plain_parameters(impl: str, world: int, key: tuple) -> None:
    values = _values(key)
    exact = not key[2]  # the initial weights are bit-exact; trained ones within tolerance
    b0, b1 = _block(values, "blocks.0."), _block(values, "blocks.1.")
    for rank, res in enumerate(section(impl, world, key)):
        _assert_dtensors(res["before"], "blocks.0.", world, rank, "before unshard")
        _assert_full(res["unsharded"], b0, "blocks.0.", "after block.unshard()")
        assert_tensors(res["unsharded_values"], b0, f"rank {rank} unsharded", exact=exact)
        # The attribute users read directly, e.g. block.qkv.weight.
        assert not res["unsharded_attr"]["is_dtensor"], res["unsharded_attr"]
        assert res["unsharded_attr"]["shape"] == reference_shapes()["blocks.0.qkv.weight"][0]
        # Only that unit: the other block keeps its shards.
        _assert_dtensors(res["other_block_during"], "blocks.1.", world, rank, "other block")
        # unshard(async_op=True) returns a handle; after wait() the same full parameters.
        assert res["async_handle"] != "NoneType", "unshard(async_op=True) returned None"
        _assert_full(res["async_unsharded"], b1, "blocks.1.", "after async unshard + wait")
        assert_tensors(res["async_values"], b1, f"rank {rank} async unsharded", exact=exact)


@pytest.mark.parametrize(("impl", "world", "key"), cases("unshard"))
def test_reshard_puts_the_dtensors_back(impl: str, world: int, key: tuple) -> None:
    per_rank = section(impl, world, key)
    root = {n: v for n, v in _values(key).items() if not n.startswith("blocks.")}
    for rank, res in enumerate(per_rank):
        _assert_dtensors(res["resharded"], "blocks.0.", world, rank, "after block.reshard()")
        # The root unit's unshard() covers the root's own parameters, not the blocks'.
        _assert_full(res["root_own_unsharded"], root, "", "after root.unshard()")
        assert_tensors(
            res["root_own_values"], root, f"rank {rank} root unsharded", exact=not key[2]
        )
        _assert_dtensors(
            res["root_blocks_during"], "blocks.0.", world, rank, "block during root.unshard()"
        )
        _assert_dtensors(res["root_resharded"], "", world, rank, "after root.reshard()")
    # Training after the unshard/reshard cycles is the reference's.
    first = 1 if key[2] else 0
    assert_losses(
        mean_losses(per_rank), reference_train("adamw_foreach", first + 2)["losses"][first:]
    )
