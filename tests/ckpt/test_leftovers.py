"""Nothing an interrupted or failed save leaves is left for long, and failures name their
rank, file and cause (issue #30).

- Ranks killed before the vote leave a staging directory; rank 0 killed in the commit leaves
  ``.CURRENT.tmp-*``, a version renamed but never pointed to, versions beyond ``keep_last``.
  The next save that commits removes them before it returns, so a rank process ended right
  after it (as `launch` ends ranks once they returned) keeps none of them. Only the version
  that save itself pushed beyond ``keep_last`` may still be there, being deleted.
- A rank whose disk is full makes every rank raise naming that rank, the file and the cause,
  and the save removes its own staging directory (also when rank 0's disk fills in the commit).
- A load of a checkpoint with a damaged shard names the rank and the file on every rank and in
  the error `launch` raises in its caller.
- A save in progress is never touched by another save's cleanup: the other save is refused.

Crashes are real SIGKILLs of rank processes (``backend="torch"``); the rest runs on threads.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from pathlib import Path
from typing import Any

import fsdp_ckpt as ck
import pytest
from fsdp_comm import Backend, launch

from . import ranks

TIMEOUT = 120


def _what_the_user_sees(exc: BaseException) -> str:
    """The error's message and notes: what a traceback prints."""
    return "\n".join([f"{type(exc).__name__}: {exc}", *getattr(exc, "__notes__", [])])


def _processes(fn: Any, world: int, *args: Any) -> list[Any]:
    """``fn`` on ``world`` rank processes (gloo), as under torchrun."""
    return launch(fn, world, backend="torch", args=args, timeout=TIMEOUT, threads_per_rank=1)


def _dotfiles(names: list[str]) -> list[str]:
    return [n for n in names if n.startswith(".")]


# ---- the next save that commits removes every leftover before it returns -----------------------
class SlowRemove(ck.LocalStorage):
    """Deletions that take a while (a large version on a slow disk): what a save deletes after
    it returns is visibly not yet deleted when it returns."""

    def remove(self, path: str) -> None:
        time.sleep(0.5)
        super().remove(path)


def save_then_die(be: Backend, path: str, point: str, first: bool) -> None:
    """Save step 1 (when ``first``), then a save of step 2 that every rank dies in at
    ``point`` (`ranks.KillingStorage`)."""
    model = ranks.build(0)
    if first:
        ck.save(path, model, extra={"step": 1}, backend=be)
    ck.save(path, model, extra={"step": 2}, backend=be, storage=ranks.KillingStorage(point))


def save_and_list(be: Backend, path: str, step: int) -> list[str]:
    """Save (rank 0's deletions slow), and list the path the moment the save returns."""
    storage = SlowRemove() if be.rank == 0 else None
    ck.save(path, ranks.build(step), extra={"step": step}, backend=be, storage=storage)
    return sorted(os.listdir(path))


def _check_tidy(names: list[str], current: str, superseded: str) -> None:
    """Only CURRENT, the committed version and (being deleted) the one it superseded."""
    assert not _dotfiles(names), names  # no staging directory, temporary file or lock
    assert {"CURRENT", current} <= set(names) <= {"CURRENT", current, superseded}, names


def test_the_next_commit_removes_a_save_killed_before_its_vote(tmp_path: Path) -> None:
    path = str(tmp_path / "run")
    with pytest.raises(Exception, match="rank"):
        _processes(save_then_die, 2, path, "manifest", True)
    assert [n for n in os.listdir(path) if n.startswith(".staging-v000002-")]
    listed = _processes(save_and_list, 2, path, 3)
    _check_tidy(listed[0], current="v000002", superseded="v000001")
    _check_tidy(sorted(os.listdir(path)), current="v000002", superseded="v000001")
    assert ck.load(path, ranks.build(1)) == {"step": 3}


