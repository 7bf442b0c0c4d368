"""`save`: every rank writes the slices it holds, then one agreement commits the version.

No data moves between ranks: rank r writes ``shard-0000r.safetensors`` (its parameter slices and
optimizer state) and ``rank-0000r.json`` (its part of the index) into the staging directory,
rank 0 also ``common.safetensors`` (buffers, large tensors of ``extra``). Before that, rank 0
takes the path's lock (Note [save lock] in ``_lock.py``) and names the version and a staging
directory of this save's own; after it, the two-phase agreement of `_agreement` and rank 0's
commit of `_directory`. Every message after a failure says what ``CURRENT`` names then.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, NoReturn

import torch
from torch import nn

from ._agreement import Failures, from_rank0, vote
from ._args import check_bool, check_keep_last, check_path, check_storage
from ._directory import POINTER_FILE, CheckpointDir, SaveStart, claim, manifest_name, write_small
from ._errors import CheckpointError, add_note, naming
from ._index import Chunk, Index, TensorEntry
from ._lock import SaveLock
from ._model_view import ModelView, model_view
from ._optim_state import collect_optimizer
from ._paths import show
from ._storage import LocalStorage, Storage, storage_for
from ._tensor_file import TensorSource, dtype_name, write_tensors
from ._values import encode_value
from ._version import __version__

__all__ = ["save", "SaveHandle", "COMMON_FILE", "shard_file", "commit_one_rank"]

COMMON_FILE = "common.safetensors"
_METADATA = {"format": "pt", "writer": f"fsdp-ckpt {__version__}"}
_log = logging.getLogger("fsdp.ckpt")


def shard_file(rank: int) -> str:
    """The tensor file rank ``rank`` writes."""
    return f"shard-{rank:05d}.safetensors"


@dataclass(frozen=True)
class _RankWrite:
    """What one rank writes: tensor files (name -> key -> tensor) and its part of the index."""

    files: Mapping[str, Mapping[str, TensorSource]]
    part: Index


def _param_entries(
    view: ModelView, file: str, tensors: dict[str, TensorSource]
) -> dict[str, TensorEntry]:
    entries = {}
    for piece in view.pieces:
        if not piece.writes:
            continue
        chunks: tuple[Chunk, ...] = ()
        if piece.length:
            key = f"param/{piece.fqn}"
            tensors[key] = piece.local
            chunks = (piece.chunk(file, key),)
        entries[piece.fqn] = TensorEntry(piece.global_shape, dtype_name(piece.dtype), chunks)
    return entries


def _common(
    view: ModelView, extra: Any, tensors: dict[str, TensorSource]
) -> tuple[dict[str, TensorEntry], Any]:
    buffers = {}
    for fqn, buf in view.buffers.items():
        key = f"buffer/{fqn}"
        tensors[key] = buf.detach()
        chunks = (Chunk(COMMON_FILE, key, 0, buf.numel()),) if buf.numel() else ()
        buffers[fqn] = TensorEntry(tuple(buf.shape), dtype_name(buf.dtype), chunks)

    def external(t: torch.Tensor) -> dict[str, Any]:
        key = f"extra/{len(tensors)}"
        tensors[key] = t.detach()
        return {
            "dtype": dtype_name(t.dtype),
            "shape": list(t.shape),
            "file": COMMON_FILE,
            "key": key,
        }

    return buffers, encode_value(extra, where="extra", external=external)


def _plan(view: ModelView, optimizer: Any, extra: Any) -> _RankWrite:
    shard, common = shard_file(view.rank), {}
    tensors: dict[str, TensorSource] = {}
    params = _param_entries(view, shard, tensors)
    section = None
    if optimizer is not None:
        opt_tensors, section = collect_optimizer(optimizer, view, file=shard)
        tensors.update(opt_tensors)
    # Every rank encodes extra so a bad value fails on every rank alike; rank 0 stores it.
    common_tensors: dict[str, TensorSource] = {}
    buffers, encoded = _common(view, extra, common_tensors)
    if view.rank == 0:
        common = {COMMON_FILE: common_tensors} if common_tensors else {}
    else:
        buffers, encoded = {}, None
    files = {**({shard: tensors} if tensors else {}), **common}
    part = Index(view.world_size, {}, params, buffers, section, encoded, __version__)
    return _RankWrite(files, part)


def _host_copy(t: TensorSource) -> TensorSource:
    if not isinstance(t, torch.Tensor):
        return t
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
    out.copy_(t.detach(), non_blocking=t.is_cuda)
    return out


def _snapshot(plan: _RankWrite) -> _RankWrite:
    """Copies in host memory, so training may change the model while the files are written."""
    files = {
        name: {k: _host_copy(t) for k, t in tensors.items()} for name, tensors in plan.files.items()
    }
    # torch.cuda.is_initialized has no annotations in torch's source
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        torch.cuda.synchronize()
    return replace(plan, files=files)


def _write(
    storage: Storage, staging: str, rank: int, plan: _RankWrite, *, exclusive: bool = False
) -> int:
    """Write this rank's files into ``staging``; return the tensor files' bytes.
    ``exclusive``: rank 0 created ``staging`` for this save alone, and every file is claimed
    before it is written (a straggler of another save, or a second process with this rank,
    fails instead of mixing its bytes in)."""
    if not exclusive:
        storage.makedirs(staging)

    def target(name: str) -> str:
        path = storage.join(staging, name)
        if exclusive:
            claim(storage, path)
        return path

    digests = {}
    for name, tensors in plan.files.items():
        path = target(name)
        with naming(path):
            digests[name] = write_tensors(storage, path, tensors, metadata=_METADATA)
    part = replace(plan.part, files=digests)
    # The manifest need not survive a power loss: rank 0 reads it (after close, so it sees it)
    # only to build index.json, which is fsynced; a crash before that discards the save anyway.
    write_small(storage, target(manifest_name(rank)), part.to_json().encode(), durable=False)
    return sum(d.size for d in digests.values())


class SaveHandle:
    """What `save` returns. A synchronous save is already committed; an async one commits in
    `wait`, which every rank must call (it holds the save's agreement, a collective)."""

    def __init__(self, finish: Any, thread: threading.Thread | None) -> None:
        self._finish = finish
        self._thread = thread
        self._result: str | None = None
        self._error: BaseException | None = None
        self._finished = False

    def done(self) -> bool:
        """True once this rank's files are written (async) or the save is committed (sync)."""
        return self._finished or self._thread is None or not self._thread.is_alive()

    def wait(self) -> str:
        """Finish the save: join the writer, agree across ranks, commit. Returns the committed
        version directory; re-raises a failure of this or (as CheckpointError) another rank."""
        if not self._finished:
            if self._thread is not None:
                self._thread.join()
            try:
                self._result = self._finish()
            except BaseException as exc:
                self._error = exc
            self._finished = True
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result

    @property
    def path(self) -> str | None:
        """The committed version directory (None until committed)."""
        return self._result


# Async saves of this process not yet waited on, by (checkpoint path, rank) -> version: a new
# save to the path would race their commit (and the lock they hold), so it is refused.
_PENDING: dict[tuple[str, int], str] = {}
_PENDING_LOCK = threading.Lock()


def _pending_key(directory: CheckpointDir, rank: int) -> tuple[str, int]:
    local = isinstance(directory.storage, LocalStorage)
    return (os.path.abspath(directory.root) if local else directory.root, rank)


def _refuse_if_pending(directory: CheckpointDir, rank: int) -> None:
    with _PENDING_LOCK:
        version = _PENDING.get(_pending_key(directory, rank))
    if version is not None:
        raise CheckpointError(
            f"save to {directory.root} refused: an async save to it from this process "
            f"({version}) is still pending; call wait() on its SaveHandle, on every rank, "
            "before saving to this path again"
        )


def _begin(directory: CheckpointDir, view: ModelView) -> tuple[SaveLock | None, SaveStart]:
    """Rank 0 takes the path's lock, chooses the version and creates a staging directory of
    this save's own; every rank learns them (Note [save lock] in ``_lock.py``)."""
    held: list[SaveLock] = []

    def produce() -> bytes:
        directory.make_root()
        lock = SaveLock.acquire(directory.storage, directory.root)
        held.append(lock)
        return directory.begin(lock.token).to_bytes()

    try:
        data = from_rank0(view.backend, produce, f"save to {directory.root}")
    except BaseException:
        for lock in held:
            lock.release()
        raise
    return (held[0] if held else None), SaveStart.from_bytes(data)


def commit_one_rank(directory: CheckpointDir, plan: _RankWrite, keep_last: int) -> str:
    """Write and commit a one-rank checkpoint (a conversion such as `from_dcp`) the way `save`
    does: under the path's lock, into a staging directory of its own. Returns the version."""
    directory.make_root()
    lock = SaveLock.acquire(directory.storage, directory.root)
    try:
        start = directory.begin(lock.token)
        try:
            _write(directory.storage, start.staging, 0, plan, exclusive=True)
            return directory.commit(start.version, 1, keep_last, staging=start.staging, lock=lock)
        except BaseException:
            directory.abandon(start, lock)
            raise
    finally:
        lock.release()


@dataclass
class _SaveJob:
    """One save in progress on one rank (rank 0 holds the path's lock until it finishes)."""

    directory: CheckpointDir
    start: SaveStart
    view: ModelView
    keep_last: int
    lock: SaveLock | None
    error: BaseException | None = None
    started: float = field(default_factory=time.perf_counter)
    written: int = 0  # bytes of this rank's tensor files

    @property
    def version(self) -> str:
        return self.start.version

    def run(self, plan_fn: Any) -> None:
        try:
            rank_write = plan_fn()
            self.written = _write(
                self.directory.storage,
                self.start.staging,
                self.view.rank,
                rank_write,
                exclusive=True,
            )
        except Exception as exc:  # reported through the vote, then re-raised by finish()
            self.error = exc

    def finish(self) -> str:
        try:
            return self._finish()
        finally:
            if self.lock is not None:
                self.lock.release()
            with _PENDING_LOCK:
                _PENDING.pop(_pending_key(self.directory, self.view.rank), None)

    def _finish(self) -> str:
        where = f"save of {self.directory.root} ({self.version})"
        try:
            failures = vote(self.view.backend, self.error)
            if failures is None:  # rank 0 commits; its error, with what CURRENT names then,
                from_rank0(self.view.backend, self._commit, where)  # reaches every rank
        except BaseException:
            self._abandon()
            raise
        if failures is not None:
            self._abandon()
            self._raise_failed(where, failures)
        _log.info(
            "saved %s (%s): %d bytes written by this rank in %.2f s",
            self.directory.root,
            self.version,
            self.written,
            time.perf_counter() - self.started,
        )
        return self.directory.storage.join(self.directory.root, self.version)

    def _abandon(self) -> None:
        """Rank 0 (the lock's holder): this save did not commit, remove what it wrote."""
        if self.lock is not None:
            self.directory.abandon(self.start, self.lock)

    def _raise_failed(self, where: str, failures: Failures) -> NoReturn:
        """Raise, on every rank, an error naming the ranks that failed to write, their files
        and the causes: this rank's own error when it failed, else a `CheckpointError`."""
        untouched = self._untouched()
        if self.error is not None:
            note = f"{where} abandoned"
            if self.view.world_size > 1:
                note += (
                    f" on every rank: {failures.who()} failed to write {failures.its()} files "
                    f"(this is rank {self.view.rank})"
                )
            if len(failures.ranks) > 1:
                note += f": {failures.describe()}"
            add_note(self.error, f"{note}; {untouched}")
            raise self.error
        raise CheckpointError(
            f"{where} abandoned: {failures.who()} failed to write {failures.its()} files "
            f"{failures.raised_there()}: {failures.describe()}; {untouched}"
        )

    def _untouched(self) -> str:
        if self.start.previous is None:
            return f"nothing was committed; {self.directory.root} holds no checkpoint yet"
        pointer = self.directory.storage.join(self.directory.root, POINTER_FILE)
        return (
            f"nothing was committed; {pointer} still names {self.start.previous}, "
            "untouched by this save"
        )

    def _commit(self) -> bytes:
        try:
            self.directory.commit(
                self.version,
                self.view.world_size,
                self.keep_last,
                staging=self.start.staging,
                lock=self.lock,
            )
        except Exception as exc:
            who = " (this rank)" if self.view.world_size > 1 else ""
            add_note(
                exc,
                f"save of {self.directory.root} ({self.version}): its commit on rank 0{who} "
                f"failed. {self._after_failed_commit()}",
            )
            raise
        _log.debug(
            "committed %s as the current version of %s (%d ranks, keep_last %d)",
            self.version,
            self.directory.root,
            self.view.world_size,
            self.keep_last,
        )
        return b""

    def _after_failed_commit(self) -> str:
        """What is true after rank 0's commit failed: read CURRENT again rather than assume."""
        pointer = self.directory.storage.join(self.directory.root, POINTER_FILE)
        try:
            now = self.directory.current()
        except Exception as exc:
            return (
                f"Afterwards {pointer} could not be read ({exc}): check the checkpoint "
                f"with `python -m fsdp_ckpt verify {self.directory.root}`."
            )
        if now == self.version:
            return (
                f"The commit point was passed: {pointer} names {self.version}, this save's "
                "version, which is complete (every file was verified before the pointer "
                "moved); the steps after it did not finish, so the pointer may not survive "
                "a power loss and superseded versions were kept."
            )
        if now is not None and now == self.start.previous:
            return f"Nothing was committed: {pointer} still names {now}, untouched by this save."
        if now is None:
            return f"Nothing was committed: {self.directory.root} holds no checkpoint yet."
        return f"This save committed nothing: {pointer} names {now}."


def _check_args(path: Any, extra: Any, async_save: Any, keep_last: Any, storage: Any) -> None:
    where = check_path(path)
    if extra is not None and not isinstance(extra, Mapping):
        raise TypeError(f"extra must be a dict or None, got {type(extra).__name__} {show(extra)}")
    check_bool(async_save, "async_save")
    check_keep_last(keep_last)
    check_storage(storage)
    if storage is None and os.path.exists(where) and not os.path.isdir(where):
        raise ValueError(
            f"path must be a checkpoint directory (or not exist yet), got {where!r}: a file"
        )


def save(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    extra: Mapping[str, Any] | None = None,
    async_save: bool = False,
    keep_last: int = 1,
    backend: Any = None,
    storage: Storage | None = None,
) -> SaveHandle:
    """Save ``model`` (and ``optimizer``, and ``extra``) to the checkpoint path ``path``.

    Every rank calls it. Each rank writes only the parameter slices and optimizer state it
    holds; the collectives are small agreements (no tensor data moves). The new version
    replaces the previous one atomically (a crash at any moment leaves the previous one
    loadable); ``keep_last`` versions are kept. One save at a time per path: rank 0 holds the
    path's lock (``P/.lock``) until the commit, and a save from another job meanwhile, or from
    this process while an async save to the path is not yet waited on, raises
    `CheckpointError` naming the holder; a dead holder's lock is taken over. ``extra``: small
    user data (JSON values and tensors such as RNG states), rank 0's is saved. ``async_save``:
    snapshot to host memory, write in a background thread; call ``handle.wait()`` on every
    rank to commit. ``backend``: the fsdp_comm backend spanning every rank (found in a
    sharded model; needed for a plain model replicated over ranks).
    ``storage``: where files go (default: the local file system).
    """
    _check_args(path, extra, async_save, keep_last, storage)
    view = model_view(model, backend=backend)
    store = storage_for(path, storage)
    directory = CheckpointDir(store, os.fspath(path))
    _refuse_if_pending(directory, view.rank)
    lock, start = _begin(directory, view)
    job = _SaveJob(directory, start, view, keep_last, lock)
    if not async_save:
        job.run(lambda: _plan(view, optimizer, extra))
        handle = SaveHandle(job.finish, None)
        handle.wait()
        return handle
    with _PENDING_LOCK:
        _PENDING[_pending_key(directory, view.rank)] = start.version
    try:
        snapshot = _snapshot(_plan(view, optimizer, extra))
    except Exception as exc:
        job.error = exc
        return SaveHandle(job.finish, None)
    thread = threading.Thread(
        target=job.run,
        args=(lambda: snapshot,),
        daemon=True,
        name=f"fsdp-ckpt-save-rank{view.rank}",
    )
    thread.start()
    return SaveHandle(job.finish, thread)
