"""fsdp-memory benchmarks: allocate/free cycle, limiter acquire/release, and the peak memory
of a simulated 24-unit FSDP step with and without pooling and rate limiting.

asv:    cd asv_bench && asv run --python=same --quick --bench memory
script: python asv_bench/benchmarks/memory.py   (prints the figures in the package README)
"""

from __future__ import annotations

import timeit
from collections.abc import Callable
from typing import Any

import torch
from fsdp_memory import CpuEvent, MemoryManager, RateLimiter, simulate_schedule

# 4 MiB of fp32 per unit: the figures scale linearly with the unit size.
UNIT_NUMEL = 2**20
# asv times one call per sample when a benchmark has `setup`, and a single call of a few
# microseconds drowns in timer overhead: each timed call runs this many cycles, so the figure
# asv prints in milliseconds is the cost of one cycle in microseconds.
CYCLES = 1000

#: Manager settings of the ablation (the paper's Fig. 6c): pooling and limiting on and off.
SCHEDULES: dict[str, dict[str, Any]] = {
    "pooled+limited": {},
    "pooled, no limit": {"max_inflight_all_gathers": None},
    "unpooled+limited": {"pooling": False},
    "unpooled, no limit": {"pooling": False, "max_inflight_all_gathers": None},
    "pooled, limit 1": {"max_inflight_all_gathers": 1},
}


class AllocFreeCycle:
    """``allocate`` + ``free`` on CPU, 1000 times (target: under 5 ms, i.e. 5 us a cycle)."""

    params = ([True, False], [4096, UNIT_NUMEL])
    param_names = ["pooling", "numel"]

    def setup(self, pooling: bool, numel: int) -> None:
        self.mm = MemoryManager("cpu", pooling=pooling)
        self.event = CpuEvent()
        self.mm.free(self.mm.allocate(numel, torch.float32))  # warm: the cycle reuses this

    def time_allocate_free_1000x(self, pooling: bool, numel: int) -> None:
        mm = self.mm
        for _ in range(CYCLES):
            mm.free(mm.allocate(numel, torch.float32))

    def time_allocate_free_after_event_1000x(self, pooling: bool, numel: int) -> None:
        mm, event = self.mm, self.event
        for _ in range(CYCLES):
            mm.free(mm.allocate(numel, torch.float32), after=event)


class LimiterCycle:
    """``acquire`` + ``release`` that do not block, 1000 times (ms here = us a cycle)."""

    params = [[2, None]]
    param_names = ["max_count"]

    def setup(self, max_count: int | None) -> None:
        self.limiter = RateLimiter(max_count=max_count)
        self.event = CpuEvent()

    def time_acquire_release_1000x(self, max_count: int | None) -> None:
        limiter = self.limiter
        for _ in range(CYCLES):
            limiter.acquire(UNIT_NUMEL * 4).release()

    def time_acquire_release_after_event_1000x(self, max_count: int | None) -> None:
        limiter, event = self.limiter, self.event
        for _ in range(CYCLES):
            limiter.acquire(UNIT_NUMEL * 4).release(after=event)


class SimulatedSchedule:
    """Forward and backward of 24 equal units on a virtual clock (`simulate_schedule`)."""

    params = [list(SCHEDULES)]
    param_names = ["config"]

    def setup(self, config: str) -> None:
        self.result = simulate_schedule(
            MemoryManager("cpu", **SCHEDULES[config]), unit_numel=UNIT_NUMEL
        )

    def time_schedule(self, config: str) -> None:
        simulate_schedule(MemoryManager("cpu", **SCHEDULES[config]), unit_numel=UNIT_NUMEL)

    def track_peak_reserved_bytes(self, config: str) -> int:
        return self.result.peak_reserved_bytes

    track_peak_reserved_bytes.unit = "bytes"  # type: ignore[attr-defined]

    def track_fresh_allocations(self, config: str) -> int:
        return self.result.num_fresh

    track_fresh_allocations.unit = "allocations"  # type: ignore[attr-defined]

    def track_limiter_waits(self, config: str) -> int:
        return self.result.num_limiter_waits

    track_limiter_waits.unit = "waits"  # type: ignore[attr-defined]

    def track_step_time(self, config: str) -> float:
        return self.result.step_time

    track_step_time.unit = "virtual s"  # type: ignore[attr-defined]


def _best_us(fn: Callable[[], object], number: int = 100, repeat: int = 7) -> float:
    """Best of ``repeat`` runs of ``number`` calls of ``fn`` (each 1000 cycles): us a cycle."""
    best = min(timeit.repeat(fn, number=number, repeat=repeat))
    return best / number / CYCLES * 1e6


def _cycle_us(pooling: bool, numel: int) -> float:
    bench = AllocFreeCycle()
    bench.setup(pooling, numel)
    return _best_us(lambda: bench.time_allocate_free_1000x(pooling, numel))


def _limiter_us(max_count: int | None) -> float:
    bench = LimiterCycle()
    bench.setup(max_count)
    return _best_us(lambda: bench.time_acquire_release_1000x(max_count))


def _torch_empty_us(numel: int) -> float:
    return _best_us(lambda: [torch.empty(numel, dtype=torch.float32) for _ in range(CYCLES)])


def main() -> None:
    """Print the figures of the fsdp-memory README."""
    for pooling in (True, False):
        for numel in AllocFreeCycle.params[1]:
            us = _cycle_us(pooling, numel)
            print(f"allocate+free  pooling={pooling!s:5}  numel={numel:>8}: {us:.2f} us")
    reference = _torch_empty_us(UNIT_NUMEL)
    print(f"reference: torch.empty(numel={UNIT_NUMEL}) + release: {reference:.2f} us")
    for max_count in (2, None):
        print(f"acquire+release  max_count={max_count!s:4}: {_limiter_us(max_count):.2f} us")
    print(
        "\n| config | peak held (MiB) | peak units | fresh allocs | reuses | limiter waits "
        "| step (virtual s) |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, settings in SCHEDULES.items():
        r = simulate_schedule(MemoryManager("cpu", **settings), unit_numel=UNIT_NUMEL)
        print(
            f"| {name} | {r.peak_reserved_bytes / 2**20:.0f} | "
            f"{r.peak_reserved_bytes / r.unit_bytes:.0f} | {r.num_fresh} | {r.num_reuses} | "
            f"{r.num_limiter_waits} | {r.step_time:.0f} |"
        )


if __name__ == "__main__":
    main()
