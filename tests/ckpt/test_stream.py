"""`iter_full_tensors` and `iter_full_state_dict`: whole tensors one at a time."""

from __future__ import annotations

from typing import Any

import fsdp_ckpt as ck
import pytest
import torch
from fsdp_comm import Backend, launch

from . import ranks

TIMEOUT = 120


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, torch.Tensor]]:
    path = str(tmp_path_factory.mktemp("stream") / "run")
    results = launch(ranks.train_and_save, 2, backend="threads", args=(path,), timeout=TIMEOUT)
    return path, results[0]["params"]


def test_iter_full_tensors_streams_the_model_state(saved: Any, tmp_path: Any) -> None:
    path, params = saved
    got = dict(ck.iter_full_tensors(path))
    assert params.keys() <= got.keys()
    for name, value in params.items():
        assert torch.equal(got[name], value), name
    ck.export(path, str(tmp_path / "all.safetensors"))  # the same tensors as export writes
    from safetensors.torch import load_file

    exported = load_file(str(tmp_path / "all.safetensors"))
    assert exported.keys() == got.keys()
    assert all(torch.equal(exported[k], got[k]) for k in got)


def test_iter_full_tensors_follows_names_and_checks_up_front(saved: Any, tmp_path: Any) -> None:
    path, params = saved
    names = list(reversed(params))[:3]
    assert [n for n, _ in ck.iter_full_tensors(path, names=names)] == names
    with pytest.raises(ValueError, match="no tensor 'nope'"):
        ck.iter_full_tensors(path, names=["nope"])  # raised by the call, not the first step
    with pytest.raises(ck.CheckpointError):
        ck.iter_full_tensors(str(tmp_path / "absent"))
    with pytest.raises(TypeError):
        ck.iter_full_tensors(path, names="pos")


def _stream(be: Backend, rank0_only: bool, strategy: str) -> dict[str, Any]:
    model = ranks.shard(ranks.build(0), be, strategy)
    opt = ranks.optimizer(model)
    ranks.train(model, opt, be.rank, be.world_size, range(1))
    reference = ck.full_state_dict(model, rank0_only=False)
    streamed = list(ck.iter_full_state_dict(model, rank0_only=rank0_only))
    aliases = list(ck.iter_full_state_dict(model, names=["head.weight", "pos"]))
    return {"reference": reference, "streamed": streamed, "aliases": aliases}


@pytest.mark.parametrize("rank0_only,strategy,world", [(True, "full", 3), (False, "hybrid", 4)])
def test_iter_full_state_dict_matches_full_state_dict(
    rank0_only: bool, strategy: str, world: int
) -> None:
    results = launch(
        _stream, world, backend="threads", args=(rank0_only, strategy), timeout=TIMEOUT
    )
    for rank, r in enumerate(results):
        reference = r["reference"]
        assert [n for n, _ in r["streamed"]] == list(reference)  # one tied name, same order
        for name, value in r["streamed"]:
            if rank0_only and rank:
                assert value is None
            else:
                assert value.device.type == "cpu" and torch.equal(value, reference[name]), name
        if rank == 0:  # a tied weight answers to each of its names
            (head, value), (pos, pos_value) = r["aliases"]
            assert head == "head.weight" and torch.equal(value, reference["tok.weight"])
            assert pos == "pos" and torch.equal(pos_value, reference["pos"])


def test_iter_full_state_dict_plain_model() -> None:
    model = ranks.build(0)
    got = dict(ck.iter_full_state_dict(model))
    assert got.keys() == ck.full_state_dict(model).keys()
    assert torch.equal(got["pos"], model.pos.detach())
