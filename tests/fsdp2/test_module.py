"""fully_shard makes FSDPModules whose parameters are DTensors sharded on dim 0, with the
original names, shapes and values."""

from __future__ import annotations

import pytest

from .harness import assert_sharded, assert_tensors, cases, reference_init, section

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]


@pytest.mark.parametrize(("impl", "world", "key"), cases("structure"))
def test_fully_shard_makes_fsdp_modules(impl: str, world: int, key: tuple) -> None:
    # isinstance(m, torch.distributed.fsdp.FSDPModule): users and libraries (torchtitan,
    # accelerate, DCP's state_dict helpers) branch on it.
    for rank, res in enumerate(section(impl, world, key)):
        assert res["isinstance"] == {"root": True, "blocks.0": True, "blocks.1": True}, (
            rank,
            res["isinstance"],
            res["types"],
        )


@pytest.mark.parametrize(("impl", "world", "key"), cases("structure"))
def test_parameters_are_dim0_sharded_dtensors(impl: str, world: int, key: tuple) -> None:
    mesh_kind = key[1]
    init = reference_init()
    for rank, res in enumerate(section(impl, world, key)):
        assert list(res["params"]) == list(init), "parameter names or order changed"
        for name, desc in res["params"].items():
            assert_sharded(desc, name, mesh_kind, world, rank)
        # The shards put together are the initial weights.
        assert_tensors(res["full"], init, f"rank {rank} full_tensor()", exact=True)
