"""Turning `fully_shard`'s ``mesh`` argument into the backends a unit communicates on.

``mesh`` may be None (the default torch.distributed group), an `fsdp_comm.Backend` (1-D), an
`fsdp_comm.Mesh` (2-D: replicate x shard), or a torch `DeviceMesh` (1-D, or 2-D with the
replicate dimension first, as FSDP2 takes it): its process groups are wrapped in `torch`
backends, and the DeviceMesh itself is what the unit's DTensor parameters live on.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["Backends", "resolve_backends", "check_mesh", "check_reshard_after_forward"]

_FROM_DEVICE_MESH: weakref.WeakKeyDictionary[DeviceMesh, Any] = weakref.WeakKeyDictionary()
_POST_FORWARD: weakref.WeakKeyDictionary[Any, dict[int, Any]] = weakref.WeakKeyDictionary()
# Per thread: ranks run as threads of one process (torch's threaded test groups, this
# project's threads backend) must not share one rank's backend, or the collective that makes
# a post-forward group runs on some ranks only and hangs.
_LOCAL = threading.local()
# Every default backend made, held to the end of the process as the module-level cache held
# them before it went per thread: freed with a thread's locals instead, at interpreter exit,
# a rank aborted ("terminate called without an active exception", tests/multinode).
_MADE: list[Any] = []


@dataclass(frozen=True)
class Backends:
    """The backends of one unit. ``device_mesh``: the torch DeviceMesh the user passed."""

    shard: Any
    replicate: Any | None
    world: Any
    post_forward: Any | None
    device_mesh: DeviceMesh | None = None


def check_mesh(mesh: Any) -> None:
    """Fail at `fully_shard` time on a mesh argument of the wrong kind."""
    from fsdp_comm import Backend, Mesh

    if isinstance(mesh, DeviceMesh):
        if mesh.ndim not in (1, 2):  # FSDP2's words, which its tests match
            raise ValueError(
                f"fully_shard expects a 1D or 2D DeviceMesh but got {mesh}: "
                "1-D shards, 2-D is (replicate, shard)"
            )
        if mesh.ndim == 2 and mesh.mesh_dim_names is None:
            # FSDP2 raises an AssertionError here too (its tests expect that type).
            raise AssertionError(
                "Please init the 2D mesh for HSDP with mesh_dim_names "
                "specified (e.g. ('replicate', 'shard'))"
            )
        return
    if mesh is not None and not isinstance(mesh, (Backend, Mesh)):
        raise TypeError(
            "mesh must be None (the default torch.distributed group), a torch "
            "DeviceMesh (1-D, or 2-D replicate x shard), an fsdp_comm.Backend "
            f"(1-D) or an fsdp_comm.Mesh (2-D), got {type(mesh).__name__}"
        )


def check_reshard_after_forward(value: Any, shard_size: int | None, fqn: str) -> None:
    if isinstance(value, bool):
        return
    if not isinstance(value, int) or value < 1:
        raise ValueError(
            f"fully_shard({fqn or '<root>'}): reshard_after_forward must be True, "
            f"False or a positive int, got {value!r}"
        )
    if shard_size is not None and shard_size % value != 0:
        raise ValueError(
            f"fully_shard({fqn or '<root>'}): reshard_after_forward={value} must divide the "
            f"shard group size {shard_size} (parameters are resharded to groups of that many "
            "consecutive ranks)"
        )


def _check_not_threads_on_cuda(world: Any, fqn: str) -> None:
    """Thread ranks cannot share a GPU under autograd: CUDA backward runs on one engine thread
    per device for every calling thread, so a rank waiting in a backward hook for its peers'
    collective blocks the very thread the peers' backward needs, and both hang (seen on an
    H100, 2026-11-23). NCCL avoids it because its waits are stream-side."""
    device = getattr(world, "device", None)
    if (
        getattr(world, "name", None) == "threads"
        and world.world_size > 1
        and isinstance(device, torch.device)
        and device.type == "cuda"
    ):
        raise ValueError(
            f"fully_shard({fqn or '<root>'}): mesh is a threads backend of {world.world_size} "
            f"ranks on {device}; thread ranks sharing a GPU deadlock in backward (autograd runs "
            "every thread's CUDA backward on one engine thread). Use process ranks: "
            "fsdp_comm.launch(..., backend='torch', backend_options={'device': 'cuda:0', "
            "'process_group_backend': 'gloo'}) on one GPU, NCCL with one GPU per rank"
        )


def resolve_backends(mesh: Any, reshard_after_forward: bool | int, fqn: str) -> Backends:
    """The backends for ``mesh`` (collective where groups must be created: every rank calls
    it for every unit, in the same order)."""
    from fsdp_comm import Mesh

    given = mesh if isinstance(mesh, DeviceMesh) else None
    if given is not None:
        mesh = _from_device_mesh(given)
    if mesh is None:
        mesh = _default_backend()
    if isinstance(mesh, Mesh):
        rep = mesh.replicate if mesh.replicate.world_size > 1 else None
        if getattr(mesh.replicate, "fault_tolerant", False):  # issue #31: opt-in
            # fsdp_comm.FaultTolerantReplicate: its size is the live replicas of each step's
            # quorum, one while alone; kept, so that replicas that come back are reduced with.
            rep = mesh.replicate
        shard, world = mesh.shard, mesh.world
    else:
        shard, rep, world = mesh, None, mesh
    check_reshard_after_forward(reshard_after_forward, shard.world_size, fqn)
    _check_not_threads_on_cuda(world, fqn)
    return Backends(shard, rep, world, _post_forward_group(shard, reshard_after_forward), given)


def _default_backend() -> Any:
    """One `torch` backend per default process group (its shared-memory segment and its
    post-forward groups are then shared by every unit)."""
    import torch.distributed as dist
    from fsdp_comm import get_backend

    cache: dict[int, Any] = _LOCAL.__dict__.setdefault("default", {})
    if dist.is_initialized():
        cached = cache.get(id(dist.group.WORLD))
        if cached is not None:
            return cached
    backend = get_backend("torch")  # initialises the default group when needed
    cache.clear()
    cache[id(dist.group.WORLD)] = backend
    _MADE.append(backend)
    return backend


def _from_device_mesh(mesh: DeviceMesh) -> Any:
    """`torch` backends over a DeviceMesh's process groups (one set per mesh)."""
    found = _FROM_DEVICE_MESH.get(mesh)
    if found is not None:
        return found
    from fsdp_comm import Mesh, TorchBackend

    device = torch.device(mesh.device_type)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    if mesh.ndim == 1:
        found = TorchBackend(mesh.get_group(), device=device)
    else:
        rep = TorchBackend(mesh.get_group(0), device=device)
        shard = TorchBackend(mesh.get_group(1), device=device)
        world = _world_of(mesh, device)
        shape = cast("tuple[int, int]", tuple(mesh.shape))  # 2-D: `check_mesh` allows 1 or 2
        found = Mesh(world=world, shard=shard, replicate=rep, shape=shape)
    _FROM_DEVICE_MESH[mesh] = found
    return found


def _world_of(mesh: DeviceMesh, device: torch.device) -> Any:
    import torch.distributed as dist
    from fsdp_comm import TorchBackend

    if mesh.size() == dist.get_world_size():
        return TorchBackend(dist.group.WORLD, device=device)
    return TorchBackend(mesh._flatten().get_group(), device=device)


def _post_forward_group(shard: Any, k: bool | int) -> Any:
    if isinstance(k, bool) or k in (1, shard.world_size):
        return None
    groups = _POST_FORWARD.setdefault(shard, {})
    if k not in groups:
        mine = None
        for start in range(0, shard.world_size, k):  # collective: every rank, every group
            sub = shard.new_group(tuple(range(start, start + k)))
            mine = sub if sub is not None else mine
        groups[k] = mine
    return groups[k]
