"""Sending a replica's training state to a replica group that rejoins (Note [fault-tolerant
replicas] in ``_ft_replicate.py``): a nest of dicts, lists and tuples whose leaves are tensors
(DTensors included: their local shard travels), numbers, strings and other picklable values.

The skeleton (the nest with each tensor replaced by its dtype, shape and, for a DTensor, its
placements) is pickled and sent first; then every tensor's bytes, in order. Bytes, not values:
the receiver holds bitwise what the sender held, whatever the dtype.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

__all__ = ["send_state", "recv_state"]


@dataclass(frozen=True)
class _TensorSlot:
    index: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    device_type: str
    placements: tuple[Any, ...] | None = None  # a DTensor's
    global_shape: tuple[int, ...] | None = None
    global_stride: tuple[int, ...] | None = None


def _flatten(value: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(value, DTensor):
        local = value.to_local()
        tensors.append(local)
        return _TensorSlot(
            len(tensors) - 1,
            local.dtype,
            tuple(local.shape),
            local.device.type,
            tuple(value.placements),
            tuple(value.shape),
            tuple(value.stride()),
        )
    if isinstance(value, torch.Tensor):
        tensors.append(value.detach())
        return _TensorSlot(len(tensors) - 1, value.dtype, tuple(value.shape), value.device.type)
    if isinstance(value, dict):
        return {k: _flatten(v, tensors) for k, v in value.items()}
    if isinstance(value, list):
        return [_flatten(v, tensors) for v in value]
    if isinstance(value, tuple):
        return tuple(_flatten(v, tensors) for v in value)
    return value


def _rebuild(value: Any, make: Callable[[_TensorSlot], torch.Tensor]) -> Any:
    if isinstance(value, _TensorSlot):
        return make(value)
    if isinstance(value, dict):
        return {k: _rebuild(v, make) for k, v in value.items()}
    if isinstance(value, list):
        return [_rebuild(v, make) for v in value]
    if isinstance(value, tuple):
        return tuple(_rebuild(v, make) for v in value)
    return value


def _as_bytes(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    flat = t.contiguous().view(-1)
    if flat.dtype != torch.uint8:
        flat = flat.view(torch.uint8) if flat.numel() else flat.new_empty(0, dtype=torch.uint8)
    return flat.to(device)


def send_state(pg: dist.ProcessGroup, dst: int, state: Any, device: torch.device, tag: int) -> int:
    """Send ``state`` to rank ``dst`` of ``pg``; returns the bytes sent."""
    tensors: list[torch.Tensor] = []
    skeleton = pickle.dumps(_flatten(state, tensors))
    blob = torch.frombuffer(bytearray(skeleton), dtype=torch.uint8).to(device)
    pg.send([torch.tensor([blob.numel()], dtype=torch.int64, device=device)], dst, tag).wait()
    pg.send([blob], dst, tag).wait()
    sent = blob.numel()
    for t in tensors:
        raw = _as_bytes(t, device)
        if raw.numel():
            pg.send([raw], dst, tag).wait()
        sent += raw.numel()
    return sent


def recv_state(
    pg: dist.ProcessGroup,
    src: int,
    device: torch.device,
    tag: int,
    mesh_of: Callable[[], Any],
) -> Any:
    """Receive what `send_state` sent from rank ``src``; DTensors are rebuilt on the mesh
    ``mesh_of()`` returns (the receiver's own, same layout as the sender's)."""
    size = torch.empty(1, dtype=torch.int64, device=device)
    pg.recv([size], src, tag).wait()
    blob = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    pg.recv([blob], src, tag).wait()
    skeleton = pickle.loads(blob.cpu().numpy().tobytes())  # noqa: S301 - from our own replica
    mesh: list[Any] = []

    def make(slot: _TensorSlot) -> torch.Tensor:
        numel = 1
        for d in slot.shape:
            numel *= d
        nbytes = numel * slot.dtype.itemsize
        raw = torch.empty(nbytes, dtype=torch.uint8, device=device)
        if nbytes:
            pg.recv([raw], src, tag).wait()
        home = device if slot.device_type == device.type else torch.device(slot.device_type)
        local = (
            raw.to(home).view(slot.dtype).view(slot.shape)
            if nbytes
            else torch.empty(slot.shape, dtype=slot.dtype, device=home)
        )
        if slot.placements is None:
            return local
        if not mesh:
            mesh.append(mesh_of())
        return DTensor.from_local(
            local,
            mesh[0],
            slot.placements,
            run_check=False,
            shape=torch.Size(slot.global_shape or ()),
            stride=slot.global_stride,
        )

    # Tensors arrive in the order they were flattened: _rebuild walks the same order.
    return _rebuild(skeleton, make)
