"""The checkpoint index (``index.json``): what every tensor is and where its pieces are.

Format version 2 (see the package README for an example)::

    {"index_crc32": "89abcdef", "format": "fsdp-ckpt", "format_version": 2,
     "library_version": "0.1.0", "world_size": 4,
     "files":   {"shard-00000.safetensors": {"size": 123, "crc32": "1a2b3c4d"}, ...},
     "params":  {"<fqn>": <entry>, ...},
     "buffers": {"<fqn>": <entry>, ...},
     "optimizer": null | {"class": "torch.optim.adamw.AdamW",
                          "param_groups": [{..., "params": ["<fqn>", ...]}],
                          "state": {"<fqn>": {"exp_avg": <entry>, "step": <item>, ...}}},
     "extra": <JSON value>}

An entry is ``{"shape": [...], "dtype": "float32", "chunks": [...]}``. A flat chunk
``{"file", "key", "start", "length"}``: ``key`` of ``file`` holds elements ``start ..
start+length`` of the flattened tensor. A box chunk ``{"file", "key", "offsets", "sizes"}``
(version 2): ``key`` holds the box ``offsets .. offsets+sizes`` of the tensor in row-major
order (Note [boxes] in ``_box.py``): what a rank holds of a tensor-parallel parameter that is
no contiguous slice of it. An index without box chunks is written as version 1, so fsdp-ckpt
0.1 reads it; one with box chunks as version 2, which 0.1 refuses ("upgrade fsdp-ckpt")
instead of misreading. Optimizer state that is shaped like its parameter is marked ``"per_param":
true`` and sliced the same way, so it moves with the parameter when the world size changes.
Small state (``step``) is an ``{"inline": {"dtype", "shape", "values"}}`` item and plain Python
state a ``{"value": ...}`` item. Each rank writes a partial index of what it holds
(``rank-00003.json``); rank 0 merges them with `merge_indexes` at commit.

``index_crc32`` is the CRC-32 of the file itself (with those 8 digits read as zeros), so a
version directory loaded without its pointer is checked too. Reading checks every field's type
and range before anything is built from it: file names are plain names in the version
directory, shapes and offsets are bounded by the sizes of the files that hold them, nesting is
bounded (see `_schema`).
"""

from __future__ import annotations

import functools
import json
import re
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Union

from ._box import Box, Region, flat_regions, tiling_problem
from ._errors import CheckpointCorruptError
from ._paths import show
from ._schema import MAX_BYTES, Fields, check_encoded, shape_numel
from ._tensor_file import FileDigest, dtype_names, known_dtype

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "Chunk",
    "TensorEntry",
    "InlineItem",
    "ValueItem",
    "StateItem",
    "OptimizerSection",
    "Index",
    "merge_indexes",
]

FORMAT_NAME = "fsdp-ckpt"
FORMAT_VERSION = 2  # the newest this reads and writes (Note [boxes]: box chunks)
_FLAT_VERSION = 1  # what an index without box chunks is written as
_HEX8 = re.compile(r"[0-9a-f]{8}")


@dataclass(frozen=True)
class Chunk:
    """Elements ``start .. start+length`` of a flattened tensor, stored as ``key`` in ``file``;
    or, with ``box``, that box of the tensor (``length`` its elements, ``start`` 0)."""

    file: str
    key: str
    start: int
    length: int
    box: Box | None = None

    def regions(self, shape: tuple[int, ...]) -> tuple[Region, ...]:
        """The chunk as boxes of a tensor of ``shape`` and where each one's data starts in
        the stored key (Note [boxes])."""
        if self.box is not None:
            return (Region(self.box, 0),)
        return flat_regions(tuple(shape), self.start, self.length)


def box_chunk(file: str, key: str, box: Box) -> Chunk:
    """A chunk holding ``box`` of its tensor."""
    return Chunk(file, key, 0, box.numel, box)


