"""Tensor files: safetensors written as a stream with a running CRC-32, read back verified.

The writer emits the standard safetensors layout (8-byte little-endian header length, JSON
header padded to 8 bytes, raw little-endian tensor bytes with no holes), so any safetensors
reader opens our files. It writes each tensor's bytes straight from the tensor's memory and
checksums them on the way out: one pass, no serialised copy. Tensors go in order of decreasing
element size so every tensor starts at an offset aligned to its element size and a reader can
view the bytes in place.

Reading trusts nothing in a file before its checksum, and nothing in a header at all: the
header is bounded in size, every entry's dtype, shape (non-negative, bounded) and byte range
(inside the data area, matching the shape) is checked, and only regular files are opened.
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Union

import torch

from ._errors import CheckpointCorruptError
from ._paths import check_regular, show
from ._schema import MAX_NDIM
from ._storage import Storage

__all__ = [
    "FileDigest",
    "LazyTensor",
    "TensorFile",
    "dtype_name",
    "dtype_from_name",
    "known_dtype",
    "dtype_names",
    "write_tensors",
    "read_verified",
    "verify_file",
    "read_header",
    "read_range",
]

_SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.complex64: "C64",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
_FROM_SAFETENSORS = {code: dtype for dtype, code in _SAFETENSORS_DTYPES.items()}
_NAMES = {dtype: str(dtype).removeprefix("torch.") for dtype in _SAFETENSORS_DTYPES}
_FROM_NAMES = {name: dtype for dtype, name in _NAMES.items()}
_READ_CHUNK = 16 << 20
_MAX_HEADER = 100_000_000  # the safetensors library's own limit on the JSON header


def dtype_name(dtype: torch.dtype) -> str:
    """The index's name for ``dtype`` ("float32", "bfloat16", ...)."""
    try:
        return _NAMES[dtype]
    except KeyError:
        raise TypeError(
            f"cannot checkpoint tensors of dtype {dtype}; supported: {sorted(_FROM_NAMES)}"
        ) from None


def known_dtype(name: Any) -> torch.dtype | None:
    """The dtype an index names ``name`` ("float32"), or None for anything else."""
    return _FROM_NAMES.get(name) if isinstance(name, str) else None


def dtype_names() -> list[str]:
    """Every dtype name an index may hold, sorted."""
    return sorted(_FROM_NAMES)


def dtype_from_name(name: Any, *, source: str) -> torch.dtype:
    """Inverse of `dtype_name`; an unknown name is a malformed checkpoint."""
    dtype = known_dtype(name)
    if dtype is None:
        raise CheckpointCorruptError(f"unknown dtype {show(name)}", path=source)
    return dtype


@dataclass(frozen=True)
class FileDigest:
    """Size in bytes and CRC-32 (8 hex digits) of a whole file."""

    size: int
    crc32: str


