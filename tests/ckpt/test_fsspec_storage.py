"""`FsspecStorage` (``fsdp-ckpt[fsspec]``): checkpoints on fsspec's "memory" file system (an
object store's semantics: no fsync, ``mv`` is copy + delete) and on its "file" file system
(local: fsync, ``os.replace``, hard-linked exclusive creates).

Save at world size 2 and load at 2 and 3 (threads), bit-identical parameters and AdamW state;
keep-last retention; verify and inspect (and damage they catch); a save that fails at chosen
writes, or halfway through the non-atomic directory rename of an object store, leaves the
previous checkpoint whole and the next save commits and tidies; URL paths pick
`FsspecStorage` by themselves and local paths never do; a clear error without fsspec;
exclusive creation; a FIFO refused on the local file system; fsync on the local one.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsdp_ckpt as ck
import pytest
import torch
from fsdp_ckpt._storage import storage_for
from fsdp_ckpt.cli import main
from fsdp_comm import launch

from . import ranks

fsspec = pytest.importorskip("fsspec")
from fsspec.implementations.memory import MemoryFileSystem  # noqa: E402

TIMEOUT = 120
KINDS = ["memory", "file"]


# ---- where a checkpoint goes -------------------------------------------------------------------
def _target(kind: str, tmp_path: Path) -> tuple[str, ck.Storage | None]:
    """memory: a ``memory://`` URL and no storage (chosen from the URL); file: a plain local
    path with an explicit FsspecStorage on fsspec's local file system."""
    if kind == "memory":
        return f"memory://fsdp-ckpt-{uuid.uuid4().hex}/run", None
    return str(tmp_path / "run"), ck.FsspecStorage(fsspec.filesystem("file"))


def _store(path: str, storage: ck.Storage | None) -> ck.Storage:
    return storage_for(path, storage)


def _drop(path: str) -> None:
    if path.startswith("memory://"):
        fs = fsspec.filesystem("memory")
        top = "memory://" + path.removeprefix("memory://").split("/", 1)[0]
        if fs.exists(top):
            fs.rm(top, recursive=True)


@pytest.fixture
def where(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, Any]]:
    path, storage = _target(request.param, tmp_path)
    yield path, storage
    ck.wait_for_cleanup(path)
    _drop(path)


# ---- rank functions ----------------------------------------------------------------------------
def train_and_save(be: Any, path: str, storage: Any) -> dict[str, Any]:
    model = ranks.shard(ranks.build(0), be)
    opt = ranks.optimizer(model)
    ranks.train(model, opt, be.rank, be.world_size, range(ranks.STEPS_BEFORE_SAVE))
    ck.save(path, model, opt, extra={"step": ranks.STEPS_BEFORE_SAVE}, storage=storage)
    return ranks.snapshot(be, model, opt)


def load_sharded(be: Any, path: str, storage: Any) -> dict[str, Any]:
    model = ranks.shard(ranks.build(1), be)
    opt = ranks.optimizer(model)
    extra = ck.load(path, model, opt, storage=storage)
    return {**ranks.snapshot(be, model, opt), "extra": extra}


def save_step(be: Any, path: str, storage: Any, step: int) -> None:
    """Train ``step`` steps from seed 0 and save: the state of step ``step``."""
    model = ranks.shard(ranks.build(0), be)
    opt = ranks.optimizer(model)
    ranks.train(model, opt, be.rank, be.world_size, range(step))
    ck.save(path, model, opt, extra={"step": step}, storage=storage)


def save_seed(be: Any, path: str, storage: Any, seed: int) -> None:
    """Save a model built from ``seed``, untrained (quick: no optimizer state)."""
    ck.save(path, ranks.shard(ranks.build(seed), be), extra={"seed": seed}, storage=storage)


