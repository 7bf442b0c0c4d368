"""A flipped byte, a truncated file, a missing file, an altered index: each a clear error that
names the file, from `verify` and from `load`, and the model is left as it was."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import fsdp_ckpt as ck
import pytest
import torch
from fsdp_comm import launch

from . import ranks

TIMEOUT = 120


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("pristine") / "run")
    launch(ranks.train_and_save, 2, backend="threads", args=(path,), timeout=TIMEOUT)
    return path


@pytest.fixture()
def ckpt(pristine: str, tmp_path: Path) -> str:
    path = str(tmp_path / "run")
    shutil.copytree(pristine, path)
    return path


def _file(path: str, name: str) -> Path:
    return Path(path, "v000001", name)


def _flip(p: Path) -> None:
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0x01
    p.write_bytes(bytes(data))


def _truncate(p: Path) -> None:
    p.write_bytes(p.read_bytes()[:-5])


def _remove(p: Path) -> None:
    p.unlink()


CASES: list[tuple[str, Callable[[Path], None], str]] = [
    ("flipped byte", _flip, "checksum mismatch"),
    ("truncated", _truncate, "truncated"),
    ("missing", _remove, "missing"),
]


@pytest.mark.parametrize("what,damage,message", CASES, ids=[c[0] for c in CASES])
def test_damaged_shard_gives_a_clear_error(
    ckpt: str, what: str, damage: Callable[[Path], None], message: str
) -> None:
    target = _file(ckpt, "shard-00001.safetensors")
    damage(target)
    with pytest.raises(ck.CheckpointCorruptError, match=message) as info:
        ck.verify(ckpt)
    assert info.value.path == str(target)
    model = ranks.build(1)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(ck.CheckpointCorruptError, match=message) as info:
        ck.load(ckpt, model)
    assert "shard-00001.safetensors" in str(info.value)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_every_rank_refuses_a_damaged_checkpoint(ckpt: str) -> None:
    _flip(_file(ckpt, "shard-00000.safetensors"))
    results = launch(
        ranks.load_expecting_error, 2, backend="threads", args=(ckpt,), timeout=TIMEOUT
    )
    assert all(r["unchanged"] for r in results)
    assert "shard-00000.safetensors: checksum mismatch" in results[0]["error"]
    # Rank 1 at world size 2 reads only shard 1, which is intact: it learns from the vote
    # which rank failed, on which file, and why.
    assert "rank 0 could not read or verify its files" in results[1]["error"]
    assert "shard-00000.safetensors: checksum mismatch" in results[1]["error"]


def test_altered_index_is_caught_by_the_pointer_checksum(ckpt: str) -> None:
    index = _file(ckpt, "index.json")
    obj = json.loads(index.read_text())
    obj["params"]["pos"]["shape"] = [9, 23]
    index.write_text(json.dumps(obj))
    with pytest.raises(ck.CheckpointCorruptError, match="index.json: .* the pointer records"):
        ck.load(ckpt, ranks.build(1))


def test_index_checked_when_loading_a_version_directory_directly(ckpt: str) -> None:
    version = os.path.join(ckpt, "v000001")
    index = Path(version, "index.json")
    obj = json.loads(index.read_text())
    obj["params"]["tok.weight"]["chunks"] = obj["params"]["tok.weight"]["chunks"][:1]
    index.write_text(json.dumps(obj))
    with pytest.raises(ck.CheckpointCorruptError, match="tok.weight: pieces hold"):
        ck.verify(version)


def test_pointer_to_a_missing_version(ckpt: str) -> None:
    shutil.rmtree(Path(ckpt, "v000001"))
    with pytest.raises(ck.CheckpointCorruptError, match="index.json: missing"):
        ck.load(ckpt, ranks.build(1))


def test_no_checkpoint_at_path(tmp_path: Path) -> None:
    with pytest.raises(ck.CheckpointError, match="no checkpoint at"):
        ck.load(tmp_path, ranks.build(1))


def test_relocated_checkpoint_loads(ckpt: str, tmp_path: Path) -> None:
    moved = tmp_path / "elsewhere" / "copy"
    shutil.copytree(Path(ckpt, "v000001"), moved)
    ck.verify(moved)
    ck.load(moved, ranks.build(1))