@dataclass(frozen=True)
class TensorEntry:
    """A tensor stored in tensor files, whole or in flat slices."""

    shape: tuple[int, ...]
    dtype: str
    chunks: tuple[Chunk, ...]
    per_param: bool = False  # optimizer state sliced like its parameter

    @property
    def numel(self) -> int:
        return shape_numel(self.shape)


@dataclass(frozen=True)
class InlineItem:
    """A small tensor kept in the index itself (``{"dtype", "shape", "values"}``)."""

    tensor: Mapping[str, Any]


@dataclass(frozen=True)
class ValueItem:
    """A plain Python value (JSON)."""

    value: Any


StateItem = Union[TensorEntry, InlineItem, ValueItem]


@dataclass(frozen=True)
class OptimizerSection:
    """Optimizer class name, hyperparameters per group (params as FQNs), state by FQN."""

    class_name: str
    param_groups: tuple[Mapping[str, Any], ...]
    state: Mapping[str, Mapping[str, StateItem]]


@dataclass(frozen=True)
class Index:
    """A whole checkpoint's index (or one rank's part of it before the merge)."""

    world_size: int
    files: Mapping[str, FileDigest] = field(default_factory=dict)
    params: Mapping[str, TensorEntry] = field(default_factory=dict)
    buffers: Mapping[str, TensorEntry] = field(default_factory=dict)
    optimizer: OptimizerSection | None = None
    extra: Any = None
    library_version: str = ""
    # Set when the text read did not match its own index_crc32; `check_complete` raises it
    # (after the more specific checks, whose messages say what was changed).
    checksum_problem: str | None = field(default=None, compare=False)

    def to_json(self) -> str:
        """Deterministic JSON text (same inputs, same bytes), checksum first."""
        obj = {_CRC_FIELD: _CRC_HOLE.decode(), **_index_to_obj(self)}
        raw = (json.dumps(obj, indent=1, sort_keys=False) + "\n").encode()
        return _seal(raw).decode()

    @classmethod
    def from_json(cls, text: str | bytes, *, source: str) -> Index:
        """Parse and check an index; CheckpointCorruptError naming ``source`` and the field
        when anything is malformed, out of range or nested too deeply."""
        raw = text.encode() if isinstance(text, str) else bytes(text)
        try:
            obj = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointCorruptError(f"not valid JSON ({exc})", path=source) from None
        except RecursionError:
            raise CheckpointCorruptError("JSON nested too deeply", path=source) from None
        try:
            return _index_from_obj(obj, raw, source)
        except (KeyError, TypeError, ValueError, AttributeError, RecursionError) as exc:
            if isinstance(exc, CheckpointCorruptError):
                raise
            raise CheckpointCorruptError(
                f"malformed index ({type(exc).__name__}: {exc})", path=source
            ) from None

    def entries(self) -> dict[str, TensorEntry]:
        """Every file-backed tensor, named ``params/..``, ``buffers/..``, ``optimizer/fqn/..``."""
        out = {f"params/{k}": v for k, v in self.params.items()}
        out.update({f"buffers/{k}": v for k, v in self.buffers.items()})
        if self.optimizer is not None:
            for fqn, items in self.optimizer.state.items():
                out.update(
                    {
                        f"optimizer/{fqn}/{n}": v
                        for n, v in items.items()
                        if isinstance(v, TensorEntry)
                    }
                )
        return out

    def check_complete(self, *, source: str) -> None:
        """Every tensor's chunks tile it exactly and name files the index lists, and the
        index matched its own checksum."""
        for name, entry in self.entries().items():
            _check_tiling(name, entry, self.files, source)
        if self.checksum_problem is not None:
            raise CheckpointCorruptError(self.checksum_problem, path=source)


