"""FSDP2's all-gather extension for tensor subclasses (``fsdp_pre_all_gather`` /
``fsdp_post_all_gather``, which torchao's float8 training implements).

Note [all-gather extensions]
    A sharded parameter whose local tensor defines ``fsdp_pre_all_gather`` (a subclass, or a
    plain tensor with the methods patched on the instance before the first forward, as FSDP2
    allows; the engine looks once, at the group's first forward) is unsharded the way it
    asks: ``fsdp_pre_all_gather(mesh, outer_size, outer_stride, module, mp_policy)``
    (or FSDP2's first form, ``fsdp_pre_all_gather(mesh)``) gives the tensors to all-gather
    and metadata; each is padded to the parameter's rows per rank and all-gathered over the
    shard group (the shard mesh is what the hook sees, also on a hybrid mesh); then
    ``fsdp_post_all_gather(outputs, metadata, param_dtype)`` builds the unsharded tensor,
    cut to the parameter's rows. Forward computes with that tensor; its gradient goes into
    the unit's one flat gradient at the parameter's place (`_ExtensionValue`), so the
    reduction is the unit's usual single reduce-scatter.

    What is not done yet: the parameter's plain values still travel in the unit's flat
    all-gather as well, so an extension that all-gathers less (float8) does not yet save
    bandwidth here; and a recompute of activation checkpointing computes with the plain
    values. Both are recorded in the engine README.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

__all__ = ["has_extension", "extension_value"]


def has_extension(local: torch.Tensor) -> bool:
    """Whether ``local`` (a parameter's local tensor) defines FSDP2's all-gather extension, on
    its class or patched on the instance (asked per parameter per forward: ~50 ns)."""
    return getattr(local, "fsdp_pre_all_gather", None) is not None


class _ExtensionValue(torch.autograd.Function):
    """Forward: the extension's unsharded tensor. Backward: its gradient goes to the plain
    view of the gathered buffer (and so into the unit's flat gradient)."""

    @staticmethod
    def forward(ctx: Any, view: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        return value.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def _pre_all_gather(local: torch.Tensor, mesh: Any, slot: Any, module: Any, mp: Any) -> Any:
    # The hook of FSDP2's extension protocol, which torch.Tensor does not declare.
    fn = local.fsdp_pre_all_gather  # type: ignore[attr-defined]
    try:
        takes = len(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        takes = 5
    if takes == 1:  # FSDP2's first form
        return fn(mesh)
    stride = torch.empty(slot.shape, device="meta").stride()
    return fn(mesh, slot.shape, stride, module, mp)


def _gather(backend: Any, t: torch.Tensor, chunk_rows: int) -> torch.Tensor:
    """All-gather ``t`` (this rank's rows, padded here to ``chunk_rows``) along dim 0."""
    if t.shape[0] < chunk_rows:
        pad = t.new_zeros((chunk_rows - t.shape[0], *t.shape[1:]))
        t = torch.cat([t, pad])
    t = t.contiguous()
    out = t.new_empty((backend.world_size * chunk_rows, *t.shape[1:]))
    work = backend.all_gather_into_tensor(out, t, async_op=True)
    if work is not None:
        work.wait()
    return out


def extension_value(
    local: torch.Tensor,
    view: torch.Tensor | None,
    *,
    slot: Any,
    mesh: Any,
    backend: Any,
    module: Any,
    mp: Any,
    param_dtype: torch.dtype,
) -> Any:
    """The unsharded value of a parameter with an all-gather extension (Note [all-gather
    extensions]); ``view``: its plain view of the gathered buffer, which takes the gradient
    (None when no gradient is needed)."""
    if slot.shard_dim:
        raise ValueError(
            f"parameter {slot.fqn}: the all-gather extension needs dim-0 "
            "sharding (shard_placement_fn returned another dim)"
        )
    with torch.no_grad():
        inputs, metadata = _pre_all_gather(local, mesh, slot, module, mp)
        if isinstance(inputs, torch.Tensor):
            inputs = (inputs,)
        outputs = tuple(_gather(backend, t, slot.chunk_rows) for t in inputs)
        value, _ = local.fsdp_post_all_gather(  # type: ignore[attr-defined]  # as above
            outputs, metadata, param_dtype
        )
        if value.shape[0] != slot.shape[0]:
            value = value[: slot.shape[0]]
    if view is None:
        return value
    return _ExtensionValue.apply(view, value)  # type: ignore[no-untyped-call]  # Function.apply