@dataclass(frozen=True)
class LazyTensor:
    """A tensor produced only when the writer reaches it (exports stream one at a time)."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    make: Callable[[], torch.Tensor]


TensorSource = Union[torch.Tensor, LazyTensor]


def _spec(source: TensorSource) -> tuple[torch.dtype, tuple[int, ...]]:
    if isinstance(source, LazyTensor):
        return source.dtype, tuple(source.shape)
    return source.dtype, tuple(source.shape)


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    numel = 1
    for d in shape:
        numel *= d
    return numel * torch.empty(0, dtype=dtype).element_size()


def _header(items: list[tuple[str, TensorSource]], metadata: Mapping[str, str]) -> bytes:
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for key, source in items:
        dtype, shape = _spec(source)
        end = offset + _nbytes(dtype, shape)
        header[key] = {
            "dtype": _SAFETENSORS_DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, end],
        }
        offset = end
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # keeps the data area 8-byte aligned, as safetensors does
    return struct.pack("<Q", len(raw)) + raw


def _byte_view(t: torch.Tensor) -> memoryview:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    t = t.contiguous().reshape(-1)
    if t.numel() == 0:
        return memoryview(b"")
    return t.view(torch.uint8).numpy().data


def _ordered(tensors: Mapping[str, TensorSource]) -> list[tuple[str, TensorSource]]:
    for source in tensors.values():
        dtype_name(_spec(source)[0])  # refuse unsupported dtypes before writing anything
    size = {d: torch.empty(0, dtype=d).element_size() for d in _SAFETENSORS_DTYPES}
    return sorted(tensors.items(), key=lambda kv: -size[_spec(kv[1])[0]])  # stable: keeps order


def write_tensors(
    storage: Storage,
    path: str,
    tensors: Mapping[str, TensorSource],
    *,
    metadata: Mapping[str, str] | None = None,
) -> FileDigest:
    """Write ``tensors`` as one safetensors file (durable on return); its size and CRC-32."""
    items = _ordered(tensors)
    head = _header(items, metadata or {})
    crc, size = zlib.crc32(head), len(head)
    with storage.open_write(path) as f:
        f.write(head)
        for key, source in items:
            tensor = source.make() if isinstance(source, LazyTensor) else source
            if (tensor.dtype, tuple(tensor.shape)) != _spec(source):
                raise ValueError(
                    f"{key}: produced {tensor.dtype} {list(tensor.shape)}, "
                    f"announced {_spec(source)}"
                )
            view = _byte_view(tensor)
            f.write(view)  # zlib and file writes release the GIL: ranks as threads overlap
            crc = zlib.crc32(view, crc)
            size += view.nbytes
    return FileDigest(size, f"{crc:08x}")


@dataclass(frozen=True)
class _Slot:
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # byte offsets in the file
    end: int


def _header_json(raw: bytes, path: str) -> dict[str, Any]:
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointCorruptError(f"unreadable safetensors header ({exc})", path=path) from None
    except RecursionError:
        raise CheckpointCorruptError("safetensors header nested too deeply", path=path) from None
    if not isinstance(header, dict):
        raise CheckpointCorruptError("safetensors header is not a JSON object", path=path)
    return header


def _slot(key: str, entry: Any, data_start: int, file_size: int, path: str) -> _Slot:
    def bad(what: str, value: Any) -> CheckpointCorruptError:
        return CheckpointCorruptError(
            f"safetensors entry {show(key)}: {what}, got {show(value)}", path=path
        )

    if not isinstance(entry, dict):
        raise bad("expected a JSON object", entry)
    code = entry.get("dtype")
    dtype = _FROM_SAFETENSORS.get(code) if isinstance(code, str) else None
    if dtype is None:
        raise bad(f"dtype: expected one of {sorted(_FROM_SAFETENSORS)}", code)
    shape = _counts(entry.get("shape"), MAX_NDIM)
    if shape is None:
        raise bad(f"shape: expected at most {MAX_NDIM} non-negative integers", entry.get("shape"))
    offsets = _counts(entry.get("data_offsets"), 2)
    if offsets is None or len(offsets) != 2:
        raise bad("data_offsets: expected two non-negative integers", entry.get("data_offsets"))
    begin, end = offsets
    if not begin <= end <= file_size - data_start or end - begin != _nbytes(dtype, shape):
        raise bad(
            f"data_offsets: not {list(shape)} {dtype} inside the data area of "
            f"{file_size - data_start} bytes",
            list(offsets),
        )
    return _Slot(dtype, shape, data_start + begin, data_start + end)


def _counts(obj: Any, max_len: int) -> tuple[int, ...] | None:
    """``obj`` if it is a list of at most ``max_len`` non-negative ints (not bools)."""
    if (
        isinstance(obj, list)
        and len(obj) <= max_len
        and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in obj)
    ):
        return tuple(obj)
    return None


def _parse_header(raw: bytes, data_start: int, file_size: int, path: str) -> dict[str, _Slot]:
    header = _header_json(raw, path)
    return {
        key: _slot(key, entry, data_start, file_size, path)
        for key, entry in header.items()
        if key != "__metadata__"
    }


def _header_bounds(prefix: bytes, file_size: int, path: str) -> int:
    if file_size < 8 or len(prefix) < 8:
        raise CheckpointCorruptError(f"{file_size} bytes: too short for safetensors", path=path)
    n = int(struct.unpack("<Q", prefix[:8])[0])
    if n > file_size - 8 or n > _MAX_HEADER:
        raise CheckpointCorruptError(
            f"header of {n} bytes in a file of {file_size} (at most {_MAX_HEADER})", path=path
        )
    return n


class TensorFile:
    """A safetensors file read into memory after its size and checksum were verified."""

    def __init__(self, data: torch.Tensor, slots: dict[str, _Slot], path: str) -> None:
        self._data = data
        self._slots = slots
        self.path = path

    def keys(self) -> list[str]:
        """Tensor names in the file."""
        return list(self._slots)

    def get(self, key: str) -> torch.Tensor:
        """The tensor ``key``: a view of the file's bytes (a copy when unaligned)."""
        slot = self._slots.get(key)
        if slot is None:
            raise CheckpointCorruptError(f"has no tensor {key!r}", path=self.path)
        raw = self._data[slot.begin : slot.end]
        itemsize = torch.empty(0, dtype=slot.dtype).element_size()
        if slot.begin % itemsize:  # written by another tool; torch views need alignment
            raw = raw.clone()
        return raw.view(slot.dtype).view(slot.shape)