def _assert_same_state(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> None:
    for name, value in want[0]["params"].items():
        assert torch.equal(got[0]["params"][name], value), name
    shapes = {n: p.shape for n, p in ranks.build(0).named_parameters()}
    opt_got = ranks.assemble_optimizer([r["optim"] for r in got], shapes)
    opt_want = ranks.assemble_optimizer([r["optim"] for r in want], shapes)
    assert opt_got.keys() == opt_want.keys() and opt_want
    for fqn, state in opt_want.items():
        for name, value in state.items():
            assert torch.equal(opt_got[fqn][name], value), (fqn, name)


def _plain_params(path: str, storage: Any) -> dict[str, torch.Tensor]:
    model = ranks.build(7)
    ck.load(path, model, storage=storage)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


# ---- round trip and reshard --------------------------------------------------------------------
@pytest.mark.parametrize("where", KINDS, indirect=True)
def test_save_at_2_load_at_2_and_3(where: tuple[str, Any]) -> None:
    path, storage = where
    want = launch(train_and_save, 2, backend="threads", args=(path, storage), timeout=TIMEOUT)
    store = _store(path, storage)
    assert isinstance(store, ck.FsspecStorage)
    assert store.listdir(path) == ["CURRENT", "v000001"]  # no lock, no staging left
    for world in (2, 3):
        got = launch(load_sharded, world, backend="threads", args=(path, storage), timeout=TIMEOUT)
        _assert_same_state(got, want)
        assert all(r["extra"] == {"step": ranks.STEPS_BEFORE_SAVE} for r in got)
    plain = _plain_params(path, storage)  # one process, no FSDP
    assert all(torch.equal(plain[n], v) for n, v in want[0]["params"].items())


@pytest.mark.parametrize("where", KINDS, indirect=True)
def test_keep_last_retention(where: tuple[str, Any]) -> None:
    path, storage = where
    store = _store(path, storage)
    model = ranks.build(0)
    for step in range(1, 5):
        with torch.no_grad():
            model.pos.fill_(step)
        ck.save(path, model, extra={"step": step}, keep_last=2, storage=storage)
    ck.wait_for_cleanup(path)
    assert store.listdir(path) == ["CURRENT", "v000003", "v000004"]
    assert ck.inspect_checkpoint(path, storage=storage).versions == ("v000003", "v000004")
    assert ck.load(path, ranks.build(1), storage=storage) == {"step": 4}
    older = ranks.build(1)
    assert ck.load(store.join(path, "v000003"), older, storage=storage) == {"step": 3}
    assert torch.all(older.pos == 3)


@pytest.mark.parametrize("where", KINDS, indirect=True)
def test_verify_and_inspect_catch_damage(where: tuple[str, Any], tmp_path: Path) -> None:
    path, storage = where
    store = _store(path, storage)
    launch(train_and_save, 2, backend="threads", args=(path, storage), timeout=TIMEOUT)
    info = ck.verify(path, storage=storage)
    assert info.world_size == 2 and info.versions == ("v000001",)
    assert {"shard-00000.safetensors", "shard-00001.safetensors"} <= set(info.files)
    summary = ck.inspect_checkpoint(path, storage=storage)
    assert summary.extra_keys == ("step",) and summary.optimizer.endswith("AdamW")
    victim = store.join(path, "v000001", "shard-00001.safetensors")
    with store.open_read(victim) as f:
        data = bytearray(f.read())
    data[-1] ^= 0xFF
    with store.open_write(victim) as f:
        f.write(bytes(data))
    with pytest.raises(ck.CheckpointCorruptError, match="checksum mismatch") as err:
        ck.verify(path, storage=storage)
    assert "shard-00001.safetensors" in str(err.value)
    ck.inspect_checkpoint(path, storage=storage)  # the index alone: still readable
    out = tmp_path / "model.safetensors"
    with pytest.raises(ck.CheckpointCorruptError):
        ck.export(path, str(out), storage=storage)


# ---- failures ----------------------------------------------------------------------------------
class _FailingFile:
    def __init__(self, inner: Any, tick: Any, name: str) -> None:
        self._inner, self._tick, self._name = inner, tick, name

    def write(self, data: Any, /) -> int | None:
        self._tick(f"write {self._name}")
        return self._inner.write(data)

    def close(self) -> None:
        self._inner.close()

    def __enter__(self) -> _FailingFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self._inner.close()


class FailingStorage(ck.FsspecStorage):
    """FsspecStorage raising OSError(EIO) at the ``fail_at``-th write of this save (every
    ``write`` of a file and every exclusive create count; ranks as threads share the count).
    ``fail_at=None`` counts only (``calls`` lists them)."""

    def __init__(self, fs: Any, fail_at: int | None = None) -> None:
        super().__init__(fs)
        self.fail_at = fail_at
        self.calls: list[str] = []
        self._lock = threading.Lock()

    def _tick(self, what: str) -> None:
        with self._lock:
            self.calls.append(what)
            if self.fail_at is not None and len(self.calls) == self.fail_at:
                raise OSError(errno.EIO, f"injected I/O error at write {self.fail_at} ({what})")

    def open_write(self, path: str, *, durable: bool = True) -> Any:
        return _FailingFile(
            super().open_write(path, durable=durable), self._tick, os.path.basename(path)
        )

    def create_exclusive(self, path: str, data: bytes = b"") -> None:
        self._tick(f"create {os.path.basename(path)}")
        super().create_exclusive(path, data)


class HalfRenameStorage(ck.FsspecStorage):
    """On an object store a directory rename is copy + delete: fail after copying half.
    ``crash``: nothing is deleted afterwards either (as if the process had died there)."""

    def __init__(self, fs: Any, *, crash: bool) -> None:
        super().__init__(fs)
        self.crash, self.crashed = crash, False

    def rename(self, src: str, dst: str) -> None:
        if not self.fs.isdir(self._p(src)):
            return super().rename(src, dst)
        files = sorted(self.fs.find(self._p(src)))
        for f in files[: max(1, len(files) // 2)]:
            self.fs.cp_file(f, self._p(dst) + f[len(self._p(src)) :])
        self.crashed = self.crash
        raise OSError(errno.EIO, "injected crash halfway through the directory copy")

    def remove(self, path: str) -> None:
        if self.crashed:
            raise OSError(errno.EIO, "the process died (test)")
        super().remove(path)


def _fs(kind: str) -> Any:
    return fsspec.filesystem(kind)


def _copy_tree(fs: Any, src: str, dst: str) -> None:
    for f in fs.find(src):
        target = dst + f[len(fs._strip_protocol(src)) :]
        fs.makedirs(target.rsplit("/", 1)[0], exist_ok=True)
        fs.cp_file(f, target)


@pytest.mark.parametrize("kind", KINDS)
def test_a_failed_save_leaves_the_previous_checkpoint_whole(kind: str, tmp_path: Path) -> None:
    fs = _fs(kind)
    base = f"/fsdp-ckpt-{uuid.uuid4().hex}" if kind == "memory" else str(tmp_path)
    clean = ck.FsspecStorage(fs)
    ref = f"{base}/ref"  # the previous checkpoint: trained one step, AdamW state included
    launch(save_step, 2, backend="threads", args=(ref, clean, 1), timeout=TIMEOUT)
    ck.wait_for_cleanup(ref)
    step1 = _plain_params(ref, clean)
    counter = FailingStorage(fs)
    launch(save_seed, 2, backend="threads", args=(f"{base}/count", counter, 2), timeout=TIMEOUT)
    first = len(counter.calls)
    counter.calls.clear()
    launch(save_seed, 2, backend="threads", args=(f"{base}/count", counter, 3), timeout=TIMEOUT)
    total = len(counter.calls)  # a second save to a path: the same calls as the first
    assert total == first and counter.calls[0] == "create .lock", counter.calls
    assert counter.calls[-4:-2] == ["create index.json", "write index.json"], counter.calls
    assert counter.calls[-1].startswith("write .CURRENT.tmp"), counter.calls
    # the lock, a rank's first claim, the middle, and the commit's last four writes
    for n in sorted({1, 2, total // 2, total - 3, total - 2, total - 1, total}):
        path = f"{base}/fail-{n}"
        _copy_tree(fs, ref, path)
        failing = FailingStorage(fs, fail_at=n)
        with pytest.raises((OSError, ck.CheckpointError), match="injected I/O error"):
            launch(save_seed, 2, backend="threads", args=(path, failing, 2), timeout=TIMEOUT)
        assert len(failing.calls) >= n
        info = ck.verify(path, storage=clean)  # the previous version, whole
        assert info.directory.endswith("v000001") and info.index.extra == {"step": 1}, n
        assert info.optimizer is not None
        got = _plain_params(path, clean)
        assert all(torch.equal(got[k], v) for k, v in step1.items()), n
        # the next save takes over (or finds free) the lock, commits, and tidies up
        launch(save_seed, 2, backend="threads", args=(path, clean, 3), timeout=TIMEOUT)
        ck.wait_for_cleanup(path)
        names = clean.listdir(path)
        assert names[0] == "CURRENT" and len(names) == 2, (n, names)
        assert ck.verify(path, storage=clean).index.extra == {"seed": 3}
    if kind == "memory":
        fs.rm(base, recursive=True)


def test_a_failure_halfway_through_an_object_store_rename_removes_the_partial_copy() -> None:
    fs = _fs("memory")
    path = f"/fsdp-ckpt-{uuid.uuid4().hex}/run"
    clean = ck.FsspecStorage(fs)
    launch(save_seed, 2, backend="threads", args=(path, clean, 1), timeout=TIMEOUT)
    failing = HalfRenameStorage(fs, crash=False)
    with pytest.raises((OSError, ck.CheckpointError), match="halfway"):
        launch(save_seed, 2, backend="threads", args=(path, failing, 2), timeout=TIMEOUT)
    assert clean.listdir(path) == ["CURRENT", "v000001"]  # the failed save removed its copy
    assert ck.verify(path, storage=clean).index.extra == {"seed": 1}
    fs.rm(path.rsplit("/", 1)[0], recursive=True)


@pytest.mark.filterwarnings("ignore:could not delete:RuntimeWarning")
def test_a_crash_halfway_through_an_object_store_rename_is_harmless() -> None:
    fs = _fs("memory")
    path = f"/fsdp-ckpt-{uuid.uuid4().hex}/run"
    clean = ck.FsspecStorage(fs)
    launch(save_seed, 2, backend="threads", args=(path, clean, 1), timeout=TIMEOUT)
    seed1 = _plain_params(path, clean)
    crashing = HalfRenameStorage(fs, crash=True)
    with pytest.raises((OSError, ck.CheckpointError), match="halfway"):
        launch(save_seed, 2, backend="threads", args=(path, crashing, 2), timeout=TIMEOUT)
    names = clean.listdir(path)
    assert "v000002" in names  # the partial copy: nothing points to it
    assert ck.verify(path, storage=clean).index.extra == {"seed": 1}
    got = _plain_params(path, clean)
    assert all(torch.equal(got[k], v) for k, v in seed1.items())
    with pytest.raises(ck.CheckpointCorruptError, match="missing"):  # by name: loudly
        ck.load(f"{path}/v000002", ranks.build(1), storage=clean)
    launch(save_seed, 2, backend="threads", args=(path, clean, 3), timeout=TIMEOUT)
    ck.wait_for_cleanup(path)
    assert clean.listdir(path) == ["CURRENT", "v000003"]  # numbered above, partial deleted
    assert ck.verify(path, storage=clean).index.extra == {"seed": 3}
    fs.rm(path.rsplit("/", 1)[0], recursive=True)


# ---- URLs --------------------------------------------------------------------------------------
def test_url_paths_pick_fsspec_and_local_paths_do_not(tmp_path: Path) -> None:
    assert type(storage_for(str(tmp_path), None)) is ck.LocalStorage
    assert type(storage_for("relative/run", None)) is ck.LocalStorage
    assert type(storage_for(tmp_path, None)) is ck.LocalStorage
    own = ck.LocalStorage()
    assert storage_for("memory://x", own) is own  # an explicit storage wins
    mem = storage_for("memory://x", None)
    assert isinstance(mem, ck.FsspecStorage) and not mem.local
    local = storage_for(f"file://{tmp_path}/run", None)
    assert isinstance(local, ck.FsspecStorage) and local.local

    root = f"fsdp-ckpt-{uuid.uuid4().hex}"
    url = f"memory://{root}/run"
    model = ranks.build(0)
    ck.save(url, model, extra={"step": 1})
    assert fsspec.filesystem("memory").exists(f"/{root}/run/CURRENT")
    assert ck.verify(url).index.extra == {"step": 1}
    assert ck.inspect_checkpoint(url).versions == ("v000001",)
    assert main(["verify", url]) == 0  # the command line takes URLs too
    other = ranks.build(1)
    assert ck.load(url, other) == {"step": 1}
    assert all(torch.equal(p, model.get_parameter(n)) for n, p in other.named_parameters())
    out = tmp_path / "model.safetensors"
    ck.export(url, str(out))
    assert out.stat().st_size > 0
    ck.wait_for_cleanup(url)
    fsspec.filesystem("memory").rm(f"/{root}", recursive=True)

    # file:// saves real files: LocalStorage reads them by their plain path, and back
    ck.save(f"file://{tmp_path}/run", model, extra={"step": 2})
    assert (tmp_path / "run" / "CURRENT").is_file()
    assert ck.load(str(tmp_path / "run"), ranks.build(1)) == {"step": 2}
    ck.save(str(tmp_path / "run"), model, extra={"step": 3})
    assert ck.load(f"file://{tmp_path}/run", ranks.build(1)) == {"step": 3}
    ck.wait_for_cleanup(str(tmp_path / "run"))
    ck.wait_for_cleanup(f"file://{tmp_path}/run")

    with pytest.raises(ValueError, match="not a path of this storage"):
        ck.FsspecStorage(fsspec.filesystem("memory")).exists("s3://bucket/run")


def test_without_fsspec_urls_name_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "fsspec", None)  # `import fsspec` raises ImportError
    model = ranks.build(0)
    with pytest.raises(ImportError, match=r"pip install 'fsdp-ckpt\[fsspec\]'"):
        ck.save("memory://nowhere/run", model)
    with pytest.raises(ImportError, match=r"fsdp-ckpt\[fsspec\]"):
        ck.FsspecStorage("memory")
    ck.save(str(tmp_path / "run"), model, extra={"step": 1})  # local paths need no fsspec
    assert ck.load(str(tmp_path / "run"), ranks.build(1)) == {"step": 1}
    ck.wait_for_cleanup(str(tmp_path / "run"))


def test_constructor_forms(tmp_path: Path) -> None:
    assert ck.FsspecStorage("memory").fs is fsspec.filesystem("memory")
    assert ck.FsspecStorage("memory://anything").fs is fsspec.filesystem("memory")
    assert ck.FsspecStorage("file").local
    with pytest.raises(TypeError, match="storage_options"):
        ck.FsspecStorage(fsspec.filesystem("memory"), anon=True)
    with pytest.raises(TypeError, match="fs_or_url"):
        ck.FsspecStorage(3)
    assert "MemoryFileSystem" in repr(ck.FsspecStorage("memory"))


# ---- exclusive creation, special files, durability ---------------------------------------------
class _NoExclusiveMemory(MemoryFileSystem):
    """A file system that rejects mode "xb" (as older fsspec back-ends do)."""

    protocol = "noxmemory"
    store: dict[str, Any] = {}
    pseudo_dirs = [""]

    def _open(self, path: str, mode: str = "rb", *args: Any, **kwargs: Any) -> Any:
        if "x" in mode:
            raise ValueError(f"unsupported file mode for {type(self).__name__}: {mode!r}")
        return super()._open(path, mode, *args, **kwargs)


@pytest.mark.parametrize("kind", ["memory", "file", "no-xb"])
def test_create_exclusive(kind: str, tmp_path: Path) -> None:
    fs = _NoExclusiveMemory() if kind == "no-xb" else _fs(kind)
    store = ck.FsspecStorage(fs)
    base = str(tmp_path) if kind == "file" else f"/fsdp-ckpt-{uuid.uuid4().hex}"
    store.makedirs(base)
    assert store.exclusive_create == ("atomic" if kind == "file" else "unknown")
    store.create_exclusive(f"{base}/a", b"first")
    with pytest.raises(FileExistsError):
        store.create_exclusive(f"{base}/a", b"second")
    with store.open_read(f"{base}/a") as f:
        assert f.read() == b"first"
    assert store.exclusive_create == ("check-then-write" if kind == "no-xb" else "atomic")
    # a whole save and load on the weaker store
    model = ranks.build(0)
    ck.save(f"{base}/run", model, extra={"step": 1}, storage=store)
    assert ck.load(f"{base}/run", ranks.build(1), storage=store) == {"step": 1}
    ck.wait_for_cleanup(f"{base}/run")
    if kind != "file":
        fs.rm(base, recursive=True)


def test_a_fifo_is_refused_on_the_local_file_system(tmp_path: Path) -> None:
    """A FIFO named CURRENT would block a reader that opened it: refused first (subprocess
    with a timeout, so a regression fails instead of hanging)."""
    run = tmp_path / "run"
    run.mkdir()
    os.mkfifo(run / "CURRENT")
    code = (
        "import fsdp_ckpt as ck, torch, sys\n"
        "s = ck.FsspecStorage('file')\n"
        "try:\n"
        f"    ck.load({str(run)!r}, torch.nn.Linear(2, 2), storage=s)\n"
        "except ck.CheckpointCorruptError as e:\n"
        "    print('refused:', e); sys.exit(0)\n"
        "sys.exit(1)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "is a FIFO, not a regular file" in out.stdout


def test_local_file_system_fsyncs_files_and_directories(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    synced: list[str] = []
    real = os.fsync

    def record(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", record)
    path = str(tmp_path / "run")
    ck.save(path, ranks.build(0), storage=ck.FsspecStorage("file"))
    ck.wait_for_cleanup(path)
    names = {os.path.basename(p) for p in synced}
    assert "shard-00000.safetensors" in names and "index.json" in names, names
    assert any(n.startswith(".CURRENT.tmp") for n in names), names
    assert path in synced and str(tmp_path) in synced, synced  # the new entries' directories
    assert any(os.path.basename(p).startswith(".staging-") for p in synced), synced


def test_memory_file_system_needs_no_fsync(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(os, "fsync", calls.append)
    path = f"memory://fsdp-ckpt-{uuid.uuid4().hex}/run"
    ck.save(path, ranks.build(0))
    ck.wait_for_cleanup(path)
    assert calls == []
    _drop(path)
