"""`simulate_schedule`: FSDP's forward and backward on a virtual clock, for ablations.

The paper's Fig. 6c question, "what do pooling and rate limiting buy?", asked of any
`MemoryManager` without a GPU: each unit all-gathers its parameters into a pooled buffer
(through the rate limiter), computes, and frees the buffer after its compute; backward also
allocates a gradient buffer freed after its reduce-scatter. Collectives and compute take
virtual time on their own "streams"; the issuing CPU costs none, so without a limiter it runs
ahead of the device exactly as the paper describes. Completion handles follow the virtual
clock, and a CPU blocked in the limiter moves the clock to the event it waits on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._manager import MemoryManager
from ._sizes import check_numel

__all__ = ["ScheduleResult", "simulate_schedule"]


class _Clock:
    """Virtual time in seconds; only a blocked CPU moves it."""

    def __init__(self) -> None:
        self.now = 0.0


class _Lane:
    """A device stream: work runs in issue order, one piece at a time."""

    def __init__(self) -> None:
        self.free_at = 0.0

    def run(self, *, ready_at: float, duration: float) -> float:
        self.free_at = max(self.free_at, ready_at) + duration
        return self.free_at


class _VirtualWork:
    """A completion handle done once the virtual clock reaches ``done_at``."""

    __slots__ = ("_clock", "done_at")

    def __init__(self, clock: _Clock, done_at: float) -> None:
        self._clock = clock
        self.done_at = done_at

    def is_completed(self) -> bool:
        return self._clock.now >= self.done_at

    def wait(self, timeout: float | None = None) -> None:
        del timeout  # virtual waits end at once
        self._clock.now = max(self._clock.now, self.done_at)


@dataclass(frozen=True)
class ScheduleResult:
    """What one simulated step cost. Bytes are the device pool's; times are virtual seconds."""

    num_units: int
    unit_bytes: int
    peak_bytes: int
    peak_reserved_bytes: int
    num_allocs: int
    num_fresh: int
    num_reuses: int
    num_limiter_waits: int
    step_time: float

    @property
    def peak_units(self) -> float:
        """Peak live bytes in units of one unit's parameters."""
        return self.peak_bytes / self.unit_bytes


@dataclass
class _Sim:
    mm: MemoryManager
    numel: int
    dtype: torch.dtype
    comm_s: float
    compute_s: float

    def __post_init__(self) -> None:
        self.clock = _Clock()
        self.gather, self.reduce, self.compute = _Lane(), _Lane(), _Lane()
        self.nbytes = self.numel * self.dtype.itemsize

    def gathered(self, compute_s: float) -> tuple[torch.Tensor, _VirtualWork]:
        """All-gather one unit and compute with it; the buffer is free after the compute."""
        ticket = self.mm.limiter.acquire(self.nbytes)
        buf = self.mm.allocate(self.numel, self.dtype, stream=self.mm.streams.all_gather)
        gathered_at = self.gather.run(ready_at=self.clock.now, duration=self.comm_s)
        done = _VirtualWork(self.clock, self.compute.run(ready_at=gathered_at, duration=compute_s))
        self.mm.free(buf, after=done)
        ticket.release(after=done)
        return buf, done

    def backward_unit(self) -> None:
        grad = self.mm.allocate(self.numel, self.dtype, stream=self.mm.streams.compute)
        _, computed = self.gathered(2 * self.compute_s)
        reduced = self.reduce.run(ready_at=computed.done_at, duration=self.comm_s)
        self.mm.free(grad, after=_VirtualWork(self.clock, reduced))

    def end(self) -> float:
        self.clock.now = max(
            self.clock.now, self.gather.free_at, self.reduce.free_at, self.compute.free_at
        )
        return self.clock.now


def simulate_schedule(
    manager: MemoryManager,
    *,
    num_units: int = 24,
    unit_numel: int = 2**20,
    dtype: torch.dtype = torch.float32,
    comm_s: float = 1.0,
    compute_s: float = 1.0,
) -> ScheduleResult:
    """Run one forward and backward of ``num_units`` equal FSDP units on ``manager``.

    Per unit: forward all-gathers (``comm_s``) then computes (``compute_s``); backward
    all-gathers, computes (2 x ``compute_s``) into a gradient buffer and reduce-scatters it
    (``comm_s``). Use a fresh manager per call: the result reads its statistics.
    """
    check_numel(num_units, where="simulate_schedule")
    sim = _Sim(
        manager, check_numel(unit_numel, where="simulate_schedule"), dtype, comm_s, compute_s
    )
    for _ in range(num_units):
        sim.gathered(compute_s)
    for _ in range(num_units):
        sim.backward_unit()
    step_time = sim.end()
    stats = manager.stats()
    return ScheduleResult(
        num_units=num_units,
        unit_bytes=sim.nbytes,
        peak_bytes=stats.peak_bytes,
        peak_reserved_bytes=stats.peak_reserved_bytes,
        num_allocs=stats.num_allocs,
        num_fresh=stats.device.num_fresh,
        num_reuses=stats.num_reuses,
        num_limiter_waits=stats.num_limiter_waits,
        step_time=step_time,
    )
