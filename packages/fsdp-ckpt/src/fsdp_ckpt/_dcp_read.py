"""Reading a ``torch.distributed.checkpoint`` (DCP) directory without running code from it.

DCP stores its ``.metadata`` with `pickle`, and `pickle` can call any importable function: a
crafted ``.metadata`` runs its payload the moment DCP's own reader opens it. So `read_metadata`
unpickles with an allow-list: only DCP's metadata classes, ``torch.Size``, torch dtypes and
layouts and ``pathlib`` paths can be named; anything else is refused before it is imported.
Non-tensor values (a learning rate) are read with ``torch.load(weights_only=True)`` instead of
the plain `pickle` DCP's default planner uses; tensors DCP already reads that way. Then the
metadata is checked like an fsdp-ckpt index: data files are plain names inside the directory
and regular files, byte ranges lie inside them, shapes are bounded by the bytes on disk.

``trust=True`` reads with plain `pickle` (checkpoints written with custom planners or storage
extensions need it): only for DCP checkpoints whose origin you trust.
"""

from __future__ import annotations

import io
import os
import pickle
from collections.abc import Iterable
from typing import Any, NoReturn

import torch

from ._errors import CheckpointCorruptError, CheckpointError
from ._paths import check_file_name, check_member, check_regular, show
from ._schema import MAX_NDIM, shape_numel
from ._storage import LocalStorage

__all__ = ["METADATA_FILE", "read_metadata", "template", "load_into", "TRUST_HINT"]

METADATA_FILE = ".metadata"
TRUST_HINT = (
    "DCP metadata is a pickle, which can run code; fsdp-ckpt reads only DCP's own "
    "classes from it. Pass trust=True (fsdp ckpt from-dcp --trust) only for a "
    "checkpoint whose origin you trust"
)
_DCP_MD = "torch.distributed.checkpoint.metadata"
_ALLOWED = {
    (_DCP_MD, name)
    for name in (
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    )
}
_ALLOWED |= {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
}
_ALLOWED |= {
    (module, name)
    for module in ("pathlib", "pathlib._local")
    for name in ("Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath")
}


