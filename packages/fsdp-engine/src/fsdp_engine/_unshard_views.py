"""The autograd function that hands a unit's parameters to the forward as views of the
all-gathered buffer, and its gradients back to the unit in one piece (Note [parameter views])."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["unshard_views"]


class _UnshardViews(torch.autograd.Function):
    """Forward: the per-parameter views of ``full``. Backward: called once every view's
    gradient is known, it passes them all to ``unit.accumulate_grads`` and returns nothing for
    the inputs: the unit reduces the gradients and fills the sharded ``.grad`` itself."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, full: torch.Tensor, unit: Any, index: int,
                shapes: tuple[tuple[int, int, torch.Size], ...]) -> tuple[torch.Tensor, ...]:
        ctx.unit, ctx.index = unit, index
        return tuple(full[off:off + n].view(shape) for off, n, shape in shapes)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[None, ...]:
        ctx.unit.accumulate_grads(ctx.index, grads)
        return None, None, None, None, None


def unshard_views(unit: Any, index: int, full: torch.Tensor, flat: Any,
                  anchor: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Views of ``full`` for ``flat``'s parameters; gradients go to ``unit`` when they need
    them (``anchor`` requires grad only then)."""
    shapes = tuple((s.offset, s.numel, s.shape) for s in flat.layout.slots)
    if not (anchor.requires_grad and torch.is_grad_enabled()):
        return tuple(full[off:off + n].view(shape) for off, n, shape in shapes)
    return _UnshardViews.apply(anchor, full, unit, index, shapes)
