"""fsdp-memory: streams, pooled buffers and all-gather rate limiting for FSDP.

`MemoryManager` ties together a `StreamPool` (streams by role; CPU stand-ins of the same
interface), a `BufferPool` (flat buffers reused only after the event they were freed with; no
``record_stream``) and a `RateLimiter` (in-flight all-gathers bounded by count and bytes), and
reports `MemoryStats`. Imports only torch: events from other layers (fsdp-comm's `Work`) are
accepted by duck typing as a `CompletionHandle`.
"""

import importlib.metadata as _metadata

from ._buffer_pool import BufferPool
from ._errors import MemoryTimeoutError, RateLimitTimeoutError
from ._events import After, CompletionHandle, CpuEvent, Event
from ._host_heap import HostHeapStats, host_heap_stats, set_host_mmap_threshold, trim_host_heap
from ._manager import MemoryConfig, MemoryManager, Transfer
from ._poison import POISON_BYTE
from ._rate_limiter import DEFAULT_MAX_INFLIGHT_ALL_GATHERS, RateLimiter, Ticket
from ._simulate import ScheduleResult, simulate_schedule
from ._sizes import bucket_nbytes
from ._stats import LimiterStats, MemoryStats, PoolStats
from ._streams import CpuStream, Stream, StreamPool, StreamRole

try:  # the version lives in pyproject.toml only
    __version__ = _metadata.version("fsdp-memory")
except _metadata.PackageNotFoundError:  # on sys.path without being installed
    __version__ = "0+unknown"

__all__ = [
    "After",
    "BufferPool",
    "CompletionHandle",
    "CpuEvent",
    "CpuStream",
    "DEFAULT_MAX_INFLIGHT_ALL_GATHERS",
    "Event",
    "HostHeapStats",
    "LimiterStats",
    "MemoryConfig",
    "MemoryManager",
    "MemoryStats",
    "MemoryTimeoutError",
    "POISON_BYTE",
    "PoolStats",
    "RateLimitTimeoutError",
    "RateLimiter",
    "ScheduleResult",
    "Stream",
    "StreamPool",
    "StreamRole",
    "Ticket",
    "Transfer",
    "bucket_nbytes",
    "host_heap_stats",
    "set_host_mmap_threshold",
    "trim_host_heap",
    "simulate_schedule",
]