def _check_tiling(
    name: str, entry: TensorEntry, files: Mapping[str, FileDigest], source: str
) -> None:
    for chunk in entry.chunks:
        if chunk.file not in files:
            raise CheckpointCorruptError(
                f"{name} names file {chunk.file!r} that the index does not list", path=source
            )
    if any(c.box is not None for c in entry.chunks):
        boxes = [r.box for c in entry.chunks for r in c.regions(entry.shape)]
        problem = tiling_problem(boxes, entry.shape)
        if problem is not None:
            raise CheckpointCorruptError(
                f"{name}: pieces do not tile the tensor: {problem}", path=source
            )
        return
    cursor = 0
    for chunk in sorted(entry.chunks, key=lambda c: c.start):
        if chunk.start != cursor or chunk.length <= 0:
            raise CheckpointCorruptError(
                f"{name}: pieces do not tile the tensor (gap or overlap at element {cursor})",
                path=source,
            )
        cursor += chunk.length
    if cursor != entry.numel:
        raise CheckpointCorruptError(
            f"{name}: pieces hold {cursor} of {entry.numel} elements", path=source
        )


# ---- JSON <-> dataclasses ---------------------------------------------------------------------
def _chunk_to_obj(c: Chunk) -> dict[str, Any]:
    if c.box is not None:
        return {
            "file": c.file,
            "key": c.key,
            "offsets": list(c.box.offsets),
            "sizes": list(c.box.sizes),
        }
    return {"file": c.file, "key": c.key, "start": c.start, "length": c.length}


def _entry_to_obj(e: TensorEntry) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "shape": list(e.shape),
        "dtype": e.dtype,
        "chunks": [_chunk_to_obj(c) for c in e.chunks],
    }
    if e.per_param:
        obj["per_param"] = True
    return obj


def _item_to_obj(item: StateItem) -> dict[str, Any]:
    if isinstance(item, TensorEntry):
        return _entry_to_obj(item)
    if isinstance(item, InlineItem):
        return {"inline": dict(item.tensor)}
    return {"value": item.value}


def _index_to_obj(ix: Index) -> dict[str, Any]:
    opt = None
    if ix.optimizer is not None:
        opt = {
            "class": ix.optimizer.class_name,
            "param_groups": [dict(g) for g in ix.optimizer.param_groups],
            "state": {
                fqn: {n: _item_to_obj(v) for n, v in items.items()}
                for fqn, items in ix.optimizer.state.items()
            },
        }
    boxes = any(c.box is not None for e in ix.entries().values() for c in e.chunks)
    return {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION if boxes else _FLAT_VERSION,
        "library_version": ix.library_version,
        "world_size": ix.world_size,
        "files": {k: {"size": d.size, "crc32": d.crc32} for k, d in ix.files.items()},
        "params": {k: _entry_to_obj(v) for k, v in ix.params.items()},
        "buffers": {k: _entry_to_obj(v) for k, v in ix.buffers.items()},
        "optimizer": opt,
        "extra": ix.extra,
    }


# ---- the index's own checksum --------------------------------------------------------------
# The pointer records the index's CRC, but a version directory loaded directly has no pointer:
# so the index carries its CRC-32 as its first field, computed over the file's bytes with
# those 8 hex digits as zeros. Checking it needs no re-serialisation, only the bytes read.
_CRC_FIELD = "index_crc32"
_CRC_PREFIX = b'{\n "index_crc32": "'
_CRC_HOLE = b"00000000"


def _seal(raw: bytes) -> bytes:
    n = len(_CRC_PREFIX)
    return raw[:n] + f"{zlib.crc32(raw):08x}".encode() + raw[n + len(_CRC_HOLE) :]


def _checksum_problem(raw: bytes, obj: Mapping[str, Any]) -> str | None:
    if _CRC_FIELD not in obj:
        return None  # written before indexes carried their own checksum
    n, end = len(_CRC_PREFIX), len(_CRC_PREFIX) + len(_CRC_HOLE)
    if not raw.startswith(_CRC_PREFIX) or raw[end : end + 1] != b'"':
        return (
            f"{_CRC_FIELD}: not the first field as fsdp-ckpt writes it (the index was "
            "rewritten or damaged)"
        )
    stored = raw[n:end].decode("ascii", errors="replace")
    crc = f"{zlib.crc32(raw[:n] + _CRC_HOLE + raw[end:]):08x}"
    if crc != stored:
        return (
            f"checksum mismatch: crc32 {crc}, {_CRC_FIELD} records {stored} (the index "
            "was altered or damaged)"
        )
    return None


