"""Faults around the commit: the messages say what ``CURRENT`` names, a file changed after its
rank wrote it is never committed, the first save makes its directory durable, and after a
SIGKILL of rank 0 at any step of the commit the latest good checkpoint loads, the dead holder's
lock is taken over and the next save applies ``keep_last``.

No loadable checkpoint is lost, and every error names its cause.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import fsdp_ckpt as ck
import pytest
from fsdp_ckpt._lock import read_holder
from fsdp_comm import Backend, launch

from . import ranks
from .test_exclusive import check_step, shifted

TIMEOUT = 120


def _describe(exc: BaseException) -> str:
    return " ".join([f"{type(exc).__name__}: {exc}", *getattr(exc, "__notes__", [])])


# ---- what the messages say ---------------------------------------------------------------------
class FailingCommit(ck.LocalStorage):
    """Rank 0's storage, failing one step of the commit: renaming the staging directory
    ("publish"), or making the directory durable once CURRENT was replaced ("after-pointer")."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.where = where
        self.pointed = False

    def rename(self, src: str, dst: str) -> None:
        if self.where == "publish" and ".staging-" in src:
            raise OSError(5, "Input/output error (test)", src)
        super().rename(src, dst)
        self.pointed = self.pointed or dst.endswith("CURRENT")

    def sync_dir(self, path: str) -> None:
        if self.where == "after-pointer" and self.pointed:
            raise OSError(5, "Input/output error (test)", path)
        super().sync_dir(path)


class FullDisk(ck.LocalStorage):
    def open_write(self, path: str, *, durable: bool = True) -> Any:
        raise OSError(28, "No space left on device (test)", path)


def failing_second_save(be: Backend, path: str, where: str) -> str:
    ck.save(path, shifted(1), extra={"step": 1}, backend=be)
    storage: Any = None
    if where == "write" and be.rank == 1:
        storage = FullDisk()
    elif where != "write" and be.rank == 0:
        storage = FailingCommit(where)
    try:
        ck.save(path, ranks.build(0), extra={"step": 2}, backend=be, storage=storage)
    except Exception as exc:  # every rank fails; the assertions read the messages
        return _describe(exc)
    return "no error"


# (where the save fails, the step that loads afterwards, what each rank must say)
FAILURES = [
    (
        "write",
        1,
        ["abandoned: rank 1 failed to write its files", "No space left"],
        "CURRENT still names v000001, untouched by this save",
    ),
    ("publish", 1, ["OSError", "rank 0 failed"], "CURRENT still names v000001, untouched"),
    (
        "after-pointer",
        2,
        ["OSError", "rank 0 failed"],
        "commit point was passed: {path}/CURRENT names v000002, this save's version",
    ),
]


@pytest.mark.parametrize("where,step,causes,truth", FAILURES)
def test_after_a_failed_commit_every_rank_is_told_what_current_names(
    tmp_path: Path, where: str, step: int, causes: list[str], truth: str
) -> None:
    path = str(tmp_path / "run")
    messages = launch(
        failing_second_save, 2, backend="threads", args=(path, where), timeout=TIMEOUT
    )
    for rank, message in enumerate(messages):
        assert causes[rank] in message, (rank, message)
        assert truth.format(path=path) in message, (rank, message)
        assert "intact" not in message
    model = ranks.build(1)
    assert ck.load(path, model) == {"step": step}  # what the messages said
    if step == 1:
        check_step(model, 1)


# ---- a file changed after its rank wrote it ----------------------------------------------------
class _ChangedAfterClose:
    """A file whose last byte another writer changes right after it is closed (same size)."""

    def __init__(self, f: Any, path: str) -> None:
        self._f, self._path = f, path

    def write(self, data: Any) -> Any:
        return self._f.write(data)

    def close(self) -> None:
        self._f.close()
        with open(self._path, "r+b") as g:
            g.seek(-1, os.SEEK_END)
            last = g.read(1)
            g.seek(-1, os.SEEK_END)
            g.write(bytes([last[0] ^ 0xFF]))

    def __enter__(self) -> _ChangedAfterClose:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class SecondWriterStorage(ck.LocalStorage):
    def open_write(self, path: str, *, durable: bool = True) -> Any:
        f = super().open_write(path, durable=durable)
        return _ChangedAfterClose(f, path) if path.endswith(".safetensors") else f


