"""`export`: a checkpoint's model state as one safetensors (or ``torch.save``) file.

Every file is verified first (streaming, constant memory); then each tensor is assembled from
its slices with ranged reads and written out before the next is read, so exporting holds one
tensor at a time (the safetensors path) however large the model. The output is written to a
temporary name, fsynced and renamed into place; an output that names a directory, or a name
whose suffix says no format, is refused before anything is read.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from typing import Any

import torch
from safetensors import safe_open

from ._args import check_path, check_storage
from ._box import Box, Region, copy_region
from ._directory import OpenCheckpoint
from ._errors import CheckpointCorruptError
from ._index import TensorEntry
from ._inspect import verify_opened
from ._open import open_guarded
from ._paths import check_regular
from ._storage import LocalStorage, Storage, storage_for
from ._tensor_file import LazyTensor, dtype_from_name, read_header, read_range, write_tensors

__all__ = ["export", "Assembler", "model_entries", "format_from_suffix", "check_output"]

_FORMATS = {".safetensors": "safetensors", ".pt": "torch", ".pth": "torch", ".bin": "torch"}


def format_from_suffix(out: str) -> str | None:
    """ "safetensors" or "torch" for a known suffix of ``out``; None otherwise."""
    return _FORMATS.get(os.path.splitext(out)[1])


def check_output(out: str, *, directory: bool = False) -> None:
    """Refuse an output that cannot be written: a directory where a file is wanted (or a
    file where a directory is wanted), or a parent directory that does not exist."""
    if not directory and os.path.isdir(out):
        raise ValueError(
            f"out: {out} is a directory; export writes one file (name it, e.g. "
            f"{os.path.join(out, 'model.safetensors')})"
        )
    if directory and os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(
            f"out: {out} exists and is not a directory (a DCP checkpoint is a directory)"
        )
    parent = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(parent):
        raise ValueError(f"out: the directory {parent} does not exist")


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
                check_regular(self._storage, path)
                self._open[file] = _mapped(path)
            else:
                self._open[file] = read_header(self._storage, path)
        handle = self._open[file]
        if isinstance(handle, dict):
            return read_range(self._storage, path, handle[key], 0, length)
        try:
            tensor: torch.Tensor = handle.get_tensor(key)  # safetensors' safe_open: untyped
            return tensor.reshape(-1)
        except Exception as exc:  # safetensors' own error types; verified files do not fail
            raise CheckpointCorruptError(f"cannot read tensor {key!r} ({exc})", path=path) from None

    def tensor(self, entry: TensorEntry) -> torch.Tensor:
        """The whole tensor ``entry`` describes."""
        dtype = dtype_from_name(entry.dtype, source=self._opened.directory)
        out = torch.empty(entry.shape, dtype=dtype)
        flat = out.view(-1)
        whole = Box.whole(entry.shape)
        for chunk in entry.chunks:
            data = self._slice(chunk.file, chunk.key, chunk.length)
            if chunk.box is None:
                flat[chunk.start : chunk.start + chunk.length] = data
            else:  # a box chunk (Note [boxes] in _box.py)
                copy_region(data, Region(chunk.box, 0), flat, whole)
        return out


def _mapped(path: str) -> Any:
    try:
        return safe_open(path, framework="pt")
    except Exception as exc:  # stricter about layout than our reader (which verify used)
        raise CheckpointCorruptError(
            f"the safetensors library cannot open it ({exc})", path=path
        ) from None


def model_entries(opened: OpenCheckpoint) -> dict[str, TensorEntry]:
    """Parameters and buffers by FQN (what a model's state dict holds)."""
    return {**opened.index.params, **opened.index.buffers}


def _format(out: str, format: str | None) -> str:
    if format is None:
        fmt = format_from_suffix(out)
        if fmt is None:
            raise ValueError(
                f"format: cannot tell from the name {out!r}; pass "
                "format='safetensors' or format='torch'"
            )
        return fmt
    if format not in ("safetensors", "torch"):
        raise ValueError(f"format must be 'safetensors', 'torch' or None, got {format!r}")
    return format


def _write_out(out: str, fmt: str, entries: Mapping[str, TensorEntry], asm: Assembler) -> None:
    local = LocalStorage()
    tmp = f"{out}.tmp-{os.getpid()}"
    try:
        if fmt == "safetensors":
            lazy = {
                k: LazyTensor(
                    dtype_from_name(e.dtype, source=out), e.shape, functools.partial(asm.tensor, e)
                )
                for k, e in entries.items()
            }
            write_tensors(local, tmp, lazy, metadata={"format": "pt"})
        else:
            state = {k: asm.tensor(e) for k, e in entries.items()}
            with local.open_write(tmp) as f:
                torch.save(state, f)
        local.rename(tmp, out)
        local.sync_dir(os.path.dirname(os.path.abspath(out)))  # the new name survives power loss
    finally:
        local.remove(tmp)


#: A key of a checkpoint's ``extra`` (a dict): a saver whose stored values are not the model's
#: whole parameters as a plain model holds them sets it to the reason; `export` refuses then.
NOT_EXPORTABLE = "not_exportable"


def export(
    path: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    format: str | None = None,
    storage: Storage | None = None,
) -> str:
    """Write the model state (parameters and buffers, whole, by FQN) of the checkpoint at
    ``path`` to the single file ``out``: safetensors (for Hugging Face and other tools) or
    ``torch.save`` (``format`` from the suffix: .safetensors, or .pt/.pth/.bin; another
    suffix needs ``format``). Verifies the checkpoint first. ValueError when ``out`` is a
    directory or its directory does not exist, or when the checkpoint's ``extra`` (a dict)
    holds `NOT_EXPORTABLE`: the reason it is no plain model's state. Returns ``out``."""
    check_path(path)
    target = check_path(out, "out")
    check_storage(storage)
    store = storage_for(path, storage)
    fmt = _format(target, format)
    check_output(target)
    opened = open_guarded(store, os.fspath(path))
    extra = opened.index.extra
    reason = extra.get(NOT_EXPORTABLE) if isinstance(extra, dict) else None
    if isinstance(reason, str):
        # The saver knows its tensors are not the model's whole values as stored (fused
        # weights kept in a tensor-parallel order, say): an export would be wrong silently.
        raise ValueError(
            f"export: the checkpoint at {os.fspath(path)} says it cannot be "
            f"exported as a whole model: {reason}"
        )
    verify_opened(store, opened)
    _write_out(target, fmt, model_entries(opened), Assembler(store, opened))
    return target