# ---- checked parsing -------------------------------------------------------------------------
def _dtype(f: Fields, obj: Any, where: str) -> tuple[str, int]:
    """A known dtype name and its element size."""
    dtype = known_dtype(obj)
    if dtype is None:
        f.fail(where, f"unknown dtype (known: {', '.join(dtype_names())})", obj)
    return obj, dtype.itemsize


def _chunk(
    f: Fields,
    obj: Any,
    where: str,
    files: Mapping[str, FileDigest],
    shape: tuple[int, ...],
    itemsize: int,
    version: int,
) -> Chunk:
    c = f.as_dict(obj, where)
    file = f.file_name(f.get(c, "file", where), f"{where}.file")
    if file not in files:
        f.fail(f"{where}.file", "names a file that the index does not list", file)
    key = f.as_str(f.get(c, "key", where), f"{where}.key")
    if "offsets" in c or "sizes" in c:
        return _box_chunk(f, c, where, files, file, key, shape, itemsize, version)
    numel = shape_numel(shape)
    start = f.as_int(f.get(c, "start", where), f"{where}.start", hi=numel)
    length = f.as_int(f.get(c, "length", where), f"{where}.length", hi=numel - start)
    if length * itemsize > files[file].size:
        f.fail(f"{where}.length", f"does not fit in {file} ({files[file].size} bytes)", length)
    return Chunk(file, key, start, length)


def _box_chunk(
    f: Fields,
    c: dict[str, Any],
    where: str,
    files: Mapping[str, FileDigest],
    file: str,
    key: str,
    shape: tuple[int, ...],
    itemsize: int,
    version: int,
) -> Chunk:
    if version < 2:
        f.fail(f"{where}.offsets", "a box chunk needs format_version 2", version)
    offsets = f.as_list(f.get(c, "offsets", where), f"{where}.offsets")
    sizes = f.as_list(f.get(c, "sizes", where), f"{where}.sizes")
    for name, dims in (("offsets", offsets), ("sizes", sizes)):
        if len(dims) != len(shape):
            f.fail(
                f"{where}.{name}",
                f"expected {len(shape)} entries (the tensor's dimensions)",
                len(dims),
            )
    o = tuple(
        f.as_int(v, f"{where}.offsets[{i}]", hi=d) for i, (v, d) in enumerate(zip(offsets, shape))
    )
    s = tuple(
        f.as_int(v, f"{where}.sizes[{i}]", hi=d - lo)
        for i, (v, d, lo) in enumerate(zip(sizes, shape, o))
    )
    box = Box(o, s)
    if box.numel * itemsize > files[file].size:
        f.fail(f"{where}.sizes", f"does not fit in {file} ({files[file].size} bytes)", list(s))
    return box_chunk(file, key, box)


def _entry(
    f: Fields, obj: Any, where: str, files: Mapping[str, FileDigest], version: int
) -> TensorEntry:
    d = f.as_dict(obj, where)
    shape = f.shape(f.get(d, "shape", where), f"{where}.shape")
    dtype, itemsize = _dtype(f, f.get(d, "dtype", where), f"{where}.dtype")
    numel = shape_numel(shape)
    if numel * itemsize > MAX_BYTES:
        f.fail(f"{where}.shape", f"more than {MAX_BYTES} bytes", list(shape))
    raw = f.as_list(f.get(d, "chunks", where), f"{where}.chunks")
    chunks = tuple(
        _chunk(f, c, f"{where}.chunks[{i}]", files, shape, itemsize, version)
        for i, c in enumerate(raw)
    )
    return TensorEntry(
        shape, dtype, chunks, f.as_bool(d.get("per_param", False), f"{where}.per_param")
    )


