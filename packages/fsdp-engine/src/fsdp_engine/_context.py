"""`UnitContext`: everything a unit needs from the layers below, passed explicitly.

One context per `fully_shard` call: the backends it communicates on (from fsdp-comm, any
implementation), the memory manager it allocates from (from fsdp-memory, any implementation),
and its policies. No globals: a test can hand a unit a counting backend or a non-pooling
manager and see it used.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ._policies import MixedPrecisionPolicy, OffloadPolicy

__all__ = ["UnitContext"]


@dataclass
class UnitContext:
    """Communication, memory and policies of one unit.

    ``shard`` gathers and reduce-scatters the unit's parameters; ``replicate`` (None for a
    replicate group of one) all-reduces the sharded gradients across replicas (hybrid and
    no-shard); ``post_forward`` (None unless ``reshard_after_forward`` is an int) gathers inside
    the smaller group the parameters are resharded to after forward. ``world`` spans all ranks.
    """

    shard: Any
    replicate: Any | None
    world: Any
    memory: Any
    device: torch.device
    mp: MixedPrecisionPolicy = field(default_factory=MixedPrecisionPolicy)
    offload: OffloadPolicy = field(default_factory=OffloadPolicy)
    reshard_after_forward: bool | int = True
    post_forward: Any | None = None
    divide_factor: float | None = None

    @property
    def data_parallel_size(self) -> int:
        """Ranks holding a replica of the data-parallel gradient: shard x replicate."""
        return self.shard.world_size * (1 if self.replicate is None else self.replicate.world_size)