def changed_file(be: Backend, path: str) -> str:
    ck.save(path, shifted(1), extra={"step": 1}, backend=be)
    storage = SecondWriterStorage() if be.rank == 0 else None
    try:
        ck.save(path, shifted(2), extra={"step": 2}, backend=be, storage=storage)
    except ck.CheckpointError as exc:
        return _describe(exc)
    return "no error"


def test_a_file_changed_after_its_rank_wrote_it_is_not_committed(tmp_path: Path) -> None:
    path = str(tmp_path / "run")
    messages = launch(changed_file, 2, backend="threads", args=(path,), timeout=TIMEOUT)
    for message in messages:
        assert re.search(
            r"\.staging-v000002-\w+/shard-00000\.safetensors: checksum mismatch", message
        ), message
        assert "v000002 was not committed" in message
        assert "still names v000001" in message
    model = ranks.build(1)
    assert ck.load(path, model) == {"step": 1}  # keep_last=1 did not delete the good one
    check_step(model, 1)


# ---- durability of the directory itself --------------------------------------------------------
class RecordingStorage(ck.LocalStorage):
    def __init__(self) -> None:
        super().__init__()
        self.synced: list[str] = []

    def sync_dir(self, path: str) -> None:
        self.synced.append(os.path.abspath(path))
        super().sync_dir(path)


def test_the_first_save_makes_the_new_directories_durable(tmp_path: Path) -> None:
    storage = RecordingStorage()
    ck.save(tmp_path / "a" / "b" / "run", ranks.build(0), storage=storage)
    for parent in (tmp_path, tmp_path / "a", tmp_path / "a" / "b"):
        assert str(parent) in storage.synced, storage.synced  # the entry of each new directory


# ---- SIGKILL of rank 0 at each step of the commit ----------------------------------------------
class CommitKiller(ranks.KillingStorage):
    """`ranks.KillingStorage` plus two points: "verify" (reading a file back for its CRC) and
    "release" (deleting the lock, while the superseded versions are being deleted)."""

    def read_all(self, path: str, size: int) -> Any:
        if self.point == "verify" and ".staging-" in path and path.endswith(".safetensors"):
            ranks._die()
        return super().read_all(path, size)

    def remove(self, path: str) -> None:
        if self.point == "release" and os.path.basename(path) == ".lock":
            ranks._die()
        super().remove(path)


def save_three_times_and_die(be: Backend, path: str, point: str) -> None:
    for step in (1, 2):
        ck.save(path, shifted(step), extra={"step": step}, backend=be, keep_last=2)
    storage = CommitKiller(point) if be.rank == 0 else None
    ck.save(path, shifted(3), extra={"step": 3}, backend=be, keep_last=2, storage=storage)


# (where rank 0 dies, the step that loads afterwards, the versions after the next save)
KILLS = [
    ("verify", 2, ["v000002", "v000003"]),
    ("index", 2, ["v000002", "v000003"]),
    ("version-rename", 2, ["v000002", "v000003"]),
    ("pointer", 2, ["v000002", "v000004"]),
    ("after-pointer", 3, ["v000003", "v000004"]),
    ("release", 3, ["v000003", "v000004"]),
]


@pytest.mark.parametrize("point,step,kept", KILLS)
def test_sigkill_of_rank0_in_the_commit_loses_nothing_and_keep_last_still_applies(
    tmp_path: Path, point: str, step: int, kept: list[str]
) -> None:
    path = str(tmp_path / "run")
    with pytest.raises(Exception, match="rank 0"):
        launch(
            save_three_times_and_die,
            2,
            backend="torch",
            args=(path, point),
            timeout=TIMEOUT,
            threads_per_rank=1,
        )
    dead = read_holder(ck.LocalStorage(), path)
    assert dead is not None and dead.pid != os.getpid(), point  # the dead holder's lock
    ck.verify(path)
    model = ranks.build(1)
    assert ck.load(path, model) == {"step": step}
    check_step(model, step)
    ck.save(path, shifted(9), extra={"step": 9}, keep_last=2)  # takes the stale lock over
    ck.wait_for_cleanup(path)
    assert sorted(os.listdir(path)) == ["CURRENT", *kept]  # leftovers gone, keep_last applied
    assert ck.load(path, ranks.build(1)) == {"step": 9}
    assert ck.load(os.path.join(path, kept[0]), ranks.build(1)) == {"step": step}
