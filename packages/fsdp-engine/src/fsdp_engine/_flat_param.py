"""`FlatParameter`: a unit's parameters as one flat buffer per rank, each original parameter
sharded on dim 0 (FSDP2's layout) and kept as a view of that buffer.

Note [rank-major layout]
    Each rank's flat chunk is the concatenation, in parameter order, of that rank's dim-0
    chunk of every parameter, padded to ``ceil(rows / world)`` rows (``torch.chunk``
    semantics, so the last ranks may hold fewer rows, or none). So:

    - a sharded parameter is a view of the local chunk with its own shape
      (``(local_rows, *shape[1:])``), wrapped as a DTensor ``Shard(0)`` of the original
      global shape: what FSDP2 users, torch's state-dict utilities and DCP expect;
    - the unit still all-gathers one buffer (rank-major: ``[world, shard_numel]``) and
      reduce-scatters one buffer, as the paper's FlatParameter does;
    - between the two orders sits one copy each way. After the all-gather, one
      ``split_with_sizes_copy`` writes the gathered buffer in parameter-major order (each
      parameter's ``world * chunk`` rows contiguous, its real rows first), and the unsharded
      parameters are views of that; before the reduce-scatter, one ``cat`` puts the flat
      gradient back in rank-major order. With a shard group of one the two orders coincide
      and neither copy runs. Both copies are measured in the engine README.

    Parameter ``p`` of a unit sits at ``local_offset`` in every rank's chunk and at
    ``world * local_offset`` in the parameter-major buffer, which is why the layout needs
    no second table of offsets.

Note [shard dims]
    FSDP2's ``shard_placement_fn`` may shard a parameter on another dimension ``d``
    (``Shard(1)`` for MoE experts, the largest dimension, ``Shard(-1)``). Its "rows" are then
    its slices along ``d``: each rank holds ``torch.chunk(p, world, dim=d)[rank]``, stored
    contiguously (the DTensor's local tensor and its gradient are contiguous, as FSDP2's
    are) in a piece of ``ceil(size_d / world)`` slices, so offsets stay the same on every
    rank and the unit still gathers and reduces one flat buffer. Only the copies between the
    two orders differ for such a parameter: after the all-gather its ranks' pieces are
    concatenated along ``d`` into the parameter-major region, and before the reduce-scatter
    its gradient is chunked along ``d`` back into rank pieces (one ``cat`` and one copy per
    such parameter each way; dim-0 parameters keep the single copy). The per-parameter
    layout fsdp-ckpt reads (`sharded_layout`) describes such a shard as a box (Note [boxes of a
    2-D mesh] in ``_layout.py``).
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

__all__ = [
    "ParamSlot",
    "FlatLayout",
    "FlatParameter",
    "ALIGN_BYTES",
    "chunk_rows",
    "aligned_shard_numel",
    "flat_padded_numel",
]

#: Every rank's chunk is a multiple of this many bytes (and at least that long).
ALIGN_BYTES = 16


def chunk_rows(rows: int, shard_count: int) -> int:
    """Rows of a parameter in every rank's chunk: ``ceil(rows / shard_count)``
    (``torch.chunk``'s split, Note [rank-major layout])."""
    return -(-rows // shard_count)


def aligned_shard_numel(numel: int, itemsize: int) -> int:
    """A rank's chunk of ``numel`` elements of ``itemsize`` bytes, padded to `ALIGN_BYTES`
    (at least one aligned block, so an empty unit still has a buffer)."""
    align = max(1, ALIGN_BYTES // itemsize)
    return max(align, -(-numel // align) * align)


def flat_padded_numel(shapes: Sequence[Sequence[int]], shard_count: int, itemsize: int) -> int:
    """Elements of the gathered buffer of a unit whose parameters have ``shapes`` (in
    flattening order), sharded ``shard_count`` ways in a dtype of ``itemsize`` bytes: the
    layout `FlatLayout.build` makes, computed without tensors (`fsdp plan` uses it)."""
    offset = 0
    for shape in shapes:
        if len(shape) == 0:
            raise ValueError("flat_padded_numel: a 0-dim shape cannot be sharded on dim 0")
        offset += chunk_rows(shape[0], shard_count) * math.prod(shape[1:])
    return aligned_shard_numel(offset, itemsize) * shard_count


_GRAD = operator.attrgetter("grad")
_VERSION = operator.attrgetter("_version")
_REQUIRES_GRAD = operator.attrgetter("requires_grad")
_IS_NONE = type(None).__instancecheck__


@dataclass(frozen=True)
class ParamSlot:
    """One original parameter inside a unit's flat buffers.

    ``uses`` lists every (module, attribute name) that registers this parameter (more than one
    for parameters shared inside the unit, such as tied embeddings); ``fqn`` is the first.
    ``chunk_rows`` rows of it sit in each rank's chunk from ``local_offset`` on (padded with
    zeros where the rank holds fewer real rows)."""

    fqn: str
    uses: tuple[tuple[nn.Module, str], ...]
    shape: torch.Size
    numel: int
    row_numel: int
    chunk_rows: int
    local_offset: int
    # Note [shard dims]: the dimension sharded (``shard_placement_fn``); "rows" are its
    # slices, ``row_numel`` the elements of one.
    shard_dim: int = 0
    # Note [flat buffer on a 2-D mesh]: the tensor-parallel layout of a parameter that was a
    # DTensor on a tp mesh (``shape`` is then its tp piece's); None for a plain parameter.
    tp: Any = None

    @property
    def global_shape(self) -> torch.Size:
        """The parameter's shape as users see it (its tp DTensor's for a tp parameter)."""
        return self.shape if self.tp is None else self.tp.shape

    @property
    def rows(self) -> int:
        return self.shape[self.shard_dim]

    def rows_of(self, full: torch.Tensor, shard_index: int) -> torch.Tensor:
        """Shard ``shard_index``'s rows of ``full`` (a tensor of this parameter's shape)."""
        rows = self.local_rows(shard_index)
        start = shard_index * self.chunk_rows if rows else 0
        return full.narrow(self.shard_dim, start, rows)

    def local_shape(self, rows: int) -> tuple[int, ...]:
        shape = list(self.shape)
        shape[self.shard_dim] = rows
        return tuple(shape)

    @property
    def chunk_numel(self) -> int:
        return self.chunk_rows * self.row_numel

    def local_rows(self, shard_index: int) -> int:
        """Real rows of this parameter held by shard ``shard_index`` (torch.chunk's split)."""
        return max(0, min(self.chunk_rows, self.rows - shard_index * self.chunk_rows))


@dataclass(frozen=True)
class FlatLayout:
    """Where each parameter sits in a rank's chunk (Note [rank-major layout])."""

    slots: tuple[ParamSlot, ...]
    shard_numel: int
    shard_count: int

    @property
    def padded_numel(self) -> int:
        """Elements of the gathered buffer (either order)."""
        return self.shard_numel * self.shard_count

    @functools.cached_property
    def copy_sizes(self) -> list[int]:
        """Column sizes splitting a ``[world, shard_numel]`` gathered buffer by parameter
        (the last entry is the chunk's tail padding, if any)."""
        sizes = [slot.chunk_numel for slot in self.slots]
        tail = self.shard_numel - sum(sizes)
        return sizes + [tail] if tail else sizes

    @functools.cached_property
    def split_sizes(self) -> list[int]:
        """Sizes splitting the parameter-major buffer into parameters and padding."""
        sizes = []
        for slot in self.slots:
            sizes.append(slot.numel)
            pad = self.shard_count * slot.chunk_numel - slot.numel
            if pad:
                sizes.append(pad)
        tail = self.padded_numel - self.shard_count * sum(s.chunk_numel for s in self.slots)
        if tail:
            sizes.append(tail)
        return sizes

    @functools.cached_property
    def param_pieces(self) -> list[int]:
        """Index into ``split_sizes`` of each parameter's piece."""
        pieces, i = [], 0
        for slot in self.slots:
            pieces.append(i)
            i += 1 if self.shard_count * slot.chunk_numel == slot.numel else 2
        return pieces

    @functools.cached_property
    def shapes(self) -> list[tuple[int, ...]]:
        """Each parameter's shape as a plain tuple (``view`` parses it faster than a Size)."""
        return [tuple(slot.shape) for slot in self.slots]

    @functools.cached_property
    def tps(self) -> tuple[Any, ...] | None:
        """Each slot's tensor-parallel layout, or None when no slot has one."""
        tps = tuple(slot.tp for slot in self.slots)
        return tps if any(tp is not None for tp in tps) else None

    @property
    def is_identity(self) -> bool:
        """One shard: rank-major and parameter-major orders coincide."""
        return self.shard_count == 1

    def local_piece(self, slot: ParamSlot, shard_index: int) -> tuple[int, int, int]:
        """(start in the shard, start in the flattened parameter, length) of the part of
        ``slot`` that shard ``shard_index`` holds; length 0 when none."""
        rows = slot.local_rows(shard_index)
        if rows == 0 or slot.row_numel == 0:
            return 0, 0, 0
        return slot.local_offset, shard_index * slot.chunk_numel, rows * slot.row_numel

    @functools.cached_property
    def other_dims(self) -> tuple[int, ...]:
        """Indices of the slots sharded on a dimension other than 0 (Note [shard dims])."""
        return tuple(i for i, s in enumerate(self.slots) if s.shard_dim)

    def local_view(self, shard: torch.Tensor, slot: ParamSlot, shard_index: int) -> torch.Tensor:
        """The real rows of ``slot`` in ``shard`` (this rank's chunk), with their own shape
        (contiguous, for every shard dimension)."""
        rows = slot.local_rows(shard_index)
        piece = shard[slot.local_offset : slot.local_offset + rows * slot.row_numel]
        if slot.shard_dim:
            return piece.view(slot.local_shape(rows))
        return piece.view(rows, *slot.shape[1:])

    def full_view(self, full: torch.Tensor, slot: ParamSlot) -> torch.Tensor:
        """Parameter ``slot`` in a parameter-major gathered buffer."""
        start = self.shard_count * slot.local_offset
        return full[start : start + slot.numel].view(slot.shape)

    def to_param_major(self, gathered: torch.Tensor, out: torch.Tensor) -> None:
        """Copy a rank-major gathered buffer into ``out`` in parameter-major order."""
        w = self.shard_count
        # torch leaves Tensor.split unannotated.
        outs = [part.view(w, -1) for part in out.split([w * size for size in self.copy_sizes])]  # type: ignore[no-untyped-call]
        torch.split_with_sizes_copy(
            gathered.view(w, self.shard_numel), self.copy_sizes, dim=1, out=outs
        )
        for i in self.other_dims:  # Note [shard dims]: rank pieces -> the parameter's order
            slot = self.slots[i]
            region = out[w * slot.local_offset : w * (slot.local_offset + slot.chunk_numel)]
            pieces = [
                region[
                    r * slot.chunk_numel : r * slot.chunk_numel
                    + slot.local_rows(r) * slot.row_numel
                ].view(slot.local_shape(slot.local_rows(r)))
                for r in range(w)
            ]
            region[: slot.numel].view(slot.shape).copy_(torch.cat(pieces, dim=slot.shard_dim))

    def to_rank_major(self, flat: torch.Tensor, out: torch.Tensor) -> None:
        """Copy a parameter-major buffer (a flat gradient) into ``out`` in rank-major order."""
        w = self.shard_count
        for i in self.other_dims:  # Note [shard dims]: the parameter's order -> rank pieces
            slot = self.slots[i]
            region = flat[w * slot.local_offset : w * (slot.local_offset + slot.chunk_numel)]
            chunks = [
                c.contiguous()
                for c in region[: slot.numel].view(slot.shape).chunk(w, dim=slot.shard_dim)
            ]
            region.zero_()
            for r, c in enumerate(chunks):
                region[r * slot.chunk_numel : r * slot.chunk_numel + c.numel()].copy_(c.view(-1))
        parts = [part.view(w, -1) for part in flat.split([w * size for size in self.copy_sizes])]  # type: ignore[no-untyped-call]
        torch.cat(parts, dim=1, out=out.view(w, self.shard_numel))

    def param_major(self, grads: Sequence[torch.Tensor | None], like: torch.Tensor) -> torch.Tensor:
        """One parameter-major flat gradient from per-parameter gradients (zeros for None and
        for padding), in ``like``'s dtype and device: what autograd's split made."""
        zero = like.new_zeros(())
        parts = [zero.expand(size) for size in self.split_sizes]
        for piece, g in zip(self.param_pieces, grads):
            if g is not None:
                parts[piece] = g.reshape(-1)
        return torch.cat(parts).to(like.dtype)

    def grads_to_rank_major(self, grads: Sequence[torch.Tensor | None], out: torch.Tensor) -> None:
        """Write per-parameter gradients (None: zeros) into ``out`` in rank-major order,
        cast to ``out``'s dtype on the way: one pass (Note [one gradient pass] in
        ``_unit_reduce.py``)."""
        w = self.shard_count
        if self.other_dims:  # Note [shard dims]: those go through the parameter-major order
            self.to_rank_major(self.param_major(grads, out), out)
            return
        sizes, even, tail = self._rank_major_plan
        if out.is_cuda:  # one kernel: FSDP2's copy-in
            full = [
                torch.zeros(s.shape, dtype=out.dtype, device=out.device) if g is None else g
                for g, s in zip(grads, self.slots)
            ]
            if tail:
                full.append(out.new_zeros(w * tail))
            torch._chunk_cat(full, dim=0, num_chunks=w, out=out.view(w, self.shard_numel))
            return
        if even and True not in map(_IS_NONE, grads):
            # The common case: every parameter's rows divide evenly, every one has a gradient.
            present = cast("Sequence[torch.Tensor]", grads)  # no None: checked just above
            if w == 1:  # both orders coincide
                torch.cat([g.reshape(-1) for g in present], out=out)
            else:
                torch.cat(
                    [g.reshape(w, n) for g, n in zip(present, sizes)],
                    dim=1,
                    out=out.view(w, self.shard_numel),
                )
            return
        view = out.view(w, self.shard_numel)
        zero = out.new_zeros(())
        parts: list[torch.Tensor] = []
        for slot, g, n in zip(self.slots, grads, sizes):
            if g is None:
                parts.append(zero.expand(w, n))
            elif w * slot.chunk_rows == slot.rows:
                parts.append(g.reshape(w, n))
            else:  # uneven rows: this parameter's rank pieces need padding
                padded = g.new_zeros(w * n)
                padded[: slot.numel].copy_(g.reshape(-1))
                parts.append(padded.view(w, n))
        if tail:
            parts.append(zero.expand(w, tail))
        torch.cat(parts, dim=1, out=view)

    @functools.cached_property
    def _rank_major_plan(self) -> tuple[list[int], bool, int]:
        """(each parameter's chunk size, whether every parameter's rows divide evenly with no
        tail padding, the tail) for `grads_to_rank_major`."""
        sizes = [slot.chunk_numel for slot in self.slots]
        tail = self.shard_numel - sum(sizes)
        even = not tail and all(self.shard_count * s.chunk_rows == s.rows for s in self.slots)
        return sizes, even, tail

    @classmethod
    def build(
        cls,
        named: Sequence[tuple[str, tuple[tuple[nn.Module, str], ...], torch.Tensor]],
        shard_count: int,
        dtype: torch.dtype,
        dims: Sequence[int] | None = None,
        tps: Sequence[Any] | None = None,
    ) -> FlatLayout:
        """``dims``: each parameter's shard dimension (default 0; Note [shard dims]).
        ``tps``: each parameter's tensor-parallel layout or None (Note [flat buffer on a 2-D
        mesh]); a tp parameter is laid out by its local tp piece."""
        slots, offset = [], 0
        for k, (fqn, uses, param) in enumerate(named):
            tp = None if tps is None else tps[k]
            if tp is not None:
                param = param._local_tensor  # type: ignore[attr-defined]
            shape = param.shape
            if len(shape) == 0:
                raise ValueError(
                    f"parameter {fqn} is a scalar (0-dim); FSDP shards parameters on dim 0: "
                    f"give it shape (1,). Change {fqn} to a 1D tensor with numel equal to 1."
                )
            dim = 0 if dims is None else dims[k]
            row_numel = (
                math.prod(shape) // shape[dim]
                if shape[dim]
                else math.prod(shape[:dim] + shape[dim + 1 :])
            )
            rows = chunk_rows(shape[dim], shard_count)
            slots.append(
                ParamSlot(fqn, uses, shape, param.numel(), row_numel, rows, offset, dim, tp)
            )
            offset += rows * row_numel
        itemsize = torch.empty(0, dtype=dtype).element_size()
        return cls(tuple(slots), aligned_shard_numel(offset, itemsize), shard_count)


class FlatParameter:
    """The sharded flat buffer of one group of a unit (its trainable or its frozen parameters).

    ``local_shard`` is this rank's chunk in the parameters' own dtype (the optimizer's
    full-precision copy); ``params`` are the unit's parameters as registered on the modules:
    DTensors whose local tensors are views of it (Note [rank-major layout]). ``spec`` makes
    those DTensors (`fsdp_engine._dtensor_param.ShardSpec`).
    """

    def __init__(
        self,
        layout: FlatLayout,
        local_shard: torch.Tensor,
        shard_index: int,
        params: Sequence[nn.Parameter],
        spec: Any,
    ) -> None:
        if local_shard.numel() != layout.shard_numel:
            raise AssertionError(
                f"shard of {local_shard.numel()} elements for a layout of {layout.shard_numel}"
            )
        self.layout = layout
        self.local_shard = local_shard
        self.shard_index = shard_index
        self.params = list(params)
        self.spec = spec
        self.dtype = local_shard.dtype
        self._versioned = (local_shard, *self.params)
        self.fqns = [slot.fqn for slot in layout.slots]  # from the root (set at lazy init)
        self.shard_group: Any = None  # the backend the shards are reduced over
        self.sharded_grad: torch.Tensor | None = None
        self._grads: tuple[torch.Tensor, ...] = ()  # DTensor gradients over `sharded_grad`
        self.grad_locals: tuple[torch.Tensor, ...] = ()  # their local tensors

    # ---- the local shard and the parameters over it --------------------------------------
    def local_views(self) -> list[torch.Tensor]:
        return [
            self.layout.local_view(self.local_shard, s, self.shard_index) for s in self.layout.slots
        ]

    def use_sharded_views(self) -> None:
        """Point every parameter's local tensor at its rows of the local shard. A plain local
        tensor that carries attributes of its own (an all-gather extension patched on the
        instance after ``to_empty``, as FSDP2 allows) is re-pointed in place, so it keeps
        them."""
        for p, view in zip(self.params, self.local_views()):
            old = getattr(p, "_local_tensor", None)
            if (
                type(old) is torch.Tensor
                and old.__dict__
                and old.dtype == view.dtype
                and old.device == view.device
            ):
                with torch.no_grad():
                    old.set_(view)  # type: ignore[call-overload]  # torch's stubs lack set_(Tensor)
                continue
            p._local_tensor = view  # type: ignore[attr-defined]

    def adopt_locals(self) -> bool:
        """Take back parameters whose local tensors no longer view the local shard (after
        ``module.to_empty()``, ``.to()`` or ``param.data = ...``): copy their values into a
        new shard of their dtype and device. Returns True if anything moved."""
        locals_ = [p._local_tensor for p in self.params]  # type: ignore[attr-defined]
        if any(t.device.type == "meta" for t in locals_):
            return False
        if not self.on_meta:
            base = self.local_shard.untyped_storage().data_ptr()
            if all(t.untyped_storage().data_ptr() == base for t in locals_):
                return False
        shard = torch.zeros(
            self.layout.shard_numel, dtype=locals_[0].dtype, device=locals_[0].device
        )
        for slot, value in zip(self.layout.slots, locals_):
            self.layout.local_view(shard, slot, self.shard_index).copy_(value)
        self.set_shard(shard)
        return True

    def adopt_replaced(self) -> bool:
        """Take over parameters the user replaced on the modules after ``fully_shard`` and
        before the first forward (``load_state_dict(sd, assign=True)``, ``module.weight =
        nn.Parameter(...)``): the new object becomes the parameter (an optimizer made from
        ``model.parameters()`` then holds the right one, as with FSDP2). A DTensor keeps its
        local rows; a plain tensor of the parameter's full shape gives this rank's rows and
        is wrapped as a DTensor. `adopt_locals` then copies them into the flat shard."""
        from torch.distributed.tensor import DTensor

        changed = False
        for slots, name, param, i in self.bindings:
            new = slots.get(name)
            if new is param or new is None:
                continue
            slot = self.layout.slots[i]
            if tuple(new.shape) != tuple(slot.global_shape):
                raise ValueError(
                    f"parameter {self.fqns[i]} was replaced after fully_shard by a tensor of "
                    f"shape {tuple(new.shape)}; it must keep the shape "
                    f"{tuple(slot.global_shape)}"
                )
            if slot.tp is not None and not isinstance(new, DTensor):
                raise ValueError(
                    f"parameter {self.fqns[i]} is tensor-parallel; it was replaced after "
                    "fully_shard by a plain tensor: assign a DTensor (load_state_dict with "
                    "assign=True of the sharded state dict)"
                )
            if isinstance(new, DTensor):
                rows = new._local_tensor
                if tuple(rows.shape) != slot.local_shape(slot.local_rows(self.shard_index)):
                    rows = new.full_tensor()
            if not isinstance(new, DTensor) or rows is not new._local_tensor:
                full = rows if isinstance(new, DTensor) else new.detach()
                rows = slot.rows_of(full, self.shard_index).contiguous()
                new = self.spec.parameter(rows, slot, new.requires_grad)
            if not isinstance(new, nn.Parameter):
                new = nn.Parameter(new, requires_grad=new.requires_grad)
            new._fsdp_flat = self  # type: ignore[attr-defined]
            self.params[i] = new
            for mod, attr in slot.uses:
                mod._parameters[attr] = new
            self.__dict__.pop("bindings", None)
            changed = True
        if changed:
            self._versioned = (self.local_shard, *self.params)
        return changed

    def set_shard(self, shard: torch.Tensor) -> None:
        """Replace the local shard (same layout): parameters view the new one."""
        self.local_shard, self.dtype = shard, shard.dtype
        self._versioned = (shard, *self.params)
        self.sharded_grad, self._grads, self.grad_locals = None, (), ()
        self.use_sharded_views()

    @functools.cached_property
    def bindings(self) -> tuple[tuple[dict[str, Any], str, nn.Parameter, int], ...]:
        """(the module's ``_parameters``, name, parameter, slot index) for every place a
        parameter is registered: what swapping views in and out of modules walks."""
        return tuple(
            (mod._parameters, name, param, i)
            for i, (slot, param) in enumerate(zip(self.layout.slots, self.params))
            for mod, name in slot.uses
        )

    @property
    def requires_grad(self) -> bool:
        """Whether any parameter needs a gradient now (``requires_grad_`` may change it after
        ``fully_shard``)."""
        return any(map(_REQUIRES_GRAD, self.params))

    @property
    def on_meta(self) -> bool:
        return self.local_shard.device.type == "meta"

    def version(self) -> int:
        """Sum of the version counters of the shard and the parameters: it changes with any
        in-place write to them (a write through a DTensor parameter bumps the parameter's
        counter, not its local tensor's: DTensor dispatch runs below the version bump)."""
        return sum(map(_VERSION, self._versioned))

    # ---- gradients -----------------------------------------------------------------------
    def attach_sharded_grad(self, grad: torch.Tensor, give: Sequence[bool] | None = None) -> None:
        """Make ``grad`` (1-D, shard-sized, parameter dtype) the storage of every ``.grad``
        (DTensors of the parameters' placements; their objects are reused while ``grad``
        stays the same buffer). ``give``: only the parameters marked True get theirs; the
        others keep ``.grad`` as it is (None: Note [unused parameters])."""
        if grad is not self.sharded_grad or not self._grads:
            self.sharded_grad = grad
            self.grad_locals = tuple(
                self.layout.local_view(grad, s, self.shard_index) for s in self.layout.slots
            )
            self._grads = tuple(
                self.spec.dtensor(v, s) for v, s in zip(self.grad_locals, self.layout.slots)
            )
        if give is None:
            for p, g in zip(self.params, self._grads):
                p.grad = g
            return
        for p, g, yes in zip(self.params, self._grads, give):
            if yes:
                p.grad = g

    def drop_unused_grad(self) -> None:
        """Let go of the sharded gradient once no ``.grad`` holds it any more (after
        ``zero_grad(set_to_none=True)``), so its memory is free through the next forward, as
        in FSDP2; the next backward allocates a fresh one. Pinned host gradients (CPU offload)
        are kept: pinning is slow, and they cost no device memory."""
        grad = self.sharded_grad
        if grad is None or self.any_grad_attached() or grad.is_pinned():
            return
        self.sharded_grad, self._grads, self.grad_locals = None, (), ()

    def grads_attached(self) -> bool:
        """True while every parameter's ``.grad`` is still the one `attach_sharded_grad`
        set (not set to None or replaced by the user)."""
        if not self._grads:
            return False
        return all(map(operator.is_, map(_GRAD, self.params), self._grads))

    def any_grad_attached(self) -> bool:
        return bool(self._grads) and any(map(operator.is_, map(_GRAD, self.params), self._grads))