class _MetadataUnpickler(pickle.Unpickler):
    """`pickle.Unpickler` that can name only the classes DCP metadata is made of."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED or _is_dtype(module, name):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(
            f"refused to load global {module}.{name}: not part of DCP metadata"
        )

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("refused a persistent id: not part of DCP metadata")


# From the module's dict, not getattr: torch's module __getattr__ imports submodules lazily.
_DTYPES = frozenset(n for n, v in vars(torch).items() if isinstance(v, torch.dtype))


def _is_dtype(module: str, name: str) -> bool:
    return module == "torch" and name in _DTYPES


def _unpickle(path: str, trust: bool) -> Any:
    with open(path, "rb") as f:
        if trust:
            return pickle.load(f)  # noqa: S301 - the caller said it trusts this checkpoint
        try:
            return _MetadataUnpickler(f).load()
        except Exception as exc:  # whatever a crafted pickle provokes: one clear refusal
            raise CheckpointCorruptError(
                f"refused ({type(exc).__name__}: {exc}). {TRUST_HINT}", path=path
            ) from None


def read_metadata(dcp_dir: str, *, trust: bool = False) -> Any:
    """The checked `Metadata` of the DCP checkpoint in ``dcp_dir``."""
    from torch.distributed.checkpoint.metadata import Metadata

    path = os.path.join(dcp_dir, METADATA_FILE)
    if not os.path.lexists(path):
        raise CheckpointError(f"no DCP checkpoint at {dcp_dir}: it has no {METADATA_FILE}")
    check_regular(LocalStorage(), path)
    metadata = _unpickle(path, trust)
    if not isinstance(metadata, Metadata):
        raise CheckpointCorruptError(
            f"holds a {type(metadata).__name__}, not DCP Metadata", path=path
        )
    _Checker(dcp_dir, path, trust).run(metadata)
    return metadata


class _Checker:
    """The fields of DCP metadata that reading relies on, checked like an index."""

    def __init__(self, dcp_dir: str, source: str, trust: bool) -> None:
        self.dcp_dir, self.source, self.trust = dcp_dir, source, trust

    def fail(self, where: str, what: str, value: Any) -> NoReturn:
        raise CheckpointCorruptError(f"{where}: {what}, got {show(value)}", path=self.source)

    def run(self, metadata: Any) -> None:
        entries = getattr(metadata, "state_dict_metadata", None)
        if not isinstance(entries, dict) or not all(isinstance(k, str) for k in entries):
            self.fail("state_dict_metadata", "expected a dict by key", entries)
        tensor_bytes = sum(self._entry(k, v) for k, v in entries.items())
        paths(metadata, self.source)  # planner_data
        data_bytes = self._storage(getattr(metadata, "storage_data", None))
        # Every tensor is stored whole in the data files (compressed only by a transform,
        # which needs trust), so this bounds what the template allocates by the bytes on disk.
        if tensor_bytes > data_bytes and not self.trust:
            self.fail(
                "state_dict_metadata",
                f"tensors of {tensor_bytes} bytes in all, but the "
                f"data files hold {data_bytes} bytes",
                len(entries),
            )

    def _shape(self, value: Any, where: str) -> tuple[int, ...]:
        if (
            not isinstance(value, tuple)
            or len(value) > MAX_NDIM
            or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in value)
        ):
            self.fail(where, f"expected at most {MAX_NDIM} non-negative integers", value)
        return tuple(value)

    def _entry(self, key: str, md: Any) -> int:
        """Bytes of the tensor ``md`` describes (0 for a pickled value)."""
        from torch.distributed.checkpoint.metadata import (
            BytesStorageMetadata,
            TensorStorageMetadata,
        )

        where = f"state_dict_metadata[{show(key)}]"
        if isinstance(md, BytesStorageMetadata):
            return 0
        if not isinstance(md, TensorStorageMetadata):
            self.fail(where, "expected tensor or bytes storage metadata", md)
        dtype = getattr(getattr(md, "properties", None), "dtype", None)
        if not isinstance(dtype, torch.dtype):
            self.fail(f"{where}.properties.dtype", "expected a torch.dtype", dtype)
        size = self._shape(getattr(md, "size", None), f"{where}.size")
        self._chunks(getattr(md, "chunks", None), size, where)
        return shape_numel(size) * dtype.itemsize

    def _chunks(self, chunks: Any, size: tuple[int, ...], where: str) -> None:
        if not isinstance(chunks, list):
            self.fail(f"{where}.chunks", "expected a list", chunks)
        for i, chunk in enumerate(chunks):
            here = f"{where}.chunks[{i}]"
            offsets = self._shape(getattr(chunk, "offsets", None), f"{here}.offsets")
            sizes = self._shape(getattr(chunk, "sizes", None), f"{here}.sizes")
            if (
                len(offsets) != len(size)
                or len(sizes) != len(size)
                or any(o + s > d for o, s, d in zip(offsets, sizes, size))
            ):
                self.fail(
                    here, f"does not lie inside the tensor of size {list(size)}", (offsets, sizes)
                )

    def _storage(self, storage_data: Any) -> int:
        """Check every stored item's file and byte range; the data files' total size."""
        if not isinstance(storage_data, dict):
            self.fail("storage_data", "expected a dict", storage_data)
        sizes: dict[str, int] = {}
        for index, info in storage_data.items():
            where = f"storage_data[{show(getattr(index, 'fqn', index))}]"
            name = check_file_name(
                getattr(info, "relative_path", None),
                field=f"{where}.relative_path",
                source=self.source,
            )
            if name not in sizes:
                sizes[name] = os.stat(check_member(LocalStorage(), self.dcp_dir, name)).st_size
            self._range(info, sizes[name], where)
        return sum(sizes.values())

    def _count(self, info: Any, field: str, where: str) -> int:
        value = getattr(info, field, None)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            self.fail(f"{where}.{field}", "expected a non-negative integer", value)
        return value

    def _range(self, info: Any, file_size: int, where: str) -> None:
        offset = self._count(info, "offset", where)
        length = self._count(info, "length", where)
        if offset + length > file_size:
            self.fail(
                where,
                f"bytes {offset}..{offset + length} lie beyond the end of "
                f"{info.relative_path} ({file_size} bytes)",
                (offset, length),
            )
        if getattr(info, "transform_descriptors", None) and not self.trust:
            self.fail(
                f"{where}.transform_descriptors",
                "stream transforms (a DCP extension) are read only with trust=True",
                info.transform_descriptors,
            )


def paths(metadata: Any, source: str) -> dict[str, tuple[str | int, ...]]:
    """Each flat key's path in the nested state dict (``planner_data``), checked: strings and
    list indices no larger than the number of entries, at most MAX_NDIM deep."""
    raw = getattr(metadata, "planner_data", None)
    entries = metadata.state_dict_metadata  # checked by _Checker: a dict by key
    if raw is None:
        return {k: (k,) for k in entries}
    if not isinstance(raw, dict):
        raise CheckpointCorruptError(f"planner_data: expected a dict, got {show(raw)}", path=source)
    out: dict[str, tuple[str | int, ...]] = {k: (k,) for k in entries}
    for key, path in raw.items():
        if (
            not isinstance(path, tuple)
            or not 1 <= len(path) <= MAX_NDIM
            or not all(
                isinstance(p, str) or (type(p) is int and 0 <= p <= len(entries)) for p in path
            )
            or not isinstance(path[0], str)
        ):
            raise CheckpointCorruptError(
                f"planner_data[{show(key)}]: expected a path of keys and indices, got {show(path)}",
                path=source,
            )
        out[key] = path
    return out


def template(metadata: Any, source: str, keys: Iterable[str]) -> dict[str, Any]:
    """Empty tensors (None for pickled values) nested as saved, under the top-level ``keys``."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    wanted = set(keys)
    out: dict[str, Any] = {}
    for flat, path in paths(metadata, source).items():
        md = metadata.state_dict_metadata.get(flat)
        if md is None or path[0] not in wanted:
            continue
        value = (
            torch.empty(md.size, dtype=md.properties.dtype)
            if isinstance(md, TensorStorageMetadata)
            else None
        )
        try:
            _put(out, path, value)
        except (TypeError, AttributeError, IndexError, KeyError):
            raise CheckpointCorruptError(
                f"planner_data[{show(flat)}]: path {show(path)} conflicts with another key's",
                path=source,
            ) from None
    return out


