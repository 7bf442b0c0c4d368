"""`load`: match by FQN, read and verify only the files holding this rank's slices, then apply.

Order matters for "never a wrong model": (1) the index alone decides what matches (strict mode
raises here, before any file is read); (2) every needed file is read whole and its size and
CRC-32 checked (local files are memory-mapped: read from the page cache, no private copy);
(3) every rank says whether its reads succeeded (one all-reduce); (4) only then are the wanted
elements copied straight from the files into the parameters, buffers and optimizer state (an
optimizer's existing state tensors are reused when their shapes match), once.
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ._agreement import _alone, from_rank0, rank0_code, vote
from ._args import check_bool, check_model, check_path, check_storage
from ._box import Box, Region, copy_region, flat_span
from ._directory import (
    INDEX_FILE,
    OpenCheckpoint,
    parse_index,
    pointer_version,
    replaced_error,
    still_current,
)
from ._errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointMismatchWarning,
    LoadReport,
    ShapeMismatch,
    add_note,
)
from ._index import Chunk, TensorEntry
from ._model_view import ModelView, Piece, model_view
from ._open import open_guarded
from ._optim_state import Fill, OptimizerLoad, plan_optimizer_load
from ._storage import Storage, storage_for
from ._tensor_file import TensorFile, dtype_from_name, read_verified
from ._values import decode_value, tensor_records

__all__ = ["load", "read_for", "copy_into"]

_log = logging.getLogger("fsdp.ckpt")


@dataclass
class _Plan:
    fills: list[Fill] = field(default_factory=list)  # destinations written only after the vote
    after: list[Callable[[], None]] = field(default_factory=list)  # run after the fills
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    mismatched: list[ShapeMismatch] = field(default_factory=list)
    optimizer: OptimizerLoad | None = None
    extra_tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    def report(self) -> LoadReport:
        return LoadReport(
            tuple(sorted(self.missing)),
            tuple(sorted(self.unexpected)),
            tuple(sorted(self.mismatched, key=lambda m: m.fqn)),
            None if self.optimizer is None else self.optimizer.class_mismatch,
        )

    def fill(
        self, name: str, entry: TensorEntry, box: Box, target: torch.Tensor, source: str
    ) -> None:
        """Fill ``target`` (the box ``box`` of ``entry``'s tensor, in any shape of as many
        elements) from ``entry``: in place when ``target`` is contiguous, else through a
        staging tensor copied in afterwards."""
        dtype = dtype_from_name(entry.dtype, source=source)
        if target.is_contiguous():
            self.fills.append(Fill(name, entry, box, target.view(-1)))
            return
        staged = torch.empty(target.shape, dtype=dtype)
        self.fills.append(Fill(name, entry, box, staged.view(-1)))

        def copy_back() -> None:
            target.copy_(staged)

        self.after.append(copy_back)


def _match(names: tuple[str, ...], entries: Mapping[str, TensorEntry]) -> str | None:
    return next((n for n in names if n in entries), None)


def _piece_target(piece: Piece) -> torch.Tensor:
    # A whole plain parameter is written through the parameter itself (in its shape); a
    # sharded one (a DTensor of the global shape) through its piece of the local shard.
    if tuple(piece.param.shape) == piece.global_shape and piece.unit is None:
        return piece.param.detach()
    return piece.local


def _plan_params(
    plan: _Plan, view: ModelView, params: Mapping[str, TensorEntry], used: set[str], source: str
) -> None:
    for piece in view.pieces:
        name = _match((piece.fqn, *piece.aliases), params)
        if name is None:
            plan.missing.append(piece.fqn)
            continue
        used.update(a for a in (piece.fqn, *piece.aliases) if a in params)  # tied: all names
        entry = params[name]
        if entry.shape != piece.global_shape:
            plan.mismatched.append(ShapeMismatch(piece.fqn, entry.shape, piece.global_shape))
        elif piece.length:
            plan.fill(f"parameter {name}", entry, piece.box, _piece_target(piece), source)


def _plan_buffers(
    plan: _Plan, view: ModelView, buffers: Mapping[str, TensorEntry], used: set[str], source: str
) -> None:
    for fqn, buf in view.buffers.items():
        aliases = view.buffer_aliases.get(fqn, (fqn,))
        name = _match(aliases, buffers)
        if name is None:
            plan.missing.append(fqn)
            continue
        used.update(a for a in aliases if a in buffers)
        entry = buffers[name]
        if entry.shape != tuple(buf.shape):
            plan.mismatched.append(ShapeMismatch(fqn, entry.shape, tuple(buf.shape)))
        else:
            plan.fill(f"buffer {name}", entry, Box.whole(buf.shape), buf.detach(), source)


def _plan_extra(plan: _Plan, extra: Any, source: str) -> None:
    for record in tensor_records(extra):
        shape = tuple(int(d) for d in record["shape"])
        staged = torch.empty(shape, dtype=dtype_from_name(record["dtype"], source=source))
        numel = staged.numel()
        chunks = (Chunk(record["file"], record["key"], 0, numel),) if numel else ()
        entry = TensorEntry(shape, record["dtype"], chunks)
        plan.fills.append(
            Fill(f"extra tensor {record['key']}", entry, Box.whole(shape), staged.view(-1))
        )
        plan.extra_tensors[record["key"]] = staged


def _plan(opened: OpenCheckpoint, view: ModelView, optimizer: Any, source: str) -> _Plan:
    plan = _Plan()
    # One namespace: checkpoints converted from DCP cannot tell buffers from parameters.
    tensors = {**opened.index.params, **opened.index.buffers}
    used: set[str] = set()
    _plan_params(plan, view, tensors, used, source)
    _plan_buffers(plan, view, tensors, used, source)
    plan.unexpected += [n for n in tensors if n not in used]
    _plan_extra(plan, opened.index.extra, source)
    if optimizer is not None:
        opt = plan_optimizer_load(optimizer, view, opened.index.optimizer, source=source)
        plan.fills += opt.fills
        plan.missing += opt.missing
        plan.unexpected += opt.unexpected
        plan.mismatched += [ShapeMismatch(*m) for m in opt.mismatched]
        plan.optimizer = opt
    return plan


@dataclass(frozen=True)
class _Copy:
    chunk: Chunk
    fill: Fill
    regions: tuple[Region, ...]  # the chunk's regions that meet the fill's box


def _meeting(chunk: Chunk, fill: Fill, span: tuple[int, int]) -> tuple[Region, ...]:
    """The regions of ``chunk`` that share elements with ``fill``'s box (Note [boxes])."""
    if chunk.box is None and (chunk.start >= span[1] or chunk.start + chunk.length <= span[0]):
        return ()  # a flat chunk outside the box's flat span: the common case, cheaply
    return tuple(
        r for r in chunk.regions(fill.entry.shape) if r.box.intersect(fill.box) is not None
    )


