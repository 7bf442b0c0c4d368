"""Save at world size 4, load at 2, 3 and into a plain model: identical parameters and optimizer
state; hybrid replicas write nothing; buffers and extra round-trip."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import fsdp_ckpt as ck
import pytest
import torch
from fsdp_comm import launch
from fsdp_engine import fully_shard
from torch import nn

from . import ranks

TIMEOUT = 120


@pytest.fixture(scope="module")
def saved_at_4(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[dict[str, Any]]]:
    path = str(tmp_path_factory.mktemp("ckpt") / "run")
    results = launch(ranks.train_and_save, 4, backend="threads", args=(path,), timeout=TIMEOUT)
    return path, results


def _shapes() -> dict[str, torch.Size]:
    return {n: p.shape for n, p in ranks.build(0).named_parameters()}


def _assert_same_state(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> None:
    for name, value in want[0]["params"].items():
        assert torch.equal(got[0]["params"][name], value), name
    shapes = _shapes()
    opt_got = ranks.assemble_optimizer([r["optim"] for r in got], shapes)
    opt_want = ranks.assemble_optimizer([r["optim"] for r in want], shapes)
    assert opt_got.keys() == opt_want.keys() and opt_want
    for fqn, state in opt_want.items():
        assert state.keys() == opt_got[fqn].keys(), fqn
        for name, value in state.items():
            assert torch.equal(opt_got[fqn][name], value), (fqn, name)


@pytest.mark.parametrize("world", [2, 3])
def test_save_at_4_load_at_other_world_sizes(saved_at_4: Any, world: int) -> None:
    path, want = saved_at_4
    got = launch(ranks.load_sharded, world, backend="threads", args=(path,), timeout=TIMEOUT)
    _assert_same_state(got, want)
    assert all(r["extra"] == {"step": ranks.STEPS_BEFORE_SAVE, "world": 4} for r in got)


def test_save_at_4_load_into_plain_model(saved_at_4: Any) -> None:
    path, want = saved_at_4
    model = ranks.build(1)
    opt = ranks.optimizer(model)
    extra = ck.load(path, model, opt)
    assert extra == {"step": ranks.STEPS_BEFORE_SAVE, "world": 4}
    got = [
        {
            "params": {n: p.detach() for n, p in model.named_parameters()},
            "optim": ranks.optimizer_pieces(model, opt),
        }
    ]
    _assert_same_state(got, want)
    # The tied head shares the embedding, saved once under the engine's name.
    assert model.head.weight is model.tok.weight


def test_load_into_a_live_optimizer_writes_its_state_in_place(tmp_path: Path) -> None:
    model = ranks.build(0)
    opt = ranks.optimizer(model)
    ranks.plain_train(model, opt, 1, range(2))
    ck.save(tmp_path / "c", model, opt)
    before = {id(p): dict(s) for p, s in opt.state.items()}
    want = {id(p): {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}
    ranks.plain_train(model, opt, 1, range(2, 3))  # moves every moment away from the save
    ck.load(tmp_path / "c", model, opt)
    for p, state in opt.state.items():
        assert state["exp_avg"] is before[id(p)]["exp_avg"]  # the same tensor, overwritten
        for name, value in state.items():
            assert torch.equal(value, want[id(p)][name]), name


def test_each_rank_writes_only_its_slices(saved_at_4: Any) -> None:
    path, _ = saved_at_4
    info = ck.inspect_checkpoint(path)
    assert info.world_size == 4
    assert sorted(info.files) == [f"shard-0000{r}.safetensors" for r in range(4)]
    total = sum(p.numel() for p in ranks.build(0).parameters())
    assert info.num_param_elements == total
    # Parameters and AdamW's two moments, 4 bytes each, plus headers: no duplicated slice.
    assert 12 * total <= info.total_bytes < 12 * total + 64 * 1024


def test_hybrid_replicas_write_nothing(tmp_path: Path) -> None:
    path = str(tmp_path / "hybrid")
    want = launch(
        ranks.train_and_save, 4, backend="threads", args=(path, "hybrid"), timeout=TIMEOUT
    )
    assert sorted(ck.inspect_checkpoint(path).files) == [
        "shard-00000.safetensors",
        "shard-00001.safetensors",
    ]
    got = launch(ranks.load_sharded, 3, backend="threads", args=(path,), timeout=TIMEOUT)
    _assert_same_state(got, want[:2])


class _Norm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.bn = nn.BatchNorm1d(8)
        self.out = nn.Linear(8, 3)
        self.register_buffer("scratch", torch.zeros(2), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.bn(self.inp(x)))


def _norm_rank(be: Any, path: str) -> dict[str, torch.Tensor]:
    with ranks._BUILD_LOCK:
        torch.manual_seed(0)
        model = _Norm()
    fully_shard(model, mesh=be)
    model(torch.randn(5, 6, generator=torch.Generator().manual_seed(be.rank)))
    ck.save(path, model)
    return {k: v.clone() for k, v in model.state_dict().items() if "bn." in k}


def test_buffers_saved_once_and_loaded(tmp_path: Path) -> None:
    path = str(tmp_path / "bn")
    saved = launch(_norm_rank, 2, backend="threads", args=(path,), timeout=TIMEOUT)
    index = ck.inspect_checkpoint(path).index
    assert sorted(index.buffers) == ["bn.num_batches_tracked", "bn.running_mean", "bn.running_var"]
    plain = _Norm()
    ck.load(path, plain)
    for name in index.buffers:
        assert torch.equal(plain.get_buffer(name), saved[0][name]), name
    assert plain.bn.num_batches_tracked.item() == 1


def test_extra_round_trips_json_and_tensors(tmp_path: Path) -> None:
    model = ranks.build(0)
    extra = {
        "step": 7,
        "lr": 0.5,
        "name": "run",
        "flags": [True, None],
        "pair": (1, 2.5),
        "rng": torch.get_rng_state(),
        "small": torch.tensor([1.5, -0.0]),
        "nested": {"__tuple__": 1, "loader": {"epoch": 2, "position": 12345}},
    }
    ck.save(tmp_path / "x", model, extra=extra)
    got = ck.load(tmp_path / "x", ranks.build(1))
    assert torch.equal(got.pop("rng"), extra["rng"])
    small = got.pop("small")
    assert torch.equal(small, extra["small"]) and torch.signbit(small[1])
    assert got == {k: v for k, v in extra.items() if k not in ("rng", "small")}
    assert isinstance(got["pair"], tuple)


def test_extra_that_json_cannot_hold_is_refused(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"extra\['bad'\]\[0\]: cannot store a set"):
        ck.save(tmp_path / "x", ranks.build(0), extra={"bad": [{1, 2}]})
    assert not os.path.exists(tmp_path / "x" / "CURRENT")


def test_plain_checkpoint_loads_sharded(tmp_path: Path) -> None:
    model = ranks.build(0)
    opt = ranks.optimizer(model)
    ranks.plain_train(model, opt, 2, range(2))
    ck.save(tmp_path / "plain", model, opt)
    want = [
        {
            "params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "optim": ranks.optimizer_pieces(model, opt),
        }
    ]
    got = launch(
        ranks.load_sharded, 2, backend="threads", args=(str(tmp_path / "plain"),), timeout=TIMEOUT
    )
    _assert_same_state(got, want)


def test_index_is_versioned_json_with_checksums(saved_at_4: Any) -> None:
    path, _ = saved_at_4
    pointer = json.loads(Path(path, "CURRENT").read_text())
    index = json.loads(Path(path, pointer["version"], "index.json").read_text())
    # No box chunks (no tensor parallelism): written as version 1, which fsdp-ckpt 0.1 reads.
    assert index["format"] == "fsdp-ckpt" and index["format_version"] == 1
    assert ck.FORMAT_VERSION == 2
    for name, digest in index["files"].items():
        assert os.path.getsize(Path(path, pointer["version"], name)) == digest["size"]
        assert len(digest["crc32"]) == 8
    entry = index["params"]["blocks.0.mlp.0.weight"]
    assert entry["shape"] == [67, 22] and entry["dtype"] == "float32"
    assert sum(c["length"] for c in entry["chunks"]) == 67 * 22
    assert index["optimizer"]["state"]["blocks.0.mlp.0.weight"]["exp_avg"]["per_param"]
    assert "inline" in index["optimizer"]["state"]["blocks.0.mlp.0.weight"]["step"]
