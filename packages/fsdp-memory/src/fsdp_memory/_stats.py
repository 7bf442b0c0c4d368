"""Results: `PoolStats`, `LimiterStats` and the manager's `MemoryStats` (frozen snapshots)."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["PoolStats", "LimiterStats", "MemoryStats"]


@dataclass(frozen=True)
class PoolStats:
    """One `BufferPool` at one moment. Bytes count what the pool holds, padding included.

    ``reserved_bytes`` = ``live_bytes`` (handed out) + ``cached_bytes`` (free, reusable now)
    + ``pending_bytes`` (freed, waiting for their ``after`` event). ``num_allocs`` counts
    ``allocate`` calls, of which ``num_reuses`` were served from the cache; the rest
    (``num_fresh``) asked torch's allocator for new memory. ``trimmed_bytes`` counts cached
    bytes let go by `BufferPool.trim` or the cap; ``num_oom_trims`` the times an out-of-memory
    error made the pool give its cache back to torch and retry.
    """

    live_bytes: int = 0
    peak_bytes: int = 0
    reserved_bytes: int = 0
    peak_reserved_bytes: int = 0
    cached_bytes: int = 0
    pending_bytes: int = 0
    num_allocs: int = 0
    num_reuses: int = 0
    num_frees: int = 0
    trimmed_bytes: int = 0
    num_oom_trims: int = 0

    @property
    def num_fresh(self) -> int:
        """Allocations that took new memory from torch's allocator."""
        return self.num_allocs - self.num_reuses


@dataclass(frozen=True)
class LimiterStats:
    """One `RateLimiter` at one moment. In-flight counts include released tickets whose
    ``after`` event has not completed yet."""

    max_count: int | None = None
    max_bytes: int | None = None
    inflight: int = 0
    inflight_bytes: int = 0
    peak_inflight: int = 0
    peak_inflight_bytes: int = 0
    num_acquires: int = 0
    num_waits: int = 0
    wait_s: float = 0.0


@dataclass(frozen=True)
class MemoryStats:
    """A `MemoryManager` at one moment.

    The top-level byte and allocation fields are the device pool's (unsharded parameters and
    gradients); ``host`` holds the host (pinned) pool's and ``limiter`` the rate limiter's
    details. ``num_alloc_retries`` is the CUDA caching allocator's counter for the device
    (``torch.cuda.memory_stats()["num_alloc_retries"]``, process-wide since its last reset);
    0 on CPU.
    """

    live_bytes: int = 0
    peak_bytes: int = 0
    reserved_bytes: int = 0
    peak_reserved_bytes: int = 0
    cached_bytes: int = 0
    num_allocs: int = 0
    num_reuses: int = 0
    num_limiter_waits: int = 0
    limiter_wait_s: float = 0.0
    num_alloc_retries: int = 0
    device: PoolStats = field(default_factory=PoolStats)
    host: PoolStats = field(default_factory=PoolStats)
    limiter: LimiterStats = field(default_factory=LimiterStats)