def _put(root: dict[str, Any], path: tuple[Any, ...], value: Any) -> None:
    node: Any = root
    for step, nxt in zip(path[:-1], path[1:]):
        if isinstance(node, list):
            while len(node) <= step:
                node.append({} if not isinstance(nxt, int) else [])
            node = node[step]
        else:
            node = node.setdefault(step, [] if isinstance(nxt, int) else {})
    if isinstance(node, list):
        while len(node) <= path[-1]:
            node.append(None)
    node[path[-1]] = value


def _safe_planner() -> Any:
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class SafeLoadPlanner(DefaultLoadPlanner):
        """DCP's default planner, reading pickled values with ``weights_only=True``."""

        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            obj = torch.load(value, weights_only=True)
            fqn = read_item.dest_index.fqn
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[fqn], obj)
            else:
                self.state_dict[fqn] = obj

    return SafeLoadPlanner()


def _reader(dcp_dir: str, metadata: Any) -> Any:
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class CheckedReader(FileSystemReader):
        """DCP's file reader, handing out the metadata already read and checked."""

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            if not isinstance(getattr(metadata, "storage_meta", None), StorageMeta):
                metadata.storage_meta = StorageMeta()  # only load_id is used, and set here
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return CheckedReader(dcp_dir)


def _cause(exc: BaseException) -> str:
    """The failure inside DCP's wrapper, in a line (torch's messages run to paragraphs)."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        exc = next(iter(failures.values()))[0]
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    key = next((line for line in lines if "GLOBAL" in line), lines[0] if lines else "")
    return f"{type(exc).__name__}: {key}"


def load_into(state: dict[str, Any], dcp_dir: str, metadata: Any, *, trust: bool) -> None:
    """Fill ``state`` (from `template`) with `dcp.load`; any failure is a CheckpointError."""
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    planner = None if trust else _safe_planner()
    try:
        dcp_load(state, storage_reader=_reader(dcp_dir, metadata), planner=planner, no_dist=True)
    except (Exception, CheckpointException) as exc:  # DCP's is a BaseException
        hint = "" if trust else f" {TRUST_HINT}"
        raise CheckpointCorruptError(
            f"DCP could not read it ({_cause(exc)}).{hint}", path=dcp_dir
        ) from exc