def test_the_next_commit_removes_what_rank_0_killed_in_the_commit_left(tmp_path: Path) -> None:
    path = str(tmp_path / "run")
    with pytest.raises(Exception, match="rank"):  # killed before CURRENT was replaced
        _processes(save_then_die, 1, path, "pointer", True)
    with pytest.raises(Exception, match="rank"):  # killed just after it was
        _processes(save_then_die, 1, path, "after-pointer", False)
    names = sorted(os.listdir(path))
    assert [n for n in names if n.startswith(".CURRENT.tmp-")], names
    # v000001 beyond keep_last, v000002 renamed but never pointed to, v000003 current
    assert {"v000001", "v000002", "v000003"} <= set(names), names
    listed = _processes(save_and_list, 2, path, 4)
    _check_tidy(listed[0], current="v000004", superseded="v000003")
    _check_tidy(sorted(os.listdir(path)), current="v000004", superseded="v000003")
    assert ck.load(path, ranks.build(1)) == {"step": 4}
    ck.save(path, ranks.build(5), extra={"step": 5})  # and the one left behind goes next
    ck.wait_for_cleanup(path)
    assert sorted(os.listdir(path)) == ["CURRENT", "v000005"]


# ---- a full disk: every rank names the rank, the file and the cause ----------------------------
class _FillingFile:
    """A file on a disk that fills after ``room`` bytes: ``write`` raises ENOSPC without a
    file name, as the operating system's does."""

    def __init__(self, f: Any, room: int) -> None:
        self._f, self._room = f, room

    def write(self, data: Any) -> int:
        size = memoryview(data).nbytes
        if size > self._room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self._room -= size
        return self._f.write(data)

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> _FillingFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class FullDisk(ck.LocalStorage):
    """Writes of files whose name starts with ``prefix`` fail with ENOSPC after 16 bytes."""

    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def open_write(self, path: str, *, durable: bool = True) -> Any:
        f = super().open_write(path, durable=durable)
        return _FillingFile(f, 16) if os.path.basename(path).startswith(self.prefix) else f


def full_disk_save(be: Backend, path: str, full_rank: int, prefix: str) -> str:
    model = ranks.shard(ranks.build(0), be)
    ck.save(path, model, extra={"step": 1})
    storage = FullDisk(prefix) if be.rank == full_rank else None
    try:
        ck.save(path, model, extra={"step": 2}, storage=storage)
    except Exception as exc:  # noqa: BLE001 - every rank fails; the test reads the messages
        return _what_the_user_sees(exc)
    return "no error"


# (the rank whose disk fills, the file it fails on, the file named)
FULL = [
    (1, "shard-", "shard-00001.safetensors"),  # a rank's tensor file
    (0, "shard-", "shard-00000.safetensors"),
    (0, "index.json", "index.json"),  # rank 0 in the commit, before the version is renamed
    (0, ".CURRENT.tmp", ".CURRENT.tmp-"),  # ... and after: the version is removed too
]


@pytest.mark.parametrize("full_rank,prefix,named", FULL)
def test_a_full_disk_is_named_on_every_rank_and_leaves_nothing(
    tmp_path: Path, full_rank: int, prefix: str, named: str
) -> None:
    path = str(tmp_path / "run")
    messages = launch(
        full_disk_save, 2, backend="threads", args=(path, full_rank, prefix), timeout=TIMEOUT
    )
    for rank, message in enumerate(messages):
        assert f"rank {full_rank}" in message, (rank, message)
        assert named in message and "No space left on device" in message, (rank, message)
        assert "CURRENT still names v000001" in message, (rank, message)
    assert sorted(os.listdir(path)) == ["CURRENT", "v000001"]  # removed by the save itself
    assert ck.load(path, ranks.build(1)) == {"step": 1}


def full_disk_raises(be: Backend, path: str) -> None:
    model = ranks.shard(ranks.build(0), be)
    ck.save(path, model, extra={"step": 1})
    ck.save(path, model, extra={"step": 2}, storage=FullDisk("shard-") if be.rank == 1 else None)


