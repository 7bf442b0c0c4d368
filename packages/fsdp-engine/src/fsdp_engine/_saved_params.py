"""Saved-tensor hooks that let a unit free its gathered parameters after forward.

Autograd saves the parameter views that operations need in backward (a linear layer saves its
weight). When a unit reshards after forward, its gathered buffer goes back to the pool and may
hold another unit's parameters by the time backward runs. The pack hook therefore replaces a
saved view of a live gathered buffer by a reference (unit group, offset, shape, stride); the
unpack hook re-gathers the unit if needed and returns the same view of the new buffer. A
DTensor over such a view (tensor parallelism's parameters, Note [flat buffer on a 2-D mesh]
in ``_tensor_parallel.py``) is saved as its spec and that reference. Other tensors pass
through unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import torch

__all__ = ["SavedParamRegistry", "SavedParamRef"]


@dataclass(frozen=True)
class SavedParamRef:
    unit: Any
    index: int
    offset: int | torch.SymInt  # what storage_offset() arithmetic gives (an int in eager)
    size: torch.Size
    stride: tuple[int, ...]


@dataclass(frozen=True)
class SavedDTensorRef:
    """A saved DTensor whose local tensor is a view of a gathered buffer."""

    local: SavedParamRef
    spec: Any


class SavedParamRegistry:
    """The gathered buffers alive during a forward, looked up by their storage.

    Every tensor autograd saves passes through `pack`, so its cost is per saved tensor, not
    per unit: one storage lookup in a dict, whatever the number of gathered units (with
    ``reshard_after_forward=False`` every unit stays gathered through forward; scanning them
    all made a step quadratic in units). Reading ``t.device`` and ``t.layout`` first cost
    0.6 us per saved tensor on its own (a new ``torch.device`` each time); the storage's
    address is 0.12 us, and tensors without one (sparse, wrapper subclasses) raise there."""

    def __init__(self) -> None:
        self._live: dict[Any, dict[int, torch.Tensor]] = {}
        # storage address -> the (unit, group index, buffer) entries living in it
        self._by_storage: dict[int, list[tuple[Any, int, torch.Tensor]]] = {}

    def add(self, unit: Any, index: int, full: torch.Tensor) -> None:
        fulls = self._live.setdefault(unit, {})
        if index in fulls:
            self._drop(unit, index, fulls[index])
        fulls[index] = full
        self._by_storage.setdefault(full.untyped_storage().data_ptr(), []).append(
            (unit, index, full)
        )

    def remove(self, unit: Any) -> None:
        for index, full in self._live.pop(unit, {}).items():
            self._drop(unit, index, full)

    def _drop(self, unit: Any, index: int, full: torch.Tensor) -> None:
        key = full.untyped_storage().data_ptr()
        entries = [e for e in self._by_storage.get(key, ()) if not (e[0] is unit and e[1] == index)]
        if entries:
            self._by_storage[key] = entries
        else:
            self._by_storage.pop(key, None)

    def pack(self, t: torch.Tensor) -> Any:
        by_storage = self._by_storage
        if not by_storage:
            return t
        try:
            entries = by_storage.get(t.untyped_storage().data_ptr())
        except (RuntimeError, NotImplementedError, TypeError):
            # No storage of its own (sparse, a wrapper subclass). A DTensor parameter of
            # tensor parallelism (Note [flat buffer on a 2-D mesh]) wraps a view of ours.
            local = getattr(t, "_local_tensor", None)
            if local is None:
                return t
            ref = self.pack(local)
            return t if ref is local else SavedDTensorRef(ref, t._spec)  # type: ignore[attr-defined]
        if entries is None:
            return t
        ptr = t.data_ptr()
        for unit, index, full in entries:
            base = full.data_ptr()
            if base <= ptr < base + full.numel() * full.element_size() and t.dtype == full.dtype:
                offset = t.storage_offset() - full.storage_offset()
                return SavedParamRef(unit, index, offset, t.size(), t.stride())
        return t

    @staticmethod
    def unpack(saved: Any) -> torch.Tensor:
        if type(saved) is SavedDTensorRef:
            from torch.distributed.tensor import DTensor

            local = SavedParamRegistry.unpack(saved.local)
            # torch leaves DTensor.__init__ unannotated.
            return DTensor(local, saved.spec, requires_grad=False)  # type: ignore[no-untyped-call]
        if not isinstance(saved, SavedParamRef):
            return cast(torch.Tensor, saved)  # `pack` returned the tensor itself
        full: torch.Tensor = saved.unit.full_for_backward(saved.index)
        return full.as_strided(saved.size, saved.stride, full.storage_offset() + saved.offset)

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
