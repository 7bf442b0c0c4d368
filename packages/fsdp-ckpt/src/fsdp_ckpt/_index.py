"""The checkpoint index (``index.json``): what every tensor is and where its pieces are.

Format version 1 (see the package README for an example)::

    {"format": "fsdp-ckpt", "format_version": 1, "library_version": "0.1.0",
     "world_size": 4,
     "files":   {"shard-00000.safetensors": {"size": 123, "crc32": "1a2b3c4d"}, ...},
     "params":  {"<fqn>": <entry>, ...},
     "buffers": {"<fqn>": <entry>, ...},
     "optimizer": null | {"class": "AdamW", "param_groups": [{..., "params": ["<fqn>", ...]}],
                          "state": {"<fqn>": {"exp_avg": <entry>, "step": <item>, ...}}},
     "extra": <JSON value>}

An entry is ``{"shape": [...], "dtype": "float32", "chunks": [{"file", "key", "start",
"length"}]}``: chunk ``key`` of ``file`` holds elements ``start .. start+length`` of the
flattened tensor. Optimizer state that is shaped like its parameter is marked ``"per_param":
true`` and sliced the same way, so it moves with the parameter when the world size changes.
Small state (``step``) is an ``{"inline": {"dtype", "shape", "values"}}`` item and plain Python
state a ``{"value": ...}`` item. Each rank writes a partial index of what it holds
(``rank-00003.json``); rank 0 merges them with `merge_indexes` at commit.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Union

from ._errors import CheckpointCorruptError
from ._tensor_file import FileDigest

__all__ = ["FORMAT_NAME", "FORMAT_VERSION", "Chunk", "TensorEntry", "InlineItem", "ValueItem",
           "StateItem", "OptimizerSection", "Index", "merge_indexes"]

FORMAT_NAME = "fsdp-ckpt"
FORMAT_VERSION = 1


@dataclass(frozen=True)
class Chunk:
    """Elements ``start .. start+length`` of a flattened tensor, stored as ``key`` in ``file``."""

    file: str
    key: str
    start: int
    length: int


@dataclass(frozen=True)
class TensorEntry:
    """A tensor stored in tensor files, whole or in flat slices."""

    shape: tuple[int, ...]
    dtype: str
    chunks: tuple[Chunk, ...]
    per_param: bool = False  # optimizer state sliced like its parameter

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


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

    def to_json(self) -> str:
        """Deterministic JSON text (same inputs, same bytes)."""
        return json.dumps(_index_to_obj(self), indent=1, sort_keys=False) + "\n"

    @classmethod
    def from_json(cls, text: str | bytes, *, source: str) -> Index:
        """Parse and check an index; CheckpointCorruptError naming ``source`` when malformed."""
        try:
            obj = json.loads(text)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointCorruptError(f"not valid JSON ({exc})", path=source) from None
        try:
            return _index_from_obj(obj, source)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            if isinstance(exc, CheckpointCorruptError):
                raise
            raise CheckpointCorruptError(f"malformed index ({type(exc).__name__}: {exc})",
                                         path=source) from None

    def entries(self) -> dict[str, TensorEntry]:
        """Every file-backed tensor, named ``params/..``, ``buffers/..``, ``optimizer/fqn/..``."""
        out = {f"params/{k}": v for k, v in self.params.items()}
        out.update({f"buffers/{k}": v for k, v in self.buffers.items()})
        if self.optimizer is not None:
            for fqn, items in self.optimizer.state.items():
                out.update({f"optimizer/{fqn}/{n}": v for n, v in items.items()
                            if isinstance(v, TensorEntry)})
        return out

    def check_complete(self, *, source: str) -> None:
        """Every tensor's chunks tile it exactly and name files the index lists."""
        for name, entry in self.entries().items():
            _check_tiling(name, entry, self.files, source)


def _check_tiling(name: str, entry: TensorEntry, files: Mapping[str, FileDigest],
                  source: str) -> None:
    cursor = 0
    for chunk in sorted(entry.chunks, key=lambda c: c.start):
        if chunk.file not in files:
            raise CheckpointCorruptError(f"{name} names file {chunk.file!r} that the index "
                                         "does not list", path=source)
        if chunk.start != cursor or chunk.length <= 0:
            raise CheckpointCorruptError(f"{name}: pieces do not tile the tensor (gap or "
                                         f"overlap at element {cursor})", path=source)
        cursor += chunk.length
    if cursor != entry.numel:
        raise CheckpointCorruptError(f"{name}: pieces hold {cursor} of {entry.numel} elements",
                                     path=source)