def test_launch_names_the_rank_and_file_of_a_full_disk(tmp_path: Path) -> None:
    path = str(tmp_path / "run")
    with pytest.raises(OSError) as info:  # rank processes: the error crosses a pipe
        _processes(full_disk_raises, 2, path)
    seen = _what_the_user_sees(info.value)
    assert "[rank 1]" in seen and "shard-00001.safetensors" in seen, seen
    assert info.value.errno == errno.ENOSPC
    assert sorted(os.listdir(path)) == ["CURRENT", "v000001"]


# ---- a damaged shard: every rank names the rank and the file -----------------------------------
@pytest.fixture(scope="module")
def damaged(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A checkpoint of two ranks whose rank 1 file has one byte flipped."""
    path = str(tmp_path_factory.mktemp("damaged") / "run")
    launch(ranks.train_and_save, 2, backend="threads", args=(path,), timeout=TIMEOUT)
    shard = Path(path, "v000001", "shard-00001.safetensors")
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    return path


def load_and_tell(be: Backend, path: str) -> str:
    model = ranks.shard(ranks.build(1), be)
    try:
        ck.load(path, model)
    except ck.CheckpointError as exc:
        return _what_the_user_sees(exc)
    return "no error"


def test_every_rank_names_the_rank_and_file_it_could_not_load(damaged: str) -> None:
    messages = launch(load_and_tell, 2, backend="threads", args=(damaged,), timeout=TIMEOUT)
    file = os.path.join(damaged, "v000001", "shard-00001.safetensors")
    for rank, message in enumerate(messages):
        assert "rank 1" in message and f"{file}: checksum mismatch" in message, (rank, message)
        assert "nothing was changed" in message, (rank, message)
    assert messages[0].startswith("CheckpointError: load of")
    assert messages[1].startswith("CheckpointCorruptError")


def load_raises(be: Backend, path: str) -> None:
    ck.load(path, ranks.shard(ranks.build(1), be))


def test_launch_raises_the_failing_rank_s_load_error_itself(damaged: str) -> None:
    # Rank processes: the error is pickled across a pipe, and used to arrive as a CommError.
    with pytest.raises(ck.CheckpointCorruptError) as info:
        _processes(load_raises, 2, damaged)
    seen = _what_the_user_sees(info.value)
    assert "[rank 1]" in seen and "shard-00001.safetensors: checksum mismatch" in seen, seen
    assert info.value.path.endswith("shard-00001.safetensors")


# ---- a save in progress is never another save's leftover ---------------------------------------
class Held(ck.LocalStorage):
    """A rank whose tensor file waits for ``go`` before it is written."""

    def __init__(self, writing: threading.Event, go: threading.Event) -> None:
        super().__init__()
        self.writing, self.go = writing, go

    def open_write(self, path: str, *, durable: bool = True) -> Any:
        if os.path.basename(path).startswith("shard-"):
            self.writing.set()
            assert self.go.wait(TIMEOUT)
        return super().open_write(path, durable=durable)


def held_save(be: Backend, path: str, storage: Any) -> None:
    ck.save(path, ranks.shard(ranks.build(3), be), extra={"step": 3}, storage=storage)


def test_a_save_in_progress_is_never_cleaned_up_by_another(tmp_path: Path) -> None:
    path = str(tmp_path / "run")
    ck.save(path, ranks.build(1), extra={"step": 1})
    writing, go = threading.Event(), threading.Event()
    group = threading.Thread(
        target=launch,
        args=(held_save, 2),
        kwargs={"backend": "threads", "args": (path, Held(writing, go)), "timeout": TIMEOUT},
    )
    group.start()
    try:
        assert writing.wait(TIMEOUT)
        staging = [n for n in os.listdir(path) if n.startswith(".staging-")]
        assert len(staging) == 1, staging
        with pytest.raises(ck.CheckpointError, match="another save holds the lock"):
            ck.save(path, ranks.build(2), extra={"step": 2})
        assert staging[0] in os.listdir(path)  # untouched
    finally:
        go.set()
        group.join(TIMEOUT)
    ck.wait_for_cleanup(path)
    assert sorted(os.listdir(path)) == ["CURRENT", "v000002"]
    assert ck.load(path, ranks.build(1)) == {"step": 3}
