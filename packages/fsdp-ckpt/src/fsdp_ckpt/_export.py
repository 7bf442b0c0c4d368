"""`export`: a checkpoint's model state as one safetensors (or ``torch.save``) file.

Every file is verified first (streaming, constant memory); then each tensor is assembled from
its slices with ranged reads and written out before the next is read, so exporting holds one
tensor at a time (the safetensors path) however large the model. The output is written to a
temporary name, fsynced and renamed into place.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from typing import Any

import torch
from safetensors import safe_open

from ._directory import OpenCheckpoint, open_checkpoint
from ._index import TensorEntry
from ._inspect import verify_opened
from ._storage import LocalStorage, Storage
from ._tensor_file import LazyTensor, dtype_from_name, read_header, read_range, write_tensors

__all__ = ["export", "Assembler", "model_entries"]

_FORMATS = {".safetensors": "safetensors", ".pt": "torch", ".pth": "torch", ".bin": "torch"}


class Assembler:
    """Whole tensors of a (verified) checkpoint, read slice by slice.

    Local files are read with the safetensors library's memory-mapped reader (only the bytes
    of each slice are touched); other storages with ranged reads through `Storage`.
    """

    def __init__(self, storage: Storage, opened: OpenCheckpoint) -> None:
        self._storage = storage
        self._opened = opened
        self._open: dict[str, Any] = {}

    def _slice(self, file: str, key: str, length: int) -> torch.Tensor:
        path = self._storage.join(self._opened.directory, file)
        if file not in self._open:
            if isinstance(self._storage, LocalStorage):
                self._open[file] = safe_open(path, framework="pt")
            else:
                self._open[file] = read_header(self._storage, path)
        handle = self._open[file]
        if isinstance(handle, dict):
            return read_range(self._storage, path, handle[key], 0, length)
        return handle.get_tensor(key).reshape(-1)

    def tensor(self, entry: TensorEntry) -> torch.Tensor:
        """The whole tensor ``entry`` describes."""
        dtype = dtype_from_name(entry.dtype, source=self._opened.directory)
        out = torch.empty(entry.shape, dtype=dtype)
        flat = out.view(-1)
        for chunk in entry.chunks:
            flat[chunk.start:chunk.start + chunk.length] = self._slice(chunk.file, chunk.key,
                                                                       chunk.length)
        return out


def model_entries(opened: OpenCheckpoint) -> dict[str, TensorEntry]:
    """Parameters and buffers by FQN (what a model's state dict holds)."""
    return {**opened.index.params, **opened.index.buffers}


def _format(out: str, format: str | None) -> str:
    if format is None:
        fmt = _FORMATS.get(os.path.splitext(out)[1])
        if fmt is None:
            raise ValueError(f"format: cannot tell from the name {out!r}; pass "
                             "format='safetensors' or format='torch'")
        return fmt
    if format not in ("safetensors", "torch"):
        raise ValueError(f"format must be 'safetensors', 'torch' or None, got {format!r}")
    return format


def _write_out(out: str, fmt: str, entries: Mapping[str, TensorEntry], asm: Assembler) -> None:
    local = LocalStorage()
    tmp = f"{out}.tmp-{os.getpid()}"
    try:
        if fmt == "safetensors":
            lazy = {k: LazyTensor(dtype_from_name(e.dtype, source=out), e.shape,
                                  functools.partial(asm.tensor, e)) for k, e in entries.items()}
            write_tensors(local, tmp, lazy, metadata={"format": "pt"})
        else:
            state = {k: asm.tensor(e) for k, e in entries.items()}
            with local.open_write(tmp) as f:
                torch.save(state, f)
        local.rename(tmp, out)
    finally:
        local.remove(tmp)


def export(path: str | os.PathLike[str], out: str | os.PathLike[str], *,
           format: str | None = None, storage: Storage | None = None) -> str:
    """Write the model state (parameters and buffers, whole, by FQN) of the checkpoint at
    ``path`` to the single file ``out``: safetensors (for Hugging Face and other tools) or
    ``torch.save`` (``format`` from the suffix: .safetensors, or .pt/.pth/.bin). Verifies the
    checkpoint first. Returns ``out``."""
    store = storage if storage is not None else LocalStorage()
    opened = open_checkpoint(store, os.fspath(path))
    target = os.fspath(out)
    fmt = _format(target, format)
    verify_opened(store, opened)
    _write_out(target, fmt, model_entries(opened), Assembler(store, opened))
    return target
