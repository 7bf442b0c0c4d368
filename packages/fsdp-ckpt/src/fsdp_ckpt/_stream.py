"""Whole tensors one at a time: from a checkpoint (`iter_full_tensors`) or from a live sharded
model (`iter_full_state_dict`).

Both return a generator after checking everything they can up front (the checkpoint opened and
verified, every requested name known), so a bad call raises where it is made. Each step of the
generator assembles one tensor and hands it over; nothing else is kept, so a consumer that
writes each tensor out (or packs them into bounded files) holds at most what it keeps itself
plus one tensor. For a sharded model each step is a collective: every rank iterates the same
names to the end.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from ._args import check_bool, check_names, check_path, check_storage
from ._export import Assembler, model_entries
from ._full_state import _device, _gather_group
from ._inspect import verify_opened
from ._model_view import Piece, model_view
from ._open import open_guarded
from ._storage import Storage, storage_for

__all__ = ["iter_full_tensors", "iter_full_state_dict"]


def _names(requested: Sequence[str] | None, known: Sequence[str], what: str) -> list[str]:
    if requested is None:
        return list(known)
    names = check_names(requested)
    assert names is not None
    have = set(known)
    unknown = [n for n in names if n not in have]
    if unknown:
        raise ValueError(
            f"names: {what} has no tensor {', '.join(map(repr, unknown[:5]))}"
            f"{' ...' if len(unknown) > 5 else ''} ({len(have)} known)"
        )
    return names


def iter_full_tensors(
    path: str | os.PathLike[str],
    *,
    names: Sequence[str] | None = None,
    verify: bool = True,
    storage: Storage | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(fqn, tensor)`` for every parameter and buffer of the checkpoint at ``path`` (the
    model state that `export` writes), each assembled whole from the rank files when the
    generator reaches it: parameters then buffers in index order, or the order of ``names``.

    The checkpoint is opened (and with ``verify``, every file checked as `verify` does) before
    this returns, so a missing or damaged checkpoint raises `CheckpointError` here, and an
    unknown name `ValueError`. Each tensor is a new CPU tensor owned by the caller."""
    source = check_path(path)
    check_bool(verify, "verify")
    check_storage(storage)
    store = storage_for(path, storage)
    opened = open_guarded(store, source)
    if verify:
        verify_opened(store, opened)
    entries = model_entries(opened)
    order = _names(names, list(entries), f"the checkpoint at {os.fspath(path)}")
    assembler = Assembler(store, opened)

    def generate() -> Iterator[tuple[str, torch.Tensor]]:
        for name in order:
            yield name, assembler.tensor(entries[name])

    return generate()


def iter_full_state_dict(
    model: nn.Module,
    *,
    names: Sequence[str] | None = None,
    rank0_only: bool = True,
    backend: Any = None,
) -> Iterator[tuple[str, torch.Tensor | None]]:
    """``(fqn, tensor)`` for every parameter (whole) and persistent buffer of ``model``, one
    tensor gathered per step: `full_state_dict` without holding the whole model.

    The order is the model's layout order (parameters, then buffers), or that of ``names``
    (any registered name of a parameter: a tied weight answers to each of its names; the name
    is yielded as asked). For a sharded model every step is a collective: every rank calls
    this with the same ``names`` and iterates to the end. With ``rank0_only`` the other ranks
    get ``(fqn, None)`` (and hold one tensor at most while it is reduced). Tensors are on CPU;
    for a plain (unsharded) model they are the live parameters, detached."""
    check_bool(rank0_only, "rank0_only")
    view = model_view(model, backend=backend)
    by_name: dict[str, Piece | torch.Tensor] = {}
    for piece in view.pieces:
        for alias in (piece.fqn, *piece.aliases):
            by_name.setdefault(alias, piece)
    for fqn, buf in view.buffers.items():
        for alias in view.buffer_aliases.get(fqn, (fqn,)):
            by_name.setdefault(alias, buf)
    default = [p.fqn for p in view.pieces] + list(view.buffers)
    order = _names(names, list(by_name) if names is not None else default, "the model")
    keep = view.rank == 0 or not rank0_only

    def one(item: Piece | torch.Tensor) -> torch.Tensor | None:
        if isinstance(item, torch.Tensor):  # a buffer: whole on every rank
            return item.detach().to("cpu") if keep else None
        if not view.sharded:
            return item.param.detach().to("cpu") if keep else None
        part = _gather_group(view, [item], _device(view), keep)
        return part[item.fqn].to("cpu") if keep else None

    def generate() -> Iterator[tuple[str, torch.Tensor | None]]:
        for name in order:
            yield name, one(by_name[name])

    return generate()
