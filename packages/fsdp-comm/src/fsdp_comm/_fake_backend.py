"""The ``fake`` backend: one process plays rank ``rank`` of a world of ``world_size``.

Outputs have the right shapes and this rank's own data lands where the real collective would
put it, but nothing is exchanged: other ranks' chunks of an all-gather are left as they were,
a reduce-scatter keeps this rank's own chunk of its input (times the factor of a pre-multiplied
sum), an all-reduce and a broadcast leave the tensor unchanged. Tensors may live on the
``meta`` device, so memory and schedules can be simulated at world sizes this machine cannot
run. `FakeBackend.traffic` counts calls and bytes per collective.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from ._backend import Backend
from ._reduce_op import ReduceKind, ReduceOp
from ._work import CompletedWork, Work

__all__ = ["FakeBackend", "FakeTraffic"]


@dataclass
class FakeTraffic:
    """Calls and bytes each collective would have sent (input bytes, as nccl-tests count)."""

    calls: Counter[str] = field(default_factory=Counter)
    bytes: Counter[str] = field(default_factory=Counter)

    def record(self, collective: str, nbytes: int) -> None:
        self.calls[collective] += 1
        self.bytes[collective] += nbytes


class FakeBackend(Backend):
    """Rank ``rank`` of a simulated world of ``world_size``; no communication at all."""

    name = "fake"

    def __init__(
        self,
        *,
        rank: int = 0,
        world_size: int = 1,
        device: torch.device | str = "cpu",
        ranks: tuple[int, ...] | None = None,
        timeout: float | None = None,
        traffic: FakeTraffic | None = None,
    ) -> None:
        super().__init__(timeout=timeout)
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"rank must be an int with 0 <= rank < {world_size}, got {rank!r}")
        self._rank = rank
        self._world_size = world_size
        self._device = torch.device(device)
        self._ranks = tuple(range(world_size)) if ranks is None else ranks
        self.traffic = FakeTraffic() if traffic is None else traffic
        self._debug = False  # nothing to compare against: there are no peers

    @classmethod
    def from_options(cls, **options: Any) -> FakeBackend:
        return cls(**options)

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def ranks(self) -> tuple[int, ...]:
        return self._ranks

    @property
    def capabilities(self) -> dict[str, str]:
        return {"all": "simulated: shapes only, no exchange"}

    def _all_gather_impl(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool) -> Work:
        n = inp.numel()
        out[self._rank * n : (self._rank + 1) * n].copy_(inp)
        self.traffic.record("all_gather_into_tensor", _nbytes(inp))
        return CompletedWork()

    def _reduce_scatter_impl(
        self, out: torch.Tensor, inp: torch.Tensor, op: ReduceOp, async_op: bool
    ) -> Work:
        n = out.numel()
        out.copy_(inp[self._rank * n : (self._rank + 1) * n])
        if op.kind is ReduceKind.PREMUL_SUM:
            assert op.factor is not None  # PREMUL_SUM always has one (__post_init__)
            out.mul_(op.factor)
        self.traffic.record("reduce_scatter_tensor", _nbytes(inp))
        return CompletedWork()

    def _all_reduce_impl(self, tensor: torch.Tensor, op: ReduceOp, async_op: bool) -> Work:
        if op.kind is ReduceKind.PREMUL_SUM:
            assert op.factor is not None  # PREMUL_SUM always has one (__post_init__)
            tensor.mul_(op.factor)
        self.traffic.record("all_reduce", _nbytes(tensor))
        return CompletedWork()

    def _broadcast_impl(self, tensor: torch.Tensor, src: int, async_op: bool) -> Work:
        self.traffic.record("broadcast", _nbytes(tensor))
        return CompletedWork()

    def _barrier_impl(self) -> None:
        self.traffic.record("barrier", 0)

    def _new_group_impl(self, ranks: tuple[int, ...]) -> Backend | None:
        if self._rank not in ranks:
            return None
        return FakeBackend(
            rank=ranks.index(self._rank),
            world_size=len(ranks),
            device=self._device,
            ranks=tuple(self._ranks[r] for r in ranks),
            timeout=self._timeout,
            traffic=self.traffic,
        )


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
