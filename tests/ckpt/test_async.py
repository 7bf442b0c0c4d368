"""Async save: the same files as a sync save of the same state while training goes on;
errors in the background writer surface in ``wait()`` on every rank."""

from __future__ import annotations

import os
from pathlib import Path

import fsdp_ckpt as ck
from fsdp_comm import launch

from . import ranks

TIMEOUT = 120


def _files(directory: str) -> dict[str, bytes]:
    return {name: Path(directory, name).read_bytes() for name in sorted(os.listdir(directory))}


def test_async_save_writes_the_same_files_as_sync(tmp_path: Path) -> None:
    sync_path, async_path = str(tmp_path / "sync"), str(tmp_path / "async")
    results = launch(
        ranks.sync_and_async, 2, backend="threads", args=(sync_path, async_path), timeout=TIMEOUT
    )
    assert results[0]["committed"] == os.path.join(async_path, "v000001")
    sync_files = _files(os.path.join(sync_path, "v000001"))
    async_files = _files(os.path.join(async_path, "v000001"))
    assert sorted(sync_files) == [
        "index.json",
        "shard-00000.safetensors",
        "shard-00001.safetensors",
    ]
    assert sync_files == async_files  # byte for byte, index included
    assert Path(sync_path, "CURRENT").read_bytes() == Path(async_path, "CURRENT").read_bytes()


def test_async_error_is_raised_by_wait_on_every_rank(tmp_path: Path) -> None:
    path = str(tmp_path / "run")
    outcomes = launch(ranks.async_failure, 2, backend="threads", args=(path,), timeout=TIMEOUT)
    assert outcomes[1].startswith("OSError") and "No space left" in outcomes[1]
    assert outcomes[0].startswith("CheckpointError") and "rank 1 failed to write" in outcomes[0]
    assert "shard-00001.safetensors" in outcomes[0] and "No space left" in outcomes[0]
    assert ck.load(path, ranks.build(1)) == {"step": 1}  # the previous checkpoint is intact
    assert ck.verify(path).directory.endswith("v000001")
    assert sorted(os.listdir(path)) == ["CURRENT", "v000001"]  # the staging directory removed


def test_sync_save_returns_a_finished_handle(tmp_path: Path) -> None:
    handle = ck.save(tmp_path / "c", ranks.build(0))
    assert handle.done() and handle.wait() == str(tmp_path / "c" / "v000001")
