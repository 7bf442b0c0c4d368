"""`save`: every rank writes the slices it holds, then one agreement commits the version.

No data moves between ranks: rank r writes ``shard-0000r.safetensors`` (its parameter slices and
optimizer state) and ``rank-0000r.json`` (its part of the index) into the staging directory,
rank 0 also ``common.safetensors`` (buffers, large tensors of ``extra``). Then the two-phase
agreement of `_agreement` and rank 0's commit of `_directory`.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from ._agreement import all_succeeded, commit_outcome
from ._directory import CheckpointDir, manifest_name, write_small
from ._errors import CheckpointError
from ._index import Chunk, Index, TensorEntry
from ._model_view import ModelView, model_view
from ._optim_state import collect_optimizer
from ._storage import LocalStorage, Storage
from ._tensor_file import TensorSource, dtype_name, write_tensors
from ._values import encode_value
from ._version import __version__

__all__ = ["save", "SaveHandle", "COMMON_FILE", "shard_file"]

COMMON_FILE = "common.safetensors"
_METADATA = {"format": "pt", "writer": f"fsdp-ckpt {__version__}"}


def shard_file(rank: int) -> str:
    """The tensor file rank ``rank`` writes."""
    return f"shard-{rank:05d}.safetensors"


@dataclass(frozen=True)
class _RankWrite:
    """What one rank writes: tensor files (name -> key -> tensor) and its part of the index."""

    files: Mapping[str, Mapping[str, TensorSource]]
    part: Index


def _param_entries(view: ModelView, file: str,
                   tensors: dict[str, TensorSource]) -> dict[str, TensorEntry]:
    entries = {}
    for piece in view.pieces:
        if not piece.writes:
            continue
        chunks: tuple[Chunk, ...] = ()
        if piece.length:
            key = f"param/{piece.fqn}"
            tensors[key] = piece.local
            chunks = (Chunk(file, key, piece.flat_start, piece.length),)
        entries[piece.fqn] = TensorEntry(piece.global_shape, dtype_name(piece.dtype), chunks)
    return entries


def _common(view: ModelView, extra: Any,
            tensors: dict[str, TensorSource]) -> tuple[dict[str, TensorEntry], Any]:
    buffers = {}
    for fqn, buf in view.buffers.items():
        key = f"buffer/{fqn}"
        tensors[key] = buf.detach()
        chunks = (Chunk(COMMON_FILE, key, 0, buf.numel()),) if buf.numel() else ()
        buffers[fqn] = TensorEntry(tuple(buf.shape), dtype_name(buf.dtype), chunks)

    def external(t: torch.Tensor) -> dict[str, Any]:
        key = f"extra/{len(tensors)}"
        tensors[key] = t.detach()
        return {"dtype": dtype_name(t.dtype), "shape": list(t.shape), "file": COMMON_FILE,
                "key": key}

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
    files = {name: {k: _host_copy(t) for k, t in tensors.items()}
             for name, tensors in plan.files.items()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return replace(plan, files=files)


def _write(storage: Storage, staging: str, rank: int, plan: _RankWrite) -> None:
    storage.makedirs(staging)
    digests = {name: write_tensors(storage, storage.join(staging, name), tensors,
                                   metadata=_METADATA)
               for name, tensors in plan.files.items()}
    part = replace(plan.part, files=digests)
    # The manifest need not survive a power loss: rank 0 reads it (after close, so it sees it)
    # only to build index.json, which is fsynced; a crash before that discards the save anyway.
    write_small(storage, storage.join(staging, manifest_name(rank)), part.to_json().encode(),
                durable=False)


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


@dataclass
class _SaveJob:
    """One save in progress on one rank."""

    directory: CheckpointDir
    version: str
    view: ModelView
    keep_last: int
    error: BaseException | None = None

    def run(self, plan_fn: Any) -> None:
        try:
            rank_write = plan_fn()
            _write(self.directory.storage, self.directory.staging(self.version),
                   self.view.rank, rank_write)
        except Exception as exc:  # reported through the vote, then re-raised by finish()
            self.error = exc

    def finish(self) -> str:
        ok = all_succeeded(self.view.backend, self.error is None)
        commit_error: BaseException | None = None
        committed = False
        if ok:
            if self.view.rank == 0:
                try:
                    self.directory.commit(self.version, self.view.world_size, self.keep_last)
                except Exception as exc:
                    commit_error = exc
            committed = commit_outcome(self.view.backend, commit_error is None)
        if self.error is not None:
            raise self.error
        if commit_error is not None:
            raise commit_error
        where = f"save of {self.directory.root} ({self.version})"
        if not ok:
            raise CheckpointError(f"{where} abandoned: another rank failed to write its files "
                                  "(its error is raised there); the previous checkpoint is intact")
        if not committed:
            raise CheckpointError(f"{where} failed: rank 0 could not commit (its error is raised "
                                  "there); the previous checkpoint is intact")
        return self.directory.storage.join(self.directory.root, self.version)


def _check_args(path: Any, extra: Any, keep_last: Any, storage: Any) -> None:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}")
    if extra is not None and not isinstance(extra, Mapping):
        raise TypeError(f"extra must be a dict or None, got {type(extra).__name__}")
    if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
        raise ValueError(f"keep_last must be an int >= 1, got {keep_last!r}")
    if storage is not None and not isinstance(storage, Storage):
        raise TypeError(f"storage must be an fsdp_ckpt.Storage, got {type(storage).__name__}")


def save(
    path: str | os.PathLike[str], model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None, *, extra: Mapping[str, Any] | None = None,
    async_save: bool = False, keep_last: int = 1, backend: Any = None,
    storage: Storage | None = None,
) -> SaveHandle:
    """Save ``model`` (and ``optimizer``, and ``extra``) to the checkpoint path ``path``.

    Every rank calls it. Each rank writes only the parameter slices and optimizer state it
    holds; the save's agreement is the only collective. The new version replaces the previous
    one atomically (a crash at any moment leaves the previous one loadable); ``keep_last``
    versions are kept. ``extra``: small user data (JSON values and tensors such as RNG states),
    rank 0's is saved. ``async_save``: snapshot to host memory, write in a background thread;
    call ``handle.wait()`` on every rank to commit. ``backend``: the fsdp_comm backend spanning
    every rank (found in a sharded model; needed for a plain model replicated over ranks).
    ``storage``: where files go (default: the local file system).
    """
    _check_args(path, extra, keep_last, storage)
    view = model_view(model, backend=backend)
    store = storage if storage is not None else LocalStorage()
    directory = CheckpointDir(store, os.fspath(path))
    job = _SaveJob(directory, directory.next_version(), view, keep_last)
    if not async_save:
        job.run(lambda: _plan(view, optimizer, extra))
        handle = SaveHandle(job.finish, None)
        handle.wait()
        return handle
    try:
        snapshot = _snapshot(_plan(view, optimizer, extra))
    except Exception as exc:
        job.error = exc
        return SaveHandle(job.finish, None)
    thread = threading.Thread(target=job.run, args=(lambda: snapshot,), daemon=True,
                              name=f"fsdp-ckpt-save-rank{view.rank}")
    thread.start()
    return SaveHandle(job.finish, thread)