def read_for(
    storage: Storage, directory: str, digests: Mapping[str, Any], fills: list[Fill]
) -> list[tuple[TensorFile, list[_Copy]]]:
    """Read and verify each file that ``fills`` draw from (once each). Changes nothing."""
    by_file: dict[str, list[_Copy]] = {}
    for fill in fills:
        span = flat_span(fill.entry.shape, fill.box)
        for chunk in fill.entry.chunks:
            regions = _meeting(chunk, fill, span)
            if regions:
                by_file.setdefault(chunk.file, []).append(_Copy(chunk, fill, regions))
    out = []
    for name, copies in sorted(by_file.items()):
        data = read_verified(storage, storage.join(directory, name), digests[name])
        for c in copies:
            _check_source(data, c)
        out.append((data, copies))
    return out


def _check_source(data: TensorFile, c: _Copy) -> None:
    src = data.get(c.chunk.key)
    want = dtype_from_name(c.fill.entry.dtype, source=data.path)
    if src.numel() != c.chunk.length or src.dtype != want:
        raise CheckpointCorruptError(
            f"{c.chunk.key} holds {src.numel()} {src.dtype} elements, "
            f"the index records {c.chunk.length} {want}",
            path=data.path,
        )


def copy_into(files: list[tuple[TensorFile, list[_Copy]]]) -> None:
    """Copy the wanted elements of verified files into the fills' destinations."""
    with torch.no_grad():
        for data, copies in files:
            for c in copies:
                src = data.get(c.chunk.key).reshape(-1)
                for region in c.regions:
                    copy_region(src, region, c.fill.dst, c.fill.box)


# Note [one version per load]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Each rank used to read CURRENT itself, so a save committing in between had ranks load
# different versions. Now rank 0 alone resolves the pointer, checks the index, and sends every
# rank the index it read (`from_rank0`): all ranks load the version rank 0 found. A save may
# still commit while the files are read, and with keep_last=1 delete the version being read;
# the reads then fail, and rank 0 looks at CURRENT again: if it moved on, every rank starts
# over with the new version (at most _LOAD_ATTEMPTS times), so a reader racing saves is never
# told that a healthy checkpoint is corrupt. Files already opened stay readable when deleted.
_LOAD_ATTEMPTS = 3


def _resolve(storage: Storage, source: str) -> OpenCheckpoint:
    """Rank 0: the committed version at ``source``, checked (Note [one version per load])."""
    for _ in range(_LOAD_ATTEMPTS):
        before = pointer_version(storage, source)
        try:
            return open_guarded(storage, source)  # special files refused, listed files checked
        except (CheckpointCorruptError, FileNotFoundError):
            if pointer_version(storage, source) == before:
                raise  # nothing moved on: the damage is real
    raise replaced_error(source, _LOAD_ATTEMPTS)


