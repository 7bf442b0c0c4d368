"""One writer per checkpoint path, one version per load.

A second job saving to a path is refused with an error naming the first (host, pid, start
time) and the committed checkpoint still loads; a dead holder's lock is taken over; a save
while an async save to the path is pending is refused; every rank of a load loads the version
rank 0 resolved; a reader racing commits loads one whole version and never reports corruption.
Writers that must be separate jobs run as processes (``backend="torch"``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import fsdp_ckpt as ck
import pytest
import torch
from fsdp_ckpt._lock import LEASE_ENV, Holder, Machine, SaveLock, read_holder, stale_reason
from fsdp_comm import Backend, launch
from fsdp_engine import full_parameters
from torch import nn

from . import ranks

TIMEOUT = 120
GATE_TIMEOUT = 60.0  # seconds a gated writer waits for the test to open the gate


# ---- helpers (module level: process ranks import them) -----------------------------------------
def shifted(step: int) -> nn.Module:
    """``ranks.build(0)`` with every parameter plus ``step``: each step's state is known."""
    model = ranks.build(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(float(step))
    return model


def check_step(model: nn.Module, step: int) -> None:
    for name, value in shifted(step).named_parameters():
        assert torch.equal(model.get_parameter(name), value), (name, step)


def _wait_for(path: Path, timeout: float = GATE_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout} s")
        time.sleep(0.02)


class GatedStorage(ck.LocalStorage):
    """Local storage that, before writing a tensor file, records its pid in ``gate/started``
    and waits for ``gate/go``: the save holds its path while the test acts."""

    def __init__(self, gate: str) -> None:
        super().__init__()
        self.gate = Path(gate)

    def open_write(self, path: str, *, durable: bool = True) -> Any:
        if path.endswith(".safetensors") and not (self.gate / "go").exists():
            (self.gate / "started.tmp").write_text(str(os.getpid()))
            os.replace(self.gate / "started.tmp", self.gate / "started")
            _wait_for(self.gate / "go")
        return super().open_write(path, durable=durable)


def gated_writer(be: Backend, path: str, gate: str) -> int:
    """Commit step 1; then save step 2 with rank 0 held at the gate. Returns the pid."""
    ck.save(path, shifted(1), extra={"step": 1}, backend=be)
    storage = GatedStorage(gate) if be.rank == 0 else None
    ck.save(path, shifted(2), extra={"step": 2}, backend=be, storage=storage)
    ck.wait_for_cleanup(path)  # launch ends the rank processes once they return
    return os.getpid()


def try_save(be: Backend, path: str, step: int) -> str:
    try:
        ck.save(path, shifted(step), extra={"step": step}, backend=be)
    except ck.CheckpointError as exc:
        return str(exc)
    return "no error"


# ---- two writers -------------------------------------------------------------------------------
def test_a_second_writer_is_refused_naming_the_holder(tmp_path: Path) -> None:
    path, gate = str(tmp_path / "run"), tmp_path / "gate"
    gate.mkdir()
    result: dict[str, Any] = {}

    def job_a() -> None:
        try:
            result["pids"] = launch(
                gated_writer,
                2,
                backend="torch",
                args=(path, str(gate)),
                timeout=TIMEOUT,
                threads_per_rank=1,
            )
        except BaseException as exc:  # reported by the assertions below
            result["error"] = exc

    thread = threading.Thread(target=job_a, daemon=True)
    thread.start()
    try:
        _wait_for(gate / "started")
        holder_pid = int((gate / "started").read_text())
        errors = launch(try_save, 2, backend="threads", args=(path, 3), timeout=TIMEOUT)
        model = ranks.build(1)
        assert ck.load(path, model) == {"step": 1}  # the committed checkpoint still loads
        check_step(model, 1)
    finally:
        (gate / "go").touch()
        thread.join(TIMEOUT)
    assert "error" not in result, result.get("error")
    assert result["pids"][0] == holder_pid
    holder = f"pid {holder_pid}, saving since "
    assert "refused" in errors[0] and "another save holds the lock" in errors[0]
    assert holder in errors[0] and os.uname().nodename in errors[0], errors[0]
    assert "rank 0 failed" in errors[1] and holder in errors[1], errors[1]
    model = ranks.build(1)
    assert ck.load(path, model) == {"step": 2}  # the first job's save committed, whole
    check_step(model, 2)
    assert sorted(os.listdir(path)) == ["CURRENT", "v000002"]  # and the lock is gone


# ---- stale and live locks ----------------------------------------------------------------------
_DIE_HOLDING = """
import os, signal, sys
from fsdp_ckpt import LocalStorage
from fsdp_ckpt._lock import SaveLock
SaveLock.acquire(LocalStorage(), sys.argv[1])
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_the_lock_of_a_dead_process_is_taken_over(tmp_path: Path) -> None:
    path = str(tmp_path / "run")
    ck.save(path, shifted(1), extra={"step": 1})
    child = subprocess.run(
        [sys.executable, "-c", _DIE_HOLDING, path], timeout=TIMEOUT, capture_output=True, text=True
    )
    assert child.returncode == -signal.SIGKILL, child.stderr
    dead = read_holder(ck.LocalStorage(), path)
    assert dead is not None and dead.pid != os.getpid()
    ck.save(path, shifted(2), extra={"step": 2})  # not refused: its holder is gone
    ck.wait_for_cleanup(path)
    assert sorted(os.listdir(path)) == ["CURRENT", "v000002"]
    assert ck.load(path, ranks.build(1)) == {"step": 2}


def _foreign_holder(renewed_ago: float) -> Holder:
    now = time.time()
    return Holder(
        Machine("elsewhere", "another-boot", "pid:[1]"),
        4242,
        "",
        "f" * 16,
        now - 3600,
        now - renewed_ago,
        60.0,
    )


def test_a_lock_from_another_host_holds_until_its_lease_runs_out(tmp_path: Path) -> None:
    path = tmp_path / "run"
    ck.save(path, shifted(1), extra={"step": 1})
    (path / ".lock").write_bytes(_foreign_holder(renewed_ago=5).to_bytes())
    with pytest.raises(ck.CheckpointError, match="another save holds the lock") as info:
        ck.save(path, shifted(2), extra={"step": 2})
    assert "host elsewhere, pid 4242, saving since" in str(info.value)
    assert ck.load(path, ranks.build(1)) == {"step": 1}
    (path / ".lock").write_bytes(_foreign_holder(renewed_ago=61).to_bytes())
    ck.save(path, shifted(2), extra={"step": 2})  # lease ran out: taken over
    assert ck.load(path, ranks.build(1)) == {"step": 2}
    assert not (path / ".lock").exists()


def test_a_one_rank_commit_takes_the_lock_like_a_save(tmp_path: Path) -> None:
    from fsdp_ckpt._directory import CheckpointDir
    from fsdp_ckpt._model_view import model_view
    from fsdp_ckpt._save import _plan, commit_one_rank

    path = tmp_path / "run"
    directory = CheckpointDir(ck.LocalStorage(), str(path))
    plan = _plan(model_view(shifted(4)), None, {"step": 4})
    assert commit_one_rank(directory, plan, keep_last=1) == str(path / "v000001")
    (path / ".lock").write_bytes(_foreign_holder(renewed_ago=5).to_bytes())
    with pytest.raises(ck.CheckpointError, match="another save holds the lock"):
        commit_one_rank(directory, plan, keep_last=1)
    assert ck.load(path, ranks.build(1)) == {"step": 4}


def test_a_holder_renews_its_lease_and_a_lost_lock_does_not_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(LEASE_ENV, "0.2")
    storage = ck.LocalStorage()
    lock = SaveLock.acquire(storage, str(tmp_path))
    try:
        time.sleep(0.6)
        holder = read_holder(storage, str(tmp_path))
        assert holder is not None and holder.token == lock.token
        assert holder.renewed > holder.started  # renewed by its thread
        seen = replace(holder, token="seen-from-another-process")  # not this process's own
        elsewhere = Machine("elsewhere", "", "")
        assert stale_reason(seen, time.time(), elsewhere) is None
        assert "lease ran out" in str(stale_reason(seen, time.time() + 5, elsewhere))
        (tmp_path / ".lock").write_bytes(_foreign_holder(0).to_bytes())  # taken over
        with pytest.raises(ck.CheckpointError, match="lost the lock .*host elsewhere"):
            lock.check()
    finally:
        lock.release()
    assert (tmp_path / ".lock").exists()  # another holder's lock is never deleted


# ---- async saves -------------------------------------------------------------------------------
def async_then_save(be: Backend, path: str) -> dict[str, Any]:
    handle = ck.save(path, shifted(1), extra={"step": 1}, backend=be, async_save=True)
    try:
        ck.save(path, shifted(2), extra={"step": 2}, backend=be)
        refused = "no error"
    except ck.CheckpointError as exc:
        refused = str(exc)
    committed = handle.wait()
    ck.save(path, shifted(2), extra={"step": 2}, backend=be)  # waited on: fine now
    return {"refused": refused, "committed": committed}


def test_a_save_while_an_async_save_is_pending_is_refused(tmp_path: Path) -> None:
    path = str(tmp_path / "run")
    out = launch(async_then_save, 2, backend="threads", args=(path,), timeout=TIMEOUT)
    for rank_out in out:
        assert "refused" in rank_out["refused"] and "still pending" in rank_out["refused"]
        assert "v000001" in rank_out["refused"] and "wait()" in rank_out["refused"]
    assert out[0]["committed"] == os.path.join(path, "v000001")
    model = ranks.build(1)
    assert ck.load(path, model) == {"step": 2}
    check_step(model, 2)


# ---- one version per load ----------------------------------------------------------------------
class HookedStorage(ck.LocalStorage):
    """Local storage that runs ``hook`` once, before the first read of a file whose name
    ends with ``trigger`` (and, for ``wait``, blocks such reads until ``event`` is set)."""

    def __init__(
        self, trigger: str, hook: Any = None, wait: threading.Event | None = None, times: int = 1
    ) -> None:
        super().__init__()
        self.trigger, self.hook, self.wait, self.left = trigger, hook, wait, times

    def _maybe(self, path: str) -> None:
        if not path.endswith(self.trigger):
            return
        if self.wait is not None:
            assert self.wait.wait(GATE_TIMEOUT), "the hook of the other rank never ran"
        if self.hook is not None and self.left > 0:
            self.left -= 1
            self.hook()

    def open_read(self, path: str) -> Any:
        self._maybe(path)
        return super().open_read(path)

    def read_all(self, path: str, size: int) -> torch.Tensor:
        self._maybe(path)
        return super().read_all(path, size)


def _commit(path: str, step: int, keep_last: int) -> None:
    ck.save(path, shifted(step), extra={"step": step}, keep_last=keep_last)
    ck.wait_for_cleanup(path)


def load_while_a_save_commits(be: Backend, path: str, event: threading.Event) -> dict[str, Any]:
    """Rank 0 resolves CURRENT; then a save commits step 2; rank 1 reads only after that."""
    if be.rank == 0:

        def hook() -> None:
            _commit(path, 2, keep_last=2)
            event.set()

        storage = HookedStorage("index.json", hook)
    else:
        storage = HookedStorage("CURRENT", wait=event)
    model = ranks.shard(ranks.build(1), be)
    extra = ck.load(path, model, storage=storage)
    return {"extra": extra, "params": full_parameters(model)}


def test_every_rank_loads_the_version_rank0_resolved(tmp_path: Path) -> None:
    path = str(tmp_path / "run")
    _commit(path, 1, keep_last=2)
    out = launch(
        load_while_a_save_commits,
        2,
        backend="threads",
        args=(path, threading.Event()),
        timeout=TIMEOUT,
    )
    assert [o["extra"] for o in out] == [{"step": 1}, {"step": 1}]
    for name, value in shifted(1).named_parameters():
        assert torch.equal(out[0]["params"][name], value), name
    assert ck.load(path, ranks.build(1)) == {"step": 2}  # the save did commit meanwhile


def test_a_reader_overtaken_by_commits_loads_the_newest_whole_version(tmp_path: Path) -> None:
    path = str(tmp_path / "run")
    _commit(path, 1, keep_last=1)
    # keep_last=1: each commit deletes the version the reader is in the middle of reading.
    storage = HookedStorage("index.json", lambda: _commit(path, 2, keep_last=1))
    data = HookedStorage(".safetensors", lambda: _commit(path, 3, keep_last=1))
    storage.read_all = data.read_all  # type: ignore[method-assign]
    model = ranks.build(1)
    assert ck.load(path, model, storage=storage) == {"step": 3}
    check_step(model, 3)


def commit_repeatedly(be: Backend, path: str, saves: int) -> int:
    for step in range(2, saves + 2):
        ck.save(path, shifted(step), extra={"step": step}, backend=be)
    return saves


class SlowReader(ck.LocalStorage):
    """Reads each tensor file 10 ms late: commits land between resolving and reading."""

    def read_all(self, path: str, size: int) -> torch.Tensor:
        time.sleep(0.01)
        return super().read_all(path, size)


def test_a_reader_racing_saves_never_reports_corruption(tmp_path: Path) -> None:
    path, saves = str(tmp_path / "run"), 40
    _commit(path, 1, keep_last=1)
    done = threading.Event()
    failure: list[BaseException] = []

    def writer() -> None:  # another process, committing with keep_last=1 as fast as it can
        try:
            launch(
                commit_repeatedly,
                1,
                backend="torch",
                args=(path, saves),
                timeout=TIMEOUT,
                threads_per_rank=1,
            )
        except BaseException as exc:  # reported below
            failure.append(exc)
        finally:
            done.set()

    threading.Thread(target=writer, daemon=True).start()
    steps, overtaken, model = [], 0, ranks.build(1)
    deadline = time.monotonic() + TIMEOUT
    while not done.is_set() and time.monotonic() < deadline:
        try:
            step = ck.load(path, model, storage=SlowReader())["step"]
        except ck.CheckpointCorruptError:
            raise  # a healthy checkpoint called corrupt: the bug this test is about
        except ck.CheckpointError as exc:  # overtaken on every attempt: said so, not corrupt
            assert "was replaced 3 times while being read" in str(exc), exc
            overtaken += 1
            continue
        check_step(model, step)  # parameters and extra from one version
        steps.append(step)
    assert not failure, failure
    # How often the reader is overtaken three times in a row depends on the machine's load
    # (CI under load: 8 of 32 attempts); that it is told so, never "corrupt", is the contract.
    assert steps and steps == sorted(steps), (steps, overtaken)
    assert ck.load(path, model) == {"step": saves + 1}
