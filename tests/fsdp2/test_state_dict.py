"""State dicts: model.state_dict()/load_state_dict, torch.distributed.checkpoint.state_dict's
get/set functions with sharded and full options, and DCP checkpoints across world sizes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from .harness import (
    DCP_STEPS,
    IMPLS,
    assert_losses,
    assert_sharded,
    assert_tensors,
    cases,
    checkpoint_dir,
    dcp_load,
    mean_losses,
    reference_init,
    reference_shapes,
    reference_train,
    section,
)
from .models import build

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]


@pytest.mark.parametrize(("impl", "world", "key"), cases("state_dict"))
def test_state_dict_is_sharded_and_needs_no_communication(
    impl: str, world: int, key: tuple
) -> None:
    mesh_kind = key[1]
    init = reference_init()
    for rank, res in enumerate(section(impl, world, key)):
        assert res["comms"] == 0, (
            f"rank {rank}: model.state_dict() issued {res['comms']} collectives"
        )
        assert list(res["describe"]) == list(init), "state_dict keys are not the original FQNs"
        for name, desc in res["describe"].items():
            assert_sharded(desc, name, mesh_kind, world, rank)
        assert_tensors(res["full"], init, f"rank {rank} state_dict full_tensor()", exact=True)


@pytest.mark.parametrize(("impl", "world", "key"), cases("state_dict"))
def test_load_state_dict_round_trips(impl: str, world: int, key: tuple) -> None:
    mesh_kind = key[1]
    init = reference_init()
    per_rank = section(impl, world, key)
    for rank, res in enumerate(per_rank):
        assert res["moved"], "training did not change the parameters; the test proves nothing"
        assert res["load_result"] == ([], []), res["load_result"]
        for name, desc in res["after_load"].items():  # still the sharded DTensors
            assert_sharded(desc, name, mesh_kind, world, rank)
        assert_tensors(
            res["after_load_full"], init, f"rank {rank} after load_state_dict", exact=True
        )
    # The reloaded model computes the initial loss again.
    got = sum(r["loss_after_load"] for r in per_rank) / len(per_rank)
    assert_losses([got], reference_train("adamw_foreach", 1)["losses"], "loss after reload")


@pytest.mark.parametrize(("impl", "world", "key"), cases("dcp_api"))
def test_get_and_set_state_dict_resume_training(impl: str, world: int, key: tuple) -> None:
    """get_model_state_dict / get_state_dict(model, optim) after 2 steps, then set_state_dict
    into a fresh model and optimizer: the next two losses are those of the uninterrupted run."""
    variant = key[2]
    ref = reference_train("adamw_foreach", 4)
    per_rank = section(impl, world, key)
    names = list(reference_init())
    assert_losses(mean_losses(per_rank, "first"), ref["losses"][:2], "first two steps")
    for rank, res in enumerate(per_rank):
        sharded = variant == "sharded"
        holds = sharded or variant == "full" or rank == 0  # cpu_offload: rank 0 only
        if holds:
            assert sorted(res["model_sd"]) == sorted(names), (rank, sorted(res["model_sd"]))
            assert res["model_sd_keys_2"] == sorted(names)
            assert res["optim_state_keys"] == sorted(names), "optimizer state not keyed by FQN"
            assert [sorted(g) for g in res["optim_group_params"]] == [sorted(names)]
            for name, desc in res["model_sd"].items():
                if sharded:
                    assert_sharded(desc, name, "1d", world, rank)
                else:  # full: plain tensors of the global shape (on the CPU)
                    assert not desc["is_dtensor"], (name, desc)
                    assert (desc["shape"], desc["ndim"]) == reference_shapes()[name], name
                    assert desc["device"] == "cpu"
            for fqn, state in res["optim_state"].items():
                for field in ("exp_avg", "exp_avg_sq"):
                    if sharded:
                        assert_sharded(state[field], fqn, "1d", world, rank)
                    else:
                        assert not state[field]["is_dtensor"]
                        assert state[field]["shape"] == reference_shapes()[fqn][0]
            assert_tensors(
                res["model_sd_full"], ref["params_after"][1], f"rank {rank} get_model_state_dict"
            )
        for name, desc in res["reloaded_params"].items():
            assert_sharded(desc, name, "1d", world, rank)
    assert_losses(mean_losses(per_rank, "next"), ref["losses"][2:], "uninterrupted run")
    assert_losses(
        mean_losses(per_rank, "resumed"),
        mean_losses(per_rank, "next"),
        "resumed after set_state_dict",
    )


@pytest.mark.parametrize("impl", IMPLS)
def test_dcp_save_at_4_ranks_resumes_at_2(impl: str) -> None:
    saved = section(impl, 4, ("dcp_save", "1d", DCP_STEPS))
    ref = reference_train("adamw_foreach", DCP_STEPS + 2)
    assert_losses(mean_losses(saved, "first"), ref["losses"][:DCP_STEPS], "before the save")
    assert_losses(mean_losses(saved, "next"), ref["losses"][DCP_STEPS:], "uninterrupted")
    loaded = dcp_load(impl)
    for rank, res in enumerate(loaded):
        assert_tensors(
            res["loaded_full"],
            saved[0]["saved_full"],
            f"rank {rank} parameters after dcp.load + set_state_dict",
            exact=True,
        )
    assert_losses(
        mean_losses(loaded, "resumed"), mean_losses(saved, "next"), "resumed at world size 2"
    )


@pytest.mark.parametrize("impl", IMPLS)
def test_dcp_checkpoint_converts_to_a_plain_save(impl: str, tmp_path: Path) -> None:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    saved = section(impl, 4, ("dcp_save", "1d", DCP_STEPS))
    out = tmp_path / "full.pt"
    dcp_to_torch_save(checkpoint_dir(impl), out)
    state = torch.load(out, weights_only=True)
    plain = build()
    assert plain.load_state_dict(state["model"]) is not None  # strict: every key, no extras
    got = {n: p.detach() for n, p in plain.named_parameters()}
    assert_tensors(got, saved[0]["saved_full"], "plain model from dcp_to_torch_save", exact=True)
    shapes = reference_shapes()
    assert sorted(state["optim"]["state"]) == sorted(shapes)
    for fqn, st in state["optim"]["state"].items():
        assert tuple(st["exp_avg"].shape) == shapes[fqn][0], fqn
