"""`FlatParameter`: a unit's parameters flattened into one padded 1-D buffer, sharded in equal
chunks, with the original parameters kept as views.

Layout: each parameter starts at an aligned offset (16 bytes) of the flat buffer; the total is
right-padded so it splits into ``shard_count`` equal chunks, each a multiple of the alignment.
Rank ``r`` keeps chunk ``r``. The original ``nn.Parameter`` objects stay registered on their
modules (names and FQNs unchanged); between steps their ``.data`` is the part of the parameter
that falls in this rank's chunk, flattened (possibly empty), so an optimizer built on
``model.parameters()`` updates the local shard in place. See Note [parameter views].

Note [parameter views]
    Sharded (between steps): ``param.data`` is a 1-D view of the local shard; ``param.grad`` a
    1-D view of the local sharded gradient. Unsharded (inside forward): the module sees, in its
    ``_parameters`` slot, a view with the parameter's shape cut by one ``split_with_sizes`` from
    an autograd leaf that aliases the all-gathered buffer. Backward of that split concatenates
    every parameter's gradient (zeros for padding) into one flat gradient in C++, and the
    leaf's post-accumulate-grad hook hands it to the unit for one reduce-scatter. After the
    forward the ``nn.Parameter`` goes back into the slot.

    The leaf and its hook are made once per group and re-pointed (``leaf.data = buffer``) at
    each new gather: a new leaf is made only while backward still owes the old one gradients
    (the recompute of activation checkpointing). A group whose gathered form is its shard
    itself (a shard group of one, no cast) never reshards, so its views are cut once and
    reused; such a unit needs no pre-backward hook either. This keeps a unit's Python cost per
    forward+backward near 20 microseconds (the fsdp-engine README has the figure).
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["ParamSlot", "FlatLayout", "FlatParameter", "ALIGN_BYTES"]

ALIGN_BYTES = 16

_GRAD = operator.attrgetter("grad")
_VERSION = operator.attrgetter("_version")


@dataclass(frozen=True)
class ParamSlot:
    """One original parameter inside a flat buffer.

    ``uses`` lists every (module, attribute name) that registers this parameter (more than one
    for parameters shared inside the unit, such as tied embeddings); ``fqn`` is the first.
    """

    fqn: str
    uses: tuple[tuple[nn.Module, str], ...]
    shape: torch.Size
    numel: int
    offset: int


@dataclass(frozen=True)
class FlatLayout:
    """Where each parameter sits in the flat buffer and how the buffer splits into shards."""

    slots: tuple[ParamSlot, ...]
    padded_numel: int
    shard_count: int

    @property
    def shard_numel(self) -> int:
        return self.padded_numel // self.shard_count

    @functools.cached_property
    def split_sizes(self) -> list[int]:
        """Sizes that split the flat buffer into parameters and the gaps between them."""
        sizes, cursor = [], 0
        for slot in self.slots:
            if slot.offset > cursor:
                sizes.append(slot.offset - cursor)
            sizes.append(slot.numel)
            cursor = slot.offset + slot.numel
        if self.padded_numel > cursor:
            sizes.append(self.padded_numel - cursor)
        return sizes

    @functools.cached_property
    def shapes(self) -> list[tuple[int, ...]]:
        """Each parameter's shape as a plain tuple (``view`` parses it faster than a Size)."""
        return [tuple(slot.shape) for slot in self.slots]

    @functools.cached_property
    def param_pieces(self) -> list[int]:
        """Index into ``split_sizes`` of each parameter's piece."""
        pieces, cursor, i = [], 0, 0
        for slot in self.slots:
            if slot.offset > cursor:
                i += 1
            pieces.append(i)
            i += 1
            cursor = slot.offset + slot.numel
        return pieces

    def local_piece(self, slot: ParamSlot, shard_index: int) -> tuple[int, int, int]:
        """(start in the shard, start in the flattened parameter, length) of the part of
        ``slot`` that shard ``shard_index`` holds; length 0 when none."""
        lo = shard_index * self.shard_numel
        hi = lo + self.shard_numel
        start = max(slot.offset, lo)
        end = min(slot.offset + slot.numel, hi)
        if end <= start:
            return 0, 0, 0
        return start - lo, start - slot.offset, end - start

    @classmethod
    def build(
        cls, named: Sequence[tuple[str, tuple[tuple[nn.Module, str], ...], nn.Parameter]],
        shard_count: int, dtype: torch.dtype,
    ) -> FlatLayout:
        align = max(1, ALIGN_BYTES // torch.empty(0, dtype=dtype).element_size())
        slots, offset = [], 0
        for fqn, uses, param in named:
            offset = -(-offset // align) * align
            slots.append(ParamSlot(fqn, uses, param.shape, param.numel(), offset))
            offset += param.numel()
        chunk = max(1, -(-offset // shard_count))
        chunk = -(-chunk // align) * align
        return cls(tuple(slots), chunk * shard_count, shard_count)


class FlatParameter:
    """The sharded flat buffer of one group of a unit (its trainable or its frozen parameters).

    ``local_shard`` is this rank's chunk in the parameters' own dtype (the optimizer's
    full-precision copy); ``params`` are the original parameters, whose ``.data`` are views of
    it (Note [parameter views]).
    """

    def __init__(self, layout: FlatLayout, local_shard: torch.Tensor, shard_index: int,
                 params: Sequence[nn.Parameter]) -> None:
        if local_shard.numel() != layout.shard_numel:
            raise AssertionError(f"shard of {local_shard.numel()} elements for a layout of "
                                 f"{layout.shard_numel}")
        self.layout = layout
        self.local_shard = local_shard
        self.shard_index = shard_index
        self.params = list(params)
        self.requires_grad = any(p.requires_grad for p in self.params)
        self.dtype = local_shard.dtype
        self.sharded_grad: torch.Tensor | None = None
        self._versioned = (local_shard, *self.params)
        self._attached: tuple[torch.Tensor, ...] = ()  # the ``param.grad`` views it set

    @classmethod
    def shard_from_full(
        cls, layout: FlatLayout, params: Sequence[nn.Parameter], shard_index: int,
        device: torch.device, *, broadcast_from: Any = None,
    ) -> FlatParameter:
        """Copy ``params`` (full values) into a flat buffer and keep chunk ``shard_index``.

        ``broadcast_from``: a backend whose rank 0's values every rank takes first
        (``sync_module_states``)."""
        dtype = params[0].dtype
        flat = torch.zeros(layout.padded_numel, dtype=dtype, device=device)
        for slot, p in zip(layout.slots, params):
            flat[slot.offset:slot.offset + slot.numel].copy_(p.detach().reshape(-1))
        if broadcast_from is not None:
            broadcast_from.broadcast(flat, src=0)
        lo = shard_index * layout.shard_numel
        local = flat[lo:lo + layout.shard_numel].clone()
        del flat
        fp = cls(layout, local, shard_index, params)
        fp.use_sharded_views()
        return fp

    def move_shard_to_host(self, *, pin: bool) -> None:
        """CPU offload: keep the shard (and so gradients and optimizer state) in host memory."""
        host = self.local_shard.to("cpu")
        self.local_shard = host.pin_memory() if pin else host
        self._versioned = (self.local_shard, *self.params)
        self.use_sharded_views()

    def use_sharded_views(self) -> None:
        """Point every parameter's ``.data`` at its piece of the local shard."""
        for slot, p in zip(self.layout.slots, self.params):
            start, _, length = self.layout.local_piece(slot, self.shard_index)
            p.data = self.local_shard[start:start + length]

    @functools.cached_property
    def bindings(self) -> tuple[tuple[dict[str, Any], str, nn.Parameter, int], ...]:
        """(the module's ``_parameters``, name, parameter, slot index) for every place a
        parameter is registered: what swapping views in and out of modules walks."""
        return tuple((mod._parameters, name, param, i)
                     for i, (slot, param) in enumerate(zip(self.layout.slots, self.params))
                     for mod, name in slot.uses)

    def unflatten(self, full: torch.Tensor) -> list[torch.Tensor]:
        """Views of the all-gathered buffer ``full`` with each parameter's shape."""
        return [full[s.offset:s.offset + s.numel].view(s.shape) for s in self.layout.slots]

    def version(self) -> int:
        """Sum of the version counters of the shard and the parameters: it changes with any
        in-place write to them (one through a parameter bumps that parameter's counter)."""
        return sum(map(_VERSION, self._versioned))

    def attach_sharded_grad(self, grad: torch.Tensor) -> None:
        """Make ``grad`` (1-D, shard-sized, parameter dtype) the source of every ``param.grad``."""
        self.sharded_grad = grad
        for slot, p in zip(self.layout.slots, self.params):
            start, _, length = self.layout.local_piece(slot, self.shard_index)
            p.grad = grad[start:start + length]
        self._attached = tuple(p.grad for p in self.params)

    def grads_attached(self) -> bool:
        """True while every parameter's ``.grad`` is still the view of ``sharded_grad`` that
        `attach_sharded_grad` set (not set to None or replaced by the user)."""
        if self.sharded_grad is None:
            return False
        return all(map(operator.is_, map(_GRAD, self.params), self._attached))
