"""Conversion to and from torch.distributed.checkpoint (DCP), both ways, in one process."""

from __future__ import annotations

from pathlib import Path

import fsdp_ckpt as ck
import pytest
import torch
import torch.distributed.checkpoint as dcp
from fsdp_comm import launch

from . import ranks

TIMEOUT = 120
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[dict]]:
    path = str(tmp_path_factory.mktemp("dcp") / "ours")
    return path, launch(ranks.train_and_save, 2, backend="threads", args=(path,), timeout=TIMEOUT)


def test_to_dcp_then_from_dcp_round_trips(saved: tuple[str, list[dict]], tmp_path: Path) -> None:
    path, want = saved
    ck.to_dcp(path, tmp_path / "dcp")
    back = str(tmp_path / "back")
    ck.from_dcp(tmp_path / "dcp", back)
    got = launch(ranks.load_sharded, 3, backend="threads", args=(back,), timeout=TIMEOUT)
    shapes = {n: p.shape for n, p in ranks.build(0).named_parameters()}
    for name, value in want[0]["params"].items():
        assert torch.equal(got[0]["params"][name], value), name
    opt_got = ranks.assemble_optimizer([r["optim"] for r in got], shapes)
    opt_want = ranks.assemble_optimizer([r["optim"] for r in want], shapes)
    for fqn, state in opt_want.items():
        for name, value in state.items():
            assert torch.equal(opt_got[fqn][name], value), (fqn, name)


def test_dcp_checkpoint_has_torch_fsdp_layout(
    saved: tuple[str, list[dict]], tmp_path: Path
) -> None:
    path, want = saved
    ck.to_dcp(path, tmp_path / "dcp")
    model = ranks.build(1)
    state = {"model": {n: torch.empty_like(p) for n, p in model.named_parameters()}}
    dcp.load(state, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    for name, value in want[0]["params"].items():
        assert torch.equal(state["model"][name], value), name
    reader = dcp.FileSystemReader(str(tmp_path / "dcp"))
    keys = set(reader.read_metadata().state_dict_metadata)
    assert "optim.state.blocks.0.mlp.0.weight.exp_avg" in keys
    assert "optim.param_groups.0.lr" in keys


def test_from_a_dcp_checkpoint_written_by_torch(tmp_path: Path) -> None:
    """A plain model's state saved with dcp.save the way torch FSDP users do (state by FQN),
    converted, then loaded into a sharded model at world size 2."""
    model = ranks.build(0)
    opt = ranks.optimizer(model)
    ranks.plain_train(model, opt, 2, range(2))
    names = {id(p): n for n, p in model.named_parameters()}
    osd = opt.state_dict()
    params = [p for g in opt.param_groups for p in g["params"]]
    optim = {
        "state": {names[id(params[i])]: s for i, s in osd["state"].items()},
        "param_groups": [
            {**g, "params": [names[id(params[i])] for i in g["params"]]}
            for g in osd["param_groups"]
        ],
    }
    dcp.save(
        {"model": model.state_dict(), "optim": optim},
        checkpoint_id=str(tmp_path / "t"),
        no_dist=True,
    )
    ck.from_dcp(tmp_path / "t", tmp_path / "ours")
    info = ck.inspect_checkpoint(tmp_path / "ours")
    assert info.optimizer_states == ("exp_avg", "exp_avg_sq", "step")
    want = [
        {
            "params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "optim": ranks.optimizer_pieces(model, opt),
        }
    ]
    got = launch(
        ranks.load_sharded, 2, backend="threads", args=(str(tmp_path / "ours"),), timeout=TIMEOUT
    )
    for name, value in want[0]["params"].items():
        assert torch.equal(got[0]["params"][name], value), name
    shapes = {n: p.shape for n, p in model.named_parameters()}
    opt_got = ranks.assemble_optimizer([r["optim"] for r in got], shapes)
    for fqn, state in ranks.assemble_optimizer([w["optim"] for w in want], shapes).items():
        for name, value in state.items():
            assert torch.equal(opt_got[fqn][name], value), (fqn, name)


def test_from_dcp_names_a_wrong_key(tmp_path: Path) -> None:
    dcp.save({"weights": {"a": torch.ones(2)}}, checkpoint_id=str(tmp_path / "t"), no_dist=True)
    with pytest.raises(ValueError, match="model_key: .* no 'model' entry .*'weights'"):
        ck.from_dcp(tmp_path / "t", tmp_path / "ours")
