"""Saved-tensor hooks that let a unit free its gathered parameters after forward.

Autograd saves the parameter views that operations need in backward (a linear layer saves its
weight). When a unit reshards after forward, its gathered buffer goes back to the pool and may
hold another unit's parameters by the time backward runs. The pack hook therefore replaces a
saved view of a live gathered buffer by a reference (unit group, offset, shape, stride); the
unpack hook re-gathers the unit if needed and returns the same view of the new buffer. Other
tensors pass through unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["SavedParamRegistry", "SavedParamRef"]


@dataclass(frozen=True)
class SavedParamRef:
    unit: Any
    index: int
    offset: int
    size: torch.Size
    stride: tuple[int, ...]


class SavedParamRegistry:
    """The gathered buffers alive during a forward, looked up by data pointer."""

    def __init__(self) -> None:
        self._live: dict[Any, dict[int, torch.Tensor]] = {}

    def add(self, unit: Any, index: int, full: torch.Tensor) -> None:
        self._live.setdefault(unit, {})[index] = full

    def remove(self, unit: Any) -> None:
        self._live.pop(unit, None)

    def pack(self, t: torch.Tensor) -> Any:
        if not self._live or t.layout is not torch.strided or t.device.type == "meta":
            return t
        ptr = t.data_ptr()
        for unit, fulls in self._live.items():
            for index, full in fulls.items():
                base = full.data_ptr()
                if base <= ptr < base + full.numel() * full.element_size() \
                        and t.dtype == full.dtype:
                    offset = t.storage_offset() - full.storage_offset()
                    return SavedParamRef(unit, index, offset, t.size(), t.stride())
        return t

    @staticmethod
    def unpack(saved: Any) -> torch.Tensor:
        if not isinstance(saved, SavedParamRef):
            return saved
        full = saved.unit.full_for_backward(saved.index)
        return full.as_strided(saved.size, saved.stride, full.storage_offset() + saved.offset)

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