# ---- JSON <-> dataclasses ---------------------------------------------------------------------
def _entry_to_obj(e: TensorEntry) -> dict[str, Any]:
    obj: dict[str, Any] = {"shape": list(e.shape), "dtype": e.dtype,
                           "chunks": [{"file": c.file, "key": c.key, "start": c.start,
                                       "length": c.length} for c in e.chunks]}
    if e.per_param:
        obj["per_param"] = True
    return obj


def _entry_from_obj(obj: Mapping[str, Any]) -> TensorEntry:
    chunks = tuple(Chunk(str(c["file"]), str(c["key"]), int(c["start"]), int(c["length"]))
                   for c in obj["chunks"])
    return TensorEntry(tuple(int(d) for d in obj["shape"]), str(obj["dtype"]), chunks,
                       bool(obj.get("per_param", False)))


def _item_to_obj(item: StateItem) -> dict[str, Any]:
    if isinstance(item, TensorEntry):
        return _entry_to_obj(item)
    if isinstance(item, InlineItem):
        return {"inline": dict(item.tensor)}
    return {"value": item.value}


def _item_from_obj(obj: Mapping[str, Any]) -> StateItem:
    if "chunks" in obj:
        return _entry_from_obj(obj)
    if "inline" in obj:
        return InlineItem(dict(obj["inline"]))
    return ValueItem(obj["value"])


def _index_to_obj(ix: Index) -> dict[str, Any]:
    opt = None
    if ix.optimizer is not None:
        opt = {"class": ix.optimizer.class_name,
               "param_groups": [dict(g) for g in ix.optimizer.param_groups],
               "state": {fqn: {n: _item_to_obj(v) for n, v in items.items()}
                         for fqn, items in ix.optimizer.state.items()}}
    return {"format": FORMAT_NAME, "format_version": FORMAT_VERSION,
            "library_version": ix.library_version, "world_size": ix.world_size,
            "files": {k: {"size": d.size, "crc32": d.crc32} for k, d in ix.files.items()},
            "params": {k: _entry_to_obj(v) for k, v in ix.params.items()},
            "buffers": {k: _entry_to_obj(v) for k, v in ix.buffers.items()},
            "optimizer": opt, "extra": ix.extra}


def _index_from_obj(obj: Any, source: str) -> Index:
    if not isinstance(obj, dict) or obj.get("format") != FORMAT_NAME:
        raise CheckpointCorruptError(f"not an {FORMAT_NAME} index", path=source)
    version = obj.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION or version < 1:
        raise CheckpointCorruptError(f"format_version {version!r}: this fsdp-ckpt reads "
                                     f"versions 1..{FORMAT_VERSION}; upgrade fsdp-ckpt",
                                     path=source)
    opt = obj.get("optimizer")
    section = None
    if opt is not None:
        section = OptimizerSection(
            str(opt["class"]), tuple(dict(g) for g in opt["param_groups"]),
            {fqn: {n: _item_from_obj(v) for n, v in items.items()}
             for fqn, items in opt["state"].items()})
    return Index(
        int(obj["world_size"]),
        {k: FileDigest(int(d["size"]), str(d["crc32"])) for k, d in obj["files"].items()},
        {k: _entry_from_obj(v) for k, v in obj["params"].items()},
        {k: _entry_from_obj(v) for k, v in obj["buffers"].items()},
        section, obj.get("extra"), str(obj.get("library_version", "")))


# ---- merging the ranks' parts ------------------------------------------------------------
def _merge_entries(into: dict[str, TensorEntry], part: Mapping[str, TensorEntry],
                   what: str, source: str) -> None:
    for name, entry in part.items():
        have = into.get(name)
        if have is None:
            into[name] = entry
            continue
        if (have.shape, have.dtype, have.per_param) != (entry.shape, entry.dtype,
                                                        entry.per_param):
            raise CheckpointCorruptError(f"ranks disagree on {what} {name}: {have.shape} "
                                         f"{have.dtype} against {entry.shape} {entry.dtype}",
                                         path=source)
        into[name] = replace(have, chunks=have.chunks + entry.chunks)


def _merge_state(into: dict[str, dict[str, StateItem]],
                 part: Mapping[str, Mapping[str, StateItem]], source: str) -> None:
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
    return replace(head, files=files, params=params, buffers=buffers, optimizer=opt,
                   world_size=len(parts))