def _inline(f: Fields, obj: Any, where: str) -> dict[str, Any]:
    d = f.as_dict(obj, where)
    _dtype(f, f.get(d, "dtype", where), f"{where}.dtype")
    shape = f.shape(f.get(d, "shape", where), f"{where}.shape")
    values = f.as_list(f.get(d, "values", where), f"{where}.values")
    if len(values) != shape_numel(shape):
        f.fail(
            f"{where}.values",
            f"expected {shape_numel(shape)} values for shape {list(shape)}",
            len(values),
        )
    for i, v in enumerate(values):
        if not isinstance(v, (bool, int, float)):
            f.fail(f"{where}.values[{i}]", "expected a number", v)
    return d


def _tensor_record(
    f: Fields, files: Mapping[str, FileDigest] | None, rec: dict[str, Any], where: str
) -> None:
    """A ``__tensor__`` record: inline, or (``files`` given) a key of a listed file."""
    if "key" not in rec:
        _inline(f, rec, where)
        return
    if files is None:
        f.fail(where, "a tensor stored in a file is not allowed here", sorted(rec))
    dtype, itemsize = _dtype(f, f.get(rec, "dtype", where), f"{where}.dtype")
    shape = f.shape(f.get(rec, "shape", where), f"{where}.shape")
    f.as_str(f.get(rec, "key", where), f"{where}.key")
    file = f.file_name(f.get(rec, "file", where), f"{where}.file")
    if file not in files:
        f.fail(f"{where}.file", "names a file that the index does not list", file)
    if shape_numel(shape) * itemsize > files[file].size:
        f.fail(f"{where}.shape", f"does not fit in {file} ({files[file].size} bytes)", list(shape))


def _value(f: Fields, obj: Any, where: str) -> Any:
    """A stored value that may hold only inline tensors (optimizer values, hyperparameters)."""
    check_encoded(f, obj, where, tensor=functools.partial(_tensor_record, f, None))
    return obj


def _item(
    f: Fields, obj: Any, where: str, files: Mapping[str, FileDigest], version: int
) -> StateItem:
    d = f.as_dict(obj, where)
    if "chunks" in d:
        return _entry(f, d, where, files, version)
    if "inline" in d:
        return InlineItem(_inline(f, d["inline"], f"{where}.inline"))
    if "value" in d:
        return ValueItem(_value(f, d["value"], f"{where}.value"))
    f.fail(where, "expected 'chunks', 'inline' or 'value'", sorted(d))


def _group(f: Fields, obj: Any, where: str) -> dict[str, Any]:
    g = f.as_dict(obj, where)
    for i, fqn in enumerate(f.as_list(g.get("params", []), f"{where}.params")):
        f.as_str(fqn, f"{where}.params[{i}]")
    for k, v in g.items():
        if k != "params":
            _value(f, v, f"{where}[{show(k)}]")
    return dict(g)


def _optimizer(
    f: Fields, obj: Any, files: Mapping[str, FileDigest], version: int
) -> OptimizerSection | None:
    if obj is None:
        return None
    d = f.as_dict(obj, "optimizer")
    name = f.as_str(f.get(d, "class", "optimizer"), "optimizer.class", max_len=1024)
    raw = f.as_list(f.get(d, "param_groups", "optimizer"), "optimizer.param_groups")
    groups = tuple(_group(f, g, f"optimizer.param_groups[{i}]") for i, g in enumerate(raw))
    state: dict[str, dict[str, StateItem]] = {}
    for fqn, items in f.as_dict(f.get(d, "state", "optimizer"), "optimizer.state").items():
        where = f"optimizer.state[{show(fqn)}]"
        state[fqn] = {
            n: _item(f, v, f"{where}[{show(n)}]", files, version)
            for n, v in f.as_dict(items, where).items()
        }
    return OptimizerSection(name, groups, state)


