"""`HostGradCopies`: reduced gradients on their way to the host under CPU offload.

Note [gradients to the host]
    With CPU offload the sharded gradients live in pinned host memory, next to the shards the
    optimizer steps on the CPU. Each unit's reduced gradient used to come back with a blocking
    copy (``tensor.to("cpu")``, or ``copy_`` into pinned memory): the host waited for the
    GPU queue to drain, once per unit per backward (issue #27: 0.27B with offload took 1.42x
    FSDP2's step on an H100, 2026-11-23). Now the copy is queued on the memory layer's
    device-to-host stream (`MemoryManager.copy_to_host`, which first orders that stream after
    the work that produced the gradient) and the host goes on; the device buffer is returned
    to the pool to be reused only after the copy (``free(after=done)``). A gradient that
    adds into one already on the host (accumulation) is staged in a pinned buffer and added
    later. The end of backward settles everything with one wait on the last copy (the
    copies run in order on one stream), then does the staged additions: the optimizer sees
    final gradients, as before. Users' post-accumulate-grad hooks read ``.grad`` as soon as
    a unit's gradient is final, so a unit with such hooks settles before running them.

    Only a gradient reduced on a GPU for a shard on the host takes this path, so it runs on
    a GPU only: ``tests/engine/test_gpu_parity.py::test_offload_parity_on_one_gpu`` checks it
    (with and without accumulation) and skips elsewhere. Not yet run: no GPU was lent when it
    was written (2026-11-27).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["HostGradCopies"]


class HostGradCopies:
    """Device-to-host copies of one unit's reduced gradients, settled at the end of backward
    (Note [gradients to the host])."""

    __slots__ = ("_memory", "_last", "_adds")

    def __init__(self, memory: Any) -> None:
        self._memory = memory
        self._last: Any = None  # the event of the latest copy queued
        self._adds: list[tuple[torch.Tensor, torch.Tensor]] = []  # (destination, staged)

    @property
    def pending(self) -> bool:
        return self._last is not None

    def copy(self, reduced: torch.Tensor, out: torch.Tensor) -> Any:
        """Queue ``reduced`` (device) into ``out`` (host); returns the copy's done event, after
        which ``reduced`` may be reused."""
        transfer = self._memory.copy_to_host(reduced, out=out)
        if reduced.is_cuda:  # a tensor not from the pool: the allocator must wait for the copy
            reduced.record_stream(self._memory.streams.device_to_host)
        self._last = transfer.done
        return transfer.done

    def add_later(self, reduced: torch.Tensor, into: torch.Tensor) -> Any:
        """Queue ``reduced`` (device) to be added into ``into`` (host) once copied; returns the
        copy's done event."""
        staged = self._memory.allocate_host(reduced.numel(), reduced.dtype)
        done = self.copy(reduced, staged)
        self._adds.append((into, staged))
        return done

    def settle(self) -> None:
        """Wait for the copies queued (one wait: they run in order on one stream), then do
        the additions staged."""
        last, self._last = self._last, None
        if last is None:
            return
        synchronize = getattr(last, "synchronize", None)
        if callable(synchronize):
            synchronize()
        adds, self._adds = self._adds, []
        for into, staged in adds:
            into.add_(staged.view(into.shape).to(into.dtype))
            self._memory.free_host(staged)
