"""`UnitContext`: everything a unit needs from the layers below, passed explicitly, and the
interfaces (`CommBackend`, `MemoryLayer`) those layers must provide.

One context per `fully_shard` call: the backends it communicates on (from fsdp-comm, any
implementation), the memory manager it allocates from (from fsdp-memory, any implementation),
its policies and its settings. No globals: a test can hand a unit a counting backend or a
non-pooling manager and see it used.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from ._policies import MixedPrecisionPolicy, OffloadPolicy
from ._settings import UnitSettings

__all__ = ["UnitContext", "CommBackend", "MemoryLayer", "WorkHandle"]


class WorkHandle(Protocol):
    """An asynchronous collective (``fsdp_comm.Work``)."""

    def wait(self, timeout: float | None = None) -> None: ...


@runtime_checkable
class CommBackend(Protocol):
    """What ``mesh=``/``comm=`` must provide (``fsdp_comm.Backend`` does)."""

    @property
    def rank(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    @property
    def device(self) -> torch.device: ...

    def all_gather_into_tensor(
        self, out: torch.Tensor, inp: torch.Tensor, *, async_op: bool = False
    ) -> WorkHandle | None: ...

    def reduce_scatter_tensor(
        self, out: torch.Tensor, inp: torch.Tensor, *, op: Any = ..., async_op: bool = False
    ) -> WorkHandle | None: ...

    def all_reduce(
        self, tensor: torch.Tensor, *, op: Any = ..., async_op: bool = False
    ) -> WorkHandle | None: ...

    def broadcast(
        self, tensor: torch.Tensor, *, src: int, async_op: bool = False
    ) -> WorkHandle | None: ...

    def new_group(self, ranks: Any) -> CommBackend | None: ...


@runtime_checkable
class MemoryLayer(Protocol):
    """What ``memory=`` must provide (``fsdp_memory.MemoryManager`` does). Optionally
    ``release_host_heap(freed_bytes)`` (Note [host heap] in fsdp_memory)."""

    limiter: Any

    def allocate(self, numel: int, dtype: torch.dtype) -> torch.Tensor: ...

    def free(self, tensor: torch.Tensor, *, after: Any = None) -> None: ...


@dataclass
class UnitContext:
    """Communication, memory, policies and settings of one unit.

    ``shard`` gathers and reduce-scatters the unit's parameters; ``replicate`` (None for a
    replicate group of one) all-reduces the sharded gradients across replicas (hybrid and
    no-shard); ``post_forward`` (None unless ``reshard_after_forward`` is an int) gathers inside
    the smaller group the parameters are resharded to after forward. ``world`` spans all ranks.
    """

    shard: CommBackend
    replicate: CommBackend | None
    world: CommBackend
    memory: MemoryLayer
    device: torch.device
    mp: MixedPrecisionPolicy = field(default_factory=MixedPrecisionPolicy)
    offload: OffloadPolicy = field(default_factory=OffloadPolicy)
    settings: UnitSettings = field(default_factory=UnitSettings)
    post_forward: CommBackend | None = None
    # A `StepTimeline` while `profile_steps` records (Note [step timeline]); None otherwise,
    # and then the hooks pay one attribute check.
    timeline: Any = None

    @property
    def divide_factor(self) -> float | None:
        return self.settings.divide_factor

    @property
    def data_parallel_size(self) -> int:
        """Ranks holding a replica of the data-parallel gradient: shard x replicate."""
        return self.shard.world_size * (1 if self.replicate is None else self.replicate.world_size)
