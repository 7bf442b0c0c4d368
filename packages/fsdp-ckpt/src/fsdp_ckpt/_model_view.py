"""What a model holds on this rank, in one shape for sharded and plain models.

A sharded model (fsdp-engine units) is read through `fsdp_engine.sharded_layout`: per original
parameter, the box of it this rank holds (Note [boxes] in ``_box.py``: a dim-0 shard, a
tensor-parallel piece or a dp chunk of one) and a view of it (writing into the view changes the
model). A plain ``nn.Module`` holds every parameter whole: the box of its whole shape. Either
way a `Piece` says which elements of which parameter this rank has, and whether it writes them
(one replica of each box writes: not the hybrid replicas other than the first, nor the tp ranks
other than the first of a parameter tensor parallelism replicates).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from fsdp_engine import FSDPModule, sharded_layout
from torch import nn

from ._args import check_backend, check_model
from ._box import Box, flat_box_start
from ._index import Chunk, box_chunk

__all__ = ["Piece", "ModelView", "model_view", "find_backend"]


@dataclass(frozen=True)
class Piece:
    """The box ``box`` of parameter ``fqn``, held by this rank."""

    fqn: str  # the name written to checkpoints (the engine's, or the first registered name)
    aliases: tuple[str, ...]  # every name of this parameter (tied weights have several)
    global_shape: tuple[int, ...]
    dtype: torch.dtype
    box: Box
    local: torch.Tensor  # 1-D view of the held elements, the box in row-major order (writable)
    param: nn.Parameter
    writes: bool  # this rank saves the box (first replica only)
    owner: bool  # this rank saves the parameter's whole-tensor optimizer state (e.g. step)
    unit: str | None = None  # FQN of the engine unit holding it; None outside every unit

    @property
    def numel(self) -> int:
        """Elements of the whole parameter."""
        n = 1
        for d in self.global_shape:
            n *= d
        return n

    @property
    def length(self) -> int:
        """Elements held here."""
        return self.box.numel

    def chunk(self, file: str, key: str) -> Chunk:
        """The index chunk of the held elements stored as ``key`` in ``file``: a flat slice
        where the box is one (what format version 1 knows), else a box chunk."""
        start = flat_box_start(self.global_shape, self.box)
        if start is None:
            return box_chunk(file, key, self.box)
        return Chunk(file, key, start, self.length)


@dataclass(frozen=True)
class ModelView:
    """This rank's pieces, the model's persistent buffers, and who this rank is."""

    pieces: tuple[Piece, ...]
    buffers: dict[str, torch.Tensor]
    buffer_aliases: dict[str, tuple[str, ...]]
    sharded: bool
    backend: Any  # fsdp_comm.Backend spanning every rank, or None for one process
    rank: int
    world_size: int

    @functools.cached_property
    def _by_param(self) -> dict[int, Piece]:
        return {id(p.param): p for p in self.pieces}

    def piece_of(self, param: nn.Parameter) -> Piece | None:
        """The piece of ``param`` (by identity), if the model has it."""
        return self._by_param.get(id(param))


def find_backend(model: nn.Module) -> Any:
    """The backend spanning every rank of a sharded model (`fsdp_engine.model_backend`), or
    None for a plain module (the caller's ``backend=`` then decides)."""
    if not any(getattr(m, "_fsdp_state", None) is not None for m in model.modules()):
        return None
    from fsdp_engine import model_backend

    return model_backend(model)


def _names_by_param(model: nn.Module) -> dict[int, list[str]]:
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return names


def _persistent_buffers(
    model: nn.Module,
) -> tuple[dict[str, torch.Tensor], dict[str, tuple[str, ...]]]:
    found: dict[int, tuple[str, torch.Tensor]] = {}
    aliases: dict[int, list[str]] = {}
    for mod_name, mod in model.named_modules(remove_duplicate=False):
        skip: set[str] = getattr(mod, "_non_persistent_buffers_set", set())
        for name, buf in mod._buffers.items():
            if buf is None or name in skip:
                continue
            fqn = f"{mod_name}.{name}" if mod_name else name
            found.setdefault(id(buf), (fqn, buf))
            aliases.setdefault(id(buf), []).append(fqn)
    buffers = {fqn: buf for fqn, buf in found.values()}
    return buffers, {found[k][0]: tuple(v) for k, v in aliases.items()}


def _sharded_pieces(model: nn.Module, names: dict[int, list[str]]) -> list[Piece]:
    by_name = dict(model.named_parameters(remove_duplicate=False))
    pieces = []
    for s in sharded_layout(model):
        param = by_name[s.fqn]
        box = Box(tuple(s.offsets), tuple(s.sizes))
        first = box.numel > 0 and not any(s.offsets)  # holds element 0
        empty = s.global_shape.numel() == 0 and s.shard_rank == 0 and s.tp_rank == 0
        pieces.append(
            Piece(
                s.fqn,
                tuple(names[id(param)]),
                tuple(s.global_shape),
                s.dtype,
                box,
                s.local,
                param,
                writes=s.replicate_rank == 0,
                owner=s.replicate_rank == 0 and (first or empty),
                unit=s.unit_fqn,
            )
        )
    return pieces


def _whole_piece(fqn: str, aliases: list[str], p: nn.Parameter, rank: int) -> Piece:
    # A plain parameter is one slice: every rank holds all of it, rank 0 writes it.
    data = p.detach()
    local = data.view(-1) if data.is_contiguous() else data.reshape(-1)
    return Piece(
        fqn,
        tuple(aliases),
        tuple(p.shape),
        p.dtype,
        Box.whole(p.shape),
        local,
        p,
        writes=rank == 0,
        owner=rank == 0,
    )


def _refuse_dtensor(fqn: str, p: nn.Parameter) -> None:
    # Its local tensor is a piece of it, not the whole parameter a plain one is.
    if hasattr(p, "device_mesh") and hasattr(p, "placements"):
        raise ValueError(
            f"model: parameter {fqn} is a DTensor ({tuple(p.placements)} on "
            f"{p.device_mesh}) outside every fsdp_engine.fully_shard unit; fsdp-ckpt saves "
            "fsdp_engine units and plain tensors: fully_shard the module holding it (tensor "
            "parallelism composes with it), or save with torch.distributed.checkpoint"
        )


def model_view(model: nn.Module, *, backend: Any = None) -> ModelView:
    """This rank's view of ``model``; ``backend`` overrides the one found in the model."""
    check_model(model)
    check_backend(backend)
    sharded = any(isinstance(m, FSDPModule) for m in model.modules())
    names = _names_by_param(model)
    pieces = _sharded_pieces(model, names) if sharded else []
    world = backend if backend is not None else (find_backend(model) if sharded else None)
    if sharded and world is None:
        raise ValueError(
            "cannot find the backend of this sharded model; pass backend= (the "
            "fsdp_comm.Backend spanning every rank)"
        )
    rank = 0 if world is None else world.rank
    covered = {id(p.param) for p in pieces}
    for fqn, p in model.named_parameters():
        if id(p) not in covered:  # outside every unit: replicated, written by rank 0
            _refuse_dtensor(fqn, p)
            pieces.append(_whole_piece(fqn, names[id(p)], p, rank))
    buffers, aliases = _persistent_buffers(model)
    return ModelView(
        tuple(pieces),
        buffers,
        aliases,
        sharded,
        world,
        rank,
        1 if world is None else world.world_size,
    )