def _read_all(storage: Storage, path: str, size: int) -> torch.Tensor:
    try:
        data = storage.read_all(path, size)
    except (EOFError, RuntimeError) as exc:  # the file shrank after it was measured
        raise CheckpointCorruptError(f"truncated while reading ({exc})", path=path) from None
    if data.numel() != size:
        raise CheckpointCorruptError(f"read {data.numel()} of {size} bytes", path=path)
    return data


def _check_size(storage: Storage, path: str, digest: FileDigest) -> None:
    check_regular(storage, path)  # before anything opens it: a FIFO would block forever
    try:
        size = storage.size(path)
    except FileNotFoundError:
        raise CheckpointCorruptError("missing (the checkpoint index lists it)", path=path) from None
    if size != digest.size:
        what = "truncated" if size < digest.size else "longer than recorded"
        raise CheckpointCorruptError(
            f"{what}: {size} bytes, the index records {digest.size}", path=path
        )


def _check_crc(crc: int, path: str, digest: FileDigest) -> None:
    if f"{crc:08x}" != digest.crc32:
        raise CheckpointCorruptError(
            f"checksum mismatch: crc32 {crc:08x}, the index records "
            f"{digest.crc32} (the file was altered or damaged)",
            path=path,
        )


def read_verified(storage: Storage, path: str, digest: FileDigest) -> TensorFile:
    """Read a whole tensor file, check its size and CRC-32 against ``digest``, parse it."""
    _check_size(storage, path, digest)
    data = _read_all(storage, path, digest.size)
    view = data.numpy().data if digest.size else memoryview(bytearray())
    _check_crc(zlib.crc32(view), path, digest)
    n = _header_bounds(bytes(view[:8]), digest.size, path)
    return TensorFile(data, _parse_header(bytes(view[8 : 8 + n]), 8 + n, digest.size, path), path)


def _chunks(storage: Storage, path: str) -> Iterator[bytes]:
    with storage.open_read(path) as f:
        while block := f.read(_READ_CHUNK):
            yield block


def verify_file(storage: Storage, path: str, digest: FileDigest) -> None:
    """Check size and CRC-32 reading in blocks (constant memory)."""
    _check_size(storage, path, digest)
    crc, size = 0, 0
    for block in _chunks(storage, path):
        crc, size = zlib.crc32(block, crc), size + len(block)
    if size != digest.size:
        raise CheckpointCorruptError(
            f"truncated while reading: {size} of {digest.size} bytes", path=path
        )
    _check_crc(crc, path, digest)


def read_header(storage: Storage, path: str) -> dict[str, _Slot]:
    """Parse only the header (for ranged reads of a file already verified)."""
    check_regular(storage, path)
    size = storage.size(path)
    with storage.open_read(path) as f:
        n = _header_bounds(f.read(8), size, path)
        return _parse_header(f.read(n), 8 + n, size, path)


def read_range(storage: Storage, path: str, slot: _Slot, first: int, count: int) -> torch.Tensor:
    """Elements ``first .. first+count`` of the flattened tensor at ``slot``."""
    itemsize = torch.empty(0, dtype=slot.dtype).element_size()
    out = torch.empty(count, dtype=slot.dtype)
    if count == 0:
        return out
    raw = out.view(torch.uint8).numpy().data
    with storage.open_read(path) as f:
        f.seek(slot.begin + first * itemsize)
        got = 0
        while got < raw.nbytes:
            n = f.readinto(raw[got:])
            if not n:
                raise CheckpointCorruptError("truncated while reading", path=path)
            got += n
    return out
