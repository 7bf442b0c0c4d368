"""full_state_dict, single-file export, the ``ckpt`` commands, keep-last-K, and the storage
interface (the packaged `FsspecStorage` on fsspec's in-memory store; the rest of its tests
are in test_fsspec_storage.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import fsdp_ckpt as ck
import fsspec
import pytest
import safetensors.torch
import torch
from fsdp_ckpt.cli import main
from fsdp_comm import launch
from safetensors import safe_open

from . import ranks

TIMEOUT = 120


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, torch.Tensor]]:
    path = str(tmp_path_factory.mktemp("export") / "run")
    results = launch(ranks.train_and_save, 2, backend="threads", args=(path,), timeout=TIMEOUT)
    return path, results[0]["params"]


@pytest.mark.parametrize(
    "rank0_only,strategy,world", [(True, "full", 3), (False, "full", 3), (True, "hybrid", 4)]
)
def test_full_state_dict_gathers_every_parameter(
    rank0_only: bool, strategy: str, world: int
) -> None:
    results = launch(
        ranks.full_state, world, backend="threads", args=(rank0_only, strategy), timeout=TIMEOUT
    )
    reference = results[0]["reference"]
    for rank, r in enumerate(results):
        if rank0_only and rank:
            assert r["full"] == {}
            continue
        assert r["full"].keys() == reference.keys()  # tied head.weight once, as tok.weight
        for name, value in reference.items():
            assert r["full"][name].device.type == "cpu"
            assert torch.equal(r["full"][name], value), name


def test_shard_files_are_standard_safetensors(saved: Any) -> None:
    path, params = saved
    directory = ck.inspect_checkpoint(path).directory
    with safe_open(os.path.join(directory, "shard-00000.safetensors"), framework="pt") as f:
        keys = list(f.keys())
        assert "param/pos" in keys and f.metadata()["format"] == "pt"
        # Rank 0's rows of pos (each rank writes its dim-0 chunk).
        mine = f.get_tensor("param/pos")
        assert torch.equal(mine, params["pos"].reshape(-1)[: mine.numel()])


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_export_to_one_file(saved: Any, tmp_path: Path, suffix: str) -> None:
    path, params = saved
    out = str(tmp_path / f"model{suffix}")
    assert ck.export(path, out) == out
    if suffix == ".safetensors":
        state = safetensors.torch.load_file(out)
    else:
        state = torch.load(out, weights_only=True)
    assert state.keys() == params.keys()
    for name, value in params.items():
        assert torch.equal(state[name], value), name
    plain = ranks.build(1)
    plain.load_state_dict({**state, "head.weight": state["tok.weight"]})
    assert [n for n in os.listdir(tmp_path)] == [f"model{suffix}"]  # no temporary left


def test_export_names_an_unknown_format(saved: Any, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="format: cannot tell from the name"):
        ck.export(saved[0], tmp_path / "model.npz")


def test_cli_inspect_verify_export(
    saved: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path, params = saved
    assert main(["inspect", path, "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["world_size"] == 2 and summary["optimizer"] == "torch.optim.adamw.AdamW"
    assert summary["params"] == len(params) and summary["extra"] == ["step", "world"]
    assert main(["inspect", path, "--tensors"]) == 0
    assert "params/blocks.0.mlp.0.weight  float32[67, 22]" in capsys.readouterr().out
    assert main(["verify", path]) == 0
    assert capsys.readouterr().out.startswith("OK ")
    assert main(["export", path, str(tmp_path / "m.safetensors")]) == 0
    assert set(safetensors.torch.load_file(tmp_path / "m.safetensors")) == set(params)
    assert main(["export", path, str(tmp_path / "dcp"), "--format", "dcp"]) == 0
    assert os.path.exists(tmp_path / "dcp" / ".metadata")


def test_cli_reports_damage_with_status_1(
    saved: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(saved[0], copy)
    victim = copy / "v000001" / "shard-00001.safetensors"
    victim.write_bytes(victim.read_bytes()[:-1])
    assert main(["verify", str(copy)]) == 1
    err = capsys.readouterr().err
    assert "shard-00001.safetensors" in err and "truncated" in err


def test_cli_export_onto_a_directory_is_a_clean_error(
    saved: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "out.safetensors"
    target.mkdir()
    assert main(["export", saved[0], str(target)]) == 2
    err = capsys.readouterr().err
    assert "is a directory; export writes one file" in err and "Traceback" not in err
    assert os.listdir(target) == [] and os.listdir(tmp_path) == ["out.safetensors"]
    with pytest.raises(ValueError, match="is a directory"):
        ck.export(saved[0], target)
    assert main(["export", saved[0], str(tmp_path / "no" / "m.safetensors")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_cli_export_refuses_an_unknown_suffix(
    saved: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "model.safetensor"  # a typo: this used to write a DCP directory
    assert main(["export", saved[0], str(out)]) == 2
    assert "cannot tell the format of" in capsys.readouterr().err
    assert not out.exists()
    assert main(["export", saved[0], str(out), "--format", "safetensors"]) == 0
    assert set(safetensors.torch.load_file(out)) == set(saved[1])


def test_python_m_entry_point(saved: Any) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "fsdp_ckpt", "verify", saved[0]],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0 and done.stdout.startswith("OK "), done.stderr


def test_keep_last_k_versions(tmp_path: Path) -> None:
    path = tmp_path / "run"
    model = ranks.build(0)
    for step in range(1, 5):
        with torch.no_grad():
            model.pos.fill_(step)
        ck.save(path, model, extra={"step": step}, keep_last=2)
    ck.wait_for_cleanup(path)  # superseded versions are deleted in the background
    assert sorted(os.listdir(path)) == ["CURRENT", "v000003", "v000004"]
    assert ck.inspect_checkpoint(path).versions == ("v000003", "v000004")
    assert ck.load(path, ranks.build(1)) == {"step": 4}
    older = ranks.build(1)
    assert ck.load(path / "v000003", older) == {"step": 3}
    assert torch.all(older.pos == 3)


def test_storage_interface_fits_fsspec(tmp_path: Path) -> None:
    storage = ck.FsspecStorage(fsspec.filesystem("memory"))
    root = f"/ckpt-{uuid.uuid4().hex}/run"
    model = ranks.build(0)
    opt = ranks.optimizer(model)
    ranks.plain_train(model, opt, 1, range(1))
    for step in (1, 2):
        ck.save(root, model, opt, extra={"step": step}, storage=storage)
    ck.wait_for_cleanup(root)
    assert storage.listdir(root) == ["CURRENT", "v000002"]
    assert ck.verify(root, storage=storage).versions == ("v000002",)
    other = ranks.build(1)
    assert ck.load(root, other, storage=storage) == {"step": 2}
    assert all(torch.equal(p, model.get_parameter(n)) for n, p in other.named_parameters())
    victim = f"{root}/v000002/shard-00000.safetensors"
    data = bytearray(storage.fs.cat_file(victim))
    data[-1] ^= 0xFF
    storage.fs.pipe_file(victim, bytes(data))
    with pytest.raises(ck.CheckpointCorruptError, match="checksum mismatch"):
        ck.load(root, other, storage=storage)
    data[-1] ^= 0xFF  # repaired
    storage.fs.pipe_file(victim, bytes(data))
    out = str(tmp_path / "model.safetensors")
    ck.export(root, out, storage=storage)  # ranged reads through the storage
    assert set(safetensors.torch.load_file(out)) == {n for n, _ in model.named_parameters()}
    storage.fs.rm(root.rsplit("/", 1)[0], recursive=True)


def test_export_makes_its_output_durable(
    saved: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After the rename into place, the output's directory is fsynced: a power loss right
    after `export` returns cannot lose the new name."""
    synced: list[str] = []
    original = ck.LocalStorage.sync_dir

    def record(self: Any, path: str) -> None:
        synced.append(os.path.abspath(path))
        original(self, path)

    monkeypatch.setattr(ck.LocalStorage, "sync_dir", record)
    out = tmp_path / "out" / "model.safetensors"
    out.parent.mkdir()
    ck.export(saved[0], str(out))
    assert str(out.parent) in synced, synced