def _files(f: Fields, obj: Any) -> dict[str, FileDigest]:
    out = {}
    for name, d in f.as_dict(obj, "files").items():
        where = f"files[{show(name)}]"
        f.file_name(name, where)
        d = f.as_dict(d, where)
        size = f.as_int(f.get(d, "size", where), f"{where}.size")
        crc = f.as_str(f.get(d, "crc32", where), f"{where}.crc32")
        if not _HEX8.fullmatch(crc):
            f.fail(f"{where}.crc32", "expected 8 lowercase hex digits", crc)
        out[name] = FileDigest(size, crc)
    return out


def _tensors(
    f: Fields, obj: Any, what: str, files: Mapping[str, FileDigest], version: int
) -> dict[str, TensorEntry]:
    return {
        k: _entry(f, v, f"{what}[{show(k)}]", files, version)
        for k, v in f.as_dict(obj, what).items()
    }


def _index_from_obj(obj: Any, raw: bytes, source: str) -> Index:
    f = Fields(source)
    if not isinstance(obj, dict) or obj.get("format") != FORMAT_NAME:
        raise CheckpointCorruptError(f"not an {FORMAT_NAME} index", path=source)
    version = obj.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION or version < 1:
        raise CheckpointCorruptError(
            f"format_version {show(version)}: this fsdp-ckpt reads "
            f"versions 1..{FORMAT_VERSION}; upgrade fsdp-ckpt",
            path=source,
        )
    files = _files(f, f.get(obj, "files", ""))
    extra = obj.get("extra")
    check_encoded(f, extra, "extra", tensor=functools.partial(_tensor_record, f, files))
    return Index(
        f.as_int(f.get(obj, "world_size", ""), "world_size", lo=1, hi=1 << 24),
        files,
        _tensors(f, f.get(obj, "params", ""), "params", files, version),
        _tensors(f, f.get(obj, "buffers", ""), "buffers", files, version),
        _optimizer(f, obj.get("optimizer"), files, version),
        extra,
        f.as_str(obj.get("library_version", ""), "library_version", max_len=256),
        checksum_problem=_checksum_problem(raw, obj),
    )


# ---- merging the ranks' parts ------------------------------------------------------------
def _merge_entries(
    into: dict[str, TensorEntry], part: Mapping[str, TensorEntry], what: str, source: str
) -> None:
    for name, entry in part.items():
        have = into.get(name)
        if have is None:
            into[name] = entry
            continue
        if (have.shape, have.dtype, have.per_param) != (entry.shape, entry.dtype, entry.per_param):
            raise CheckpointCorruptError(
                f"ranks disagree on {what} {name}: {have.shape} "
                f"{have.dtype} against {entry.shape} {entry.dtype}",
                path=source,
            )
        into[name] = replace(have, chunks=have.chunks + entry.chunks)


def _merge_state(
    into: dict[str, dict[str, StateItem]], part: Mapping[str, Mapping[str, StateItem]], source: str
) -> None:
    for fqn, items in part.items():
        slot = into.setdefault(fqn, {})
        tensors = {n: v for n, v in items.items() if isinstance(v, TensorEntry)}
        merged = {n: v for n, v in slot.items() if isinstance(v, TensorEntry)}
        _merge_entries(merged, tensors, f"optimizer state of {fqn}:", source)
        for n, v in items.items():
            if not isinstance(v, TensorEntry):
                slot.setdefault(n, v)  # only the owner of element 0 writes these
        slot.update(merged)


def merge_indexes(parts: Sequence[Index], *, source: str) -> Index:
    """One index from every rank's part (rank order); rank 0's part carries groups and extra."""
    files: dict[str, FileDigest] = {}
    params: dict[str, TensorEntry] = {}
    buffers: dict[str, TensorEntry] = {}
    state: dict[str, dict[str, StateItem]] = {}
    for part in parts:
        files.update(part.files)
        _merge_entries(params, part.params, "parameter", source)
        _merge_entries(buffers, part.buffers, "buffer", source)
        if part.optimizer is not None:
            _merge_state(state, part.optimizer.state, source)
    head = parts[0]
    opt = None if head.optimizer is None else replace(head.optimizer, state=state)
    return replace(
        head, files=files, params=params, buffers=buffers, optimizer=opt, world_size=len(parts)
    )