def _open_agreed(storage: Storage, source: str, backend: Any) -> OpenCheckpoint:
    """The version rank 0 resolved, with its index, on every rank (two broadcasts)."""
    if _alone(backend):  # nothing to send: serialising the index cost more than the load
        return _resolve(storage, source)
    found: list[OpenCheckpoint] = []

    def produce() -> bytes:
        found.append(_resolve(storage, source))
        return found[0].directory.encode() + b"\0" + found[0].index.to_json().encode()

    data = from_rank0(backend, produce, f"load of {source}")
    if found:
        return found[0]
    directory, _, index = data.partition(b"\0")
    name = directory.decode()
    return OpenCheckpoint(name, parse_index(index, storage.join(name, INDEX_FILE)))


def _overtaken(
    storage: Storage, source: str, opened: OpenCheckpoint, backend: Any, rank: int
) -> bool:
    """Rank 0's answer, on every rank: did a commit replace the version being read?"""
    moved = rank == 0 and not still_current(storage, source, opened.directory)
    return rank0_code(backend, int(moved)) == 1


def _read_agreed(
    storage: Storage, opened: OpenCheckpoint, plan: _Plan, view: ModelView, source: str, last: bool
) -> list[tuple[TensorFile, list[_Copy]]] | None:
    """Read and verify this rank's files; go on only if every rank could (one all-reduce).
    None: a commit replaced the version meanwhile, read the new one (unless ``last``)."""
    error = None
    files: list[tuple[TensorFile, list[_Copy]]] = []
    try:
        files = read_for(storage, opened.directory, opened.index.files, plan.fills)
    except Exception as exc:
        error = exc
    failures = vote(view.backend, error)
    if failures is None:
        return files
    if _overtaken(storage, source, opened, view.backend, view.rank):
        if not last:
            return None
        raise replaced_error(source, _LOAD_ATTEMPTS) from error
    who, its = failures.who(), failures.its()
    if error is not None:  # this rank's own error names its file; the note names the ranks
        if view.world_size > 1:
            others = f": {failures.describe()}" if len(failures.ranks) > 1 else ""
            add_note(
                error,
                f"load of {source} abandoned on every rank: {who} could not read or verify "
                f"{its} files (this is rank {view.rank}){others}; nothing was changed",
            )
        raise error
    raise CheckpointError(
        f"load of {source} abandoned: {who} could not read or verify {its} files "
        f"{failures.raised_there()}: {failures.describe()}; nothing was changed"
    )


def _check_args(path: Any, model: Any, strict: Any, storage: Any) -> None:
    check_path(path)
    check_model(model)
    check_bool(strict, "strict")
    check_storage(storage)


def load(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    strict: bool = True,
    backend: Any = None,
    storage: Storage | None = None,
) -> dict[str, Any]:
    """Load the checkpoint at ``path`` into ``model`` (and ``optimizer``); returns ``extra``.

    Works at any world size and wrapping: sharded models take just the slices they hold, plain
    models take everything. Every rank calls it. ``strict``: raise `CheckpointMismatchError`
    listing every missing and unexpected key and shape mismatch by FQN, before anything is
    changed; with ``strict=False`` what matches is loaded and the rest reported in a
    `CheckpointMismatchWarning`. A file that is missing, truncated or altered raises
    `CheckpointCorruptError` naming it on the rank that read it (`CheckpointError` on the
    others), before anything is changed on any rank.
    ``path`` is a checkpoint path (its committed version) or a version directory. Every rank
    loads the version rank 0 resolved, even while saves commit; a load overtaken by commits
    that deleted the version it was reading starts over with the new one (up to 3 times).
    """
    _check_args(path, model, strict, storage)
    started = time.perf_counter()
    store = storage_for(path, storage)
    source = os.fspath(path)
    view = model_view(model, backend=backend)
    for attempt in range(_LOAD_ATTEMPTS):  # Note [one version per load]
        opened = _open_agreed(store, source, view.backend)
        plan = _plan(opened, view, optimizer, source)
        report = plan.report()
        if strict and not report.clean:
            raise CheckpointMismatchError(report, path=source)
        files = _read_agreed(store, opened, plan, view, source, attempt == _LOAD_ATTEMPTS - 1)
        if files is not None:
            break
    assert files is not None  # the last attempt returns files or raises
    if not report.clean:
        warnings.warn(CheckpointMismatchWarning(report, path=source), stacklevel=2)
    copy_into(files)
    _log.info(
        "loaded %s (%s): %d bytes read by this rank in %.2f s",
        source,
        opened.directory,
        sum(opened.index.files[copies[0].chunk.file].size for _, copies in files),
        time.perf_counter() - started,
    )
    del files
    for step in plan.after:
        step()
    if plan.optimizer is not None:
        plan.optimizer.apply(optimizer)  # type: ignore[arg-type]
    extra = decode_value(
        opened.index.extra, tensors=lambda r: plan.extra_tensors[r["key"]], source=source
    )
    return {} if extra is None else extra
