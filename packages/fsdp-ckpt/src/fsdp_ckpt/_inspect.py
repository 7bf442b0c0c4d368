"""`verify` and `inspect_checkpoint`: what a checkpoint holds, and whether every byte is intact."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ._args import check_path, check_storage
from ._directory import POINTER_FILE, OpenCheckpoint
from ._errors import CheckpointCorruptError
from ._index import Index
from ._open import open_guarded
from ._storage import Storage, storage_for
from ._tensor_file import dtype_from_name, read_header, verify_file

__all__ = ["CheckpointInfo", "inspect_checkpoint", "verify", "verify_opened"]


@dataclass(frozen=True)
class CheckpointInfo:
    """A summary of a checkpoint, read from its index (no tensor data is read)."""

    path: str
    directory: str  # the committed version directory
    versions: tuple[str, ...]  # version directories kept at ``path``
    world_size: int  # ranks that saved it
    library_version: str
    num_params: int
    num_param_elements: int
    num_buffers: int
    optimizer: str | None  # optimizer class (qualified name), if saved
    optimizer_states: tuple[str, ...]  # state names (exp_avg, step, ...)
    extra_keys: tuple[str, ...]
    files: dict[str, int]  # file -> bytes
    index: Index

    @property
    def total_bytes(self) -> int:
        return sum(self.files.values())


def _versions(storage: Storage, path: str) -> tuple[str, ...]:
    names = storage.listdir(path)
    return tuple(n for n in names if n.startswith("v") and n[1:].isdigit())


def _info(path: str, opened: OpenCheckpoint, storage: Storage) -> CheckpointInfo:
    ix = opened.index
    states = sorted(
        {n for items in (ix.optimizer.state.values() if ix.optimizer else []) for n in items}
    )
    extra_keys = tuple(ix.extra) if isinstance(ix.extra, dict) else ()
    has_pointer = storage.exists(storage.join(path, POINTER_FILE))
    return CheckpointInfo(
        path,
        opened.directory,
        _versions(storage, path) if has_pointer else (),
        ix.world_size,
        ix.library_version,
        len(ix.params),
        sum(e.numel for e in ix.params.values()),
        len(ix.buffers),
        ix.optimizer.class_name if ix.optimizer else None,
        tuple(states),
        extra_keys,
        {k: d.size for k, d in ix.files.items()},
        ix,
    )


def inspect_checkpoint(
    path: str | os.PathLike[str], *, storage: Storage | None = None
) -> CheckpointInfo:
    """Summarise the checkpoint at ``path`` from its index (checks the index, not the data)."""
    source = check_path(path)
    check_storage(storage)
    store = storage_for(path, storage)
    return _info(source, open_guarded(store, source, check_files=False), store)


def verify_opened(storage: Storage, opened: OpenCheckpoint) -> None:
    """Check every file's size and CRC-32, and that every chunk is in its file as recorded."""
    headers = {}
    for name, digest in opened.index.files.items():
        path = storage.join(opened.directory, name)
        verify_file(storage, path, digest)
        headers[name] = read_header(storage, path)
    for tname, entry in opened.index.entries().items():
        dtype = dtype_from_name(entry.dtype, source=opened.directory)
        for chunk in entry.chunks:
            slot = headers[chunk.file].get(chunk.key)
            numel = 0 if slot is None else torch.Size(slot.shape).numel()
            if slot is None or slot.dtype != dtype or numel != chunk.length:
                raise CheckpointCorruptError(
                    f"{tname}: tensor {chunk.key!r} is missing or not "
                    f"{chunk.length} {entry.dtype} elements",
                    path=storage.join(opened.directory, chunk.file),
                )


def verify(path: str | os.PathLike[str], *, storage: Storage | None = None) -> CheckpointInfo:
    """Check the checkpoint at ``path`` completely: pointer, index, and every file's size,
    CRC-32 and contents list. Raises `CheckpointError` (naming the file) on any problem;
    returns the summary when all is well."""
    source = check_path(path)
    check_storage(storage)
    store = storage_for(path, storage)
    opened = open_guarded(store, source)
    verify_opened(store, opened)
    return _info(source, opened, store)
