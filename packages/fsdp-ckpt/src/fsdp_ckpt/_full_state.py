"""`full_state_dict`: every parameter whole, gathered one unit at a time.

For each unit every rank lays the unit's parameters out in one byte buffer (each parameter at
an 8-byte aligned offset), writes the boxes it holds into it (a dim-0 shard, a tensor-parallel
piece: Note [boxes] in ``_box.py``), zeros elsewhere, and the buffer
is summed across ranks as int64. Adding zeros to the integer image of a value is exact, so the
result is bit for bit the parameter (signed zeros and NaN payloads included) for any dtype, and
replicas (which write zeros) need no separate group. Rank 0 keeps views of the buffer as its
copy (on CPU no further copy is made); other ranks drop it before the next unit. So rank 0
holds the full CPU copy plus at most one unit in flight.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ._args import check_bool
from ._model_view import ModelView, Piece, model_view

__all__ = ["full_state_dict", "unit_groups"]


def unit_groups(view: ModelView) -> Iterator[list[Piece]]:
    """This rank's pieces grouped into runs that share a unit (layout order)."""
    group: list[Piece] = []
    for piece in view.pieces:
        if group and _unit_key(group[0]) != _unit_key(piece):
            yield group
            group = []
        group.append(piece)
    if group:
        yield group


def _unit_key(piece: Piece) -> Any:
    # Pieces of plain parameters (outside every unit) each form their own group.
    return piece.unit if piece.unit is not None else id(piece)


def _offsets(group: list[Piece]) -> tuple[list[int], int]:
    offsets, cursor = [], 0
    for piece in group:
        offsets.append(cursor)
        itemsize = torch.empty(0, dtype=piece.dtype).element_size()
        cursor += -(-piece.numel * itemsize // 8) * 8
    return offsets, max(cursor, 8)


def _gather_group(
    view: ModelView, group: list[Piece], device: torch.device, keep: bool
) -> dict[str, torch.Tensor]:
    offsets, nbytes = _offsets(group)
    buf = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    for piece, off in zip(group, offsets):
        if piece.writes and piece.length:
            _write_box(buf, off, piece)
    if view.backend is not None and view.backend.world_size > 1:
        view.backend.all_reduce(buf.view(torch.int64))
    if not keep:
        return {}
    out = {}
    for piece, off in zip(group, offsets):
        itemsize = torch.empty(0, dtype=piece.dtype).element_size()
        raw = buf[off : off + piece.numel * itemsize]
        out[piece.fqn] = raw.view(piece.dtype).view(piece.global_shape)
    return out


def _write_box(buf: torch.Tensor, off: int, piece: Piece) -> None:
    """Write ``piece``'s box into the parameter's byte image at ``off`` of ``buf`` (each
    element as its ``itemsize`` bytes: a bit-exact copy whatever the dtype)."""
    itemsize = piece.local.element_size()
    image = buf[off : off + piece.numel * itemsize].view(*piece.global_shape, itemsize)
    src = piece.local.detach().view(torch.uint8).view(*piece.box.sizes, itemsize)
    for dim, (lo, n) in enumerate(zip(piece.box.offsets, piece.box.sizes)):
        image = image.narrow(dim, lo, n)
    image.copy_(src)


def _device(view: ModelView) -> torch.device:
    return torch.device(view.backend.device) if view.backend is not None else torch.device("cpu")


def full_state_dict(
    model: nn.Module, *, rank0_only: bool = True, cpu_offload: bool = True, backend: Any = None
) -> dict[str, torch.Tensor]:
    """Every parameter (whole) and persistent buffer of ``model`` by FQN.

    Collective for sharded models: every rank calls it. With ``rank0_only`` the other ranks
    get an empty dict (and hold at most one unit at a time); ``cpu_offload`` moves each
    unit's values to CPU as soon as it is gathered. Tied parameters appear once, under their
    first name. Suitable for `safetensors.torch.save_file` or `torch.save`. For a plain
    (unsharded) model the values are the live parameters themselves, as in ``state_dict()``.
    """
    check_bool(rank0_only, "rank0_only")
    check_bool(cpu_offload, "cpu_offload")
    view = model_view(model, backend=backend)
    keep = view.rank == 0 or not rank0_only
    out: dict[str, torch.Tensor] = {}
    if not view.sharded:
        if keep:
            out = {p.fqn: p.param.detach() for p in view.pieces}
    else:
        for group in unit_groups(view):
            part = _gather_group(view, group, _device(view), keep)
            out.update({k: v.to("cpu") if cpu_offload else v for k, v in part.items()})
    if keep:
        out.update({k: b.detach() for k, b in view.buffers.items()})
        if cpu_offload:
            out = {k: v.to("cpu") for k, v in out.items()}
    return out
