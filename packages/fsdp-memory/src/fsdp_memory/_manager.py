"""`MemoryManager`: one device's streams, buffer pools and all-gather rate limiter."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from ._buffer_pool import BufferPool, check_bool
from ._devices import DeviceLike, as_device
from ._events import Event
from ._host_heap import host_heap_stats, trim_host_heap
from ._rate_limiter import DEFAULT_MAX_INFLIGHT_ALL_GATHERS, RateLimiter, check_bound
from ._settings import debug_from_env, resolve_timeout
from ._stats import MemoryStats
from ._streams import Stream, StreamPool, StreamRole

__all__ = ["MemoryConfig", "MemoryManager", "Transfer"]

_log = logging.getLogger("fsdp.memory")


#: Bytes reported freed between two looks at the host heap (`release_host_heap`).
HOST_CHECK_BYTES = 64 * 2**20
#: Free host heap that ``host_trim_bytes="auto"`` lets stand on CPU before trimming (Note
#: [host heap] in _host_heap.py says why 256 MiB and what 128 MiB cost).
AUTO_HOST_TRIM_BYTES = 256 * 2**20


def _host_trim_bytes(value: int | None | str, device: torch.device) -> int | None:
    """``"auto"``: `AUTO_HOST_TRIM_BYTES` on CPU (tensors live in the host heap), off on
    accelerators."""
    if value == "auto":
        return AUTO_HOST_TRIM_BYTES if device.type == "cpu" else None
    return check_bound(value, name="host_trim_bytes", where="MemoryManager")


@dataclass(frozen=True)
class MemoryConfig:
    """The settings a `MemoryManager` was made with (``manager.config``)."""

    device: torch.device
    max_inflight_all_gathers: int | None = DEFAULT_MAX_INFLIGHT_ALL_GATHERS
    max_inflight_bytes: int | None = None
    pooling: bool = True
    max_cached_bytes: int | None = None
    pin_host_memory: bool = False
    debug: bool = False
    timeout: float | None = None
    host_trim_bytes: int | None = None


@dataclass(frozen=True)
class Transfer:
    """The result of a host/device copy: the destination and the event that marks its end.

    Order consumers after ``done`` (``manager.streams.wait(t.done)``) and free the source with
    ``after=t.done``.
    """

    tensor: torch.Tensor
    done: Event


class MemoryManager:
    """Streams, pooled buffers and the all-gather rate limiter of one device.

    ``MemoryManager(device, max_inflight_all_gathers=2, max_inflight_bytes=None,
    pooling=True)``: ``device`` is ``"cpu"`` or a CUDA device. ``max_inflight_all_gathers`` and
    ``max_inflight_bytes`` bound the limiter (None: no bound; both None: unlimited);
    ``pooling=False`` uses a non-pooling pool (the ablation baseline). Keyword-only extras:
    ``max_cached_bytes`` caps free memory kept for reuse; ``debug`` (default
    ``FSDP_MEMORY_DEBUG``) poisons freed buffers; ``timeout`` bounds every blocking wait
    (default ``FSDP_MEMORY_TIMEOUT``, 300 s); ``host_trim_bytes`` (``"auto"``: 256 MiB on CPU,
    off on CUDA) is how much free but resident host heap `release_host_heap` lets stand before
    it trims (Note [host heap] in ``_host_heap.py``).

    Surface: ``streams`` (a `StreamPool`), ``allocate``/``free`` (device buffers),
    ``allocate_host``/``free_host`` (host buffers, pinned where CUDA exists),
    ``copy_to_device``/``copy_to_host`` (on the host-to-device and device-to-host streams),
    ``limiter`` (a `RateLimiter`), ``trim``, ``release_host_heap`` and ``stats``.
    """

    def __init__(
        self,
        device: DeviceLike = "cpu",
        *,
        max_inflight_all_gathers: int | None = DEFAULT_MAX_INFLIGHT_ALL_GATHERS,
        max_inflight_bytes: int | None = None,
        pooling: bool = True,
        max_cached_bytes: int | None = None,
        debug: bool | None = None,
        timeout: float | None = None,
        host_trim_bytes: int | None | str = "auto",
    ) -> None:
        where = "MemoryManager"
        device = as_device(device, where=where)
        self.config = MemoryConfig(
            device=device,
            max_inflight_all_gathers=check_bound(
                max_inflight_all_gathers, name="max_inflight_all_gathers", where=where
            ),
            max_inflight_bytes=check_bound(
                max_inflight_bytes, name="max_inflight_bytes", where=where
            ),
            pooling=check_bool(pooling, name="pooling", where=where),
            max_cached_bytes=max_cached_bytes,
            pin_host_memory=torch.cuda.is_available(),
            debug=debug_from_env()
            if debug is None
            else check_bool(debug, name="debug", where=where),
            timeout=None if timeout is None else resolve_timeout(timeout),
            host_trim_bytes=_host_trim_bytes(host_trim_bytes, device),
        )
        self._host_freed = 0
        self.device = self.config.device
        self.streams = StreamPool(self.device)
        self.pool = self._make_pool(self.device, pin=False)
        self.host_pool = self._make_pool(torch.device("cpu"), pin=self.config.pin_host_memory)
        self.limiter = RateLimiter(
            max_count=max_inflight_all_gathers,
            max_bytes=max_inflight_bytes,
            timeout=self.config.timeout,
        )
        _log.debug("memory manager: %s", self.config)

    def _make_pool(self, device: torch.device, *, pin: bool) -> BufferPool:
        return BufferPool(
            device,
            pooling=self.config.pooling,
            max_cached_bytes=self.config.max_cached_bytes,
            pin_memory=pin,
            debug=self.config.debug,
        )

    # ------------------------------------------------------------------------------ buffers

    def allocate(self, numel: int, dtype: torch.dtype, *, stream: Any = None) -> torch.Tensor:
        """A 1-D device buffer of ``numel`` elements of ``dtype``, made on ``stream``
        (the producer; default: current). See `BufferPool.allocate`."""
        return self.pool.allocate(numel, dtype, stream=self._stream_arg(stream))

    def free(self, tensor: torch.Tensor, *, after: object = None) -> None:
        """Return a device buffer; reused only after ``after`` completes (`BufferPool.free`)."""
        self.pool.free(tensor, after=after)

    def allocate_host(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A 1-D host buffer, page-locked (pinned) when CUDA is available, for CPU offload."""
        return self.host_pool.allocate(numel, dtype)

    def free_host(self, tensor: torch.Tensor, *, after: object = None) -> None:
        """Return a host buffer; pass the copy's ``Transfer.done`` as ``after``."""
        self.host_pool.free(tensor, after=after)

    def _stream_arg(self, stream: Any) -> Stream | None:
        if isinstance(stream, (StreamRole, str)):
            return self.streams[stream]
        return stream  # type: ignore[no-any-return]

    # ---------------------------------------------------------------------------- transfers

    def copy_to_device(self, src: torch.Tensor, *, out: torch.Tensor | None = None) -> Transfer:
        """Copy host ``src`` into a device buffer (``out``, or a new pooled one) on the
        host-to-device stream, without blocking the CPU when ``src`` is pinned."""
        stream = self.streams.host_to_device
        if out is None:
            out = self.allocate(src.numel(), src.dtype, stream=stream)
        return self._copy(src, out, stream, where="copy_to_device")

    def copy_to_host(self, src: torch.Tensor, *, out: torch.Tensor | None = None) -> Transfer:
        """Copy device ``src`` into a host buffer (``out``, or a new pinned one) on the
        device-to-host stream. Read the result only after ``done`` completes."""
        if out is None:
            out = self.allocate_host(src.numel(), src.dtype)
        return self._copy(src, out, self.streams.device_to_host, where="copy_to_host")

    def _copy(
        self, src: torch.Tensor, out: torch.Tensor, stream: Stream, *, where: str
    ) -> Transfer:
        if not isinstance(src, torch.Tensor) or not isinstance(out, torch.Tensor):
            raise TypeError(f"MemoryManager.{where}: src and out must be tensors")
        if src.numel() != out.numel():
            raise ValueError(
                f"MemoryManager.{where}: out must have as many elements as src "
                f"({src.numel()}), got {out.numel()}"
            )
        # The copy stream first waits for work already queued (which produced `src` or last
        # used `out`); the copy then overlaps with whatever is issued next.
        stream.wait_stream(self.streams.current())  # type: ignore[arg-type]
        with self.streams.use(stream):
            out.view(-1).copy_(src.reshape(-1), non_blocking=True)
            done = self.streams.record_event(stream)
        return Transfer(tensor=out, done=done)

    # ---------------------------------------------------------------------------- the rest

    def trim(self, target_bytes: int = 0) -> int:
        """Drop cached free buffers of both pools down to ``target_bytes`` each; bytes let go."""
        return self.pool.trim(target_bytes) + self.host_pool.trim(target_bytes)

    def release_host_heap(self, freed_bytes: int) -> bool:
        """Report ``freed_bytes`` of host tensors just freed. Every 64 MiB reported, look at
        glibc's heap: when more than ``host_trim_bytes`` of it is free (resident holes),
        give those pages back (Note [host heap]). Returns True when it trimmed."""
        limit = self.config.host_trim_bytes
        if limit is None:
            return False
        self._host_freed += freed_bytes
        if self._host_freed < HOST_CHECK_BYTES:
            return False
        self._host_freed = 0
        heap = host_heap_stats()
        if heap is not None and heap.free_bytes < limit:
            return False
        trimmed = trim_host_heap()
        if heap is not None:
            _log.debug(
                "host heap had %d free bytes resident; trimmed: %s", heap.free_bytes, trimmed
            )
        return trimmed

    def stats(self) -> MemoryStats:
        """A `MemoryStats` snapshot: device pool bytes and counts, limiter waits, host pool,
        and the CUDA allocator's ``num_alloc_retries``."""
        device, host, limiter = self.pool.stats(), self.host_pool.stats(), self.limiter.stats()
        return MemoryStats(
            live_bytes=device.live_bytes,
            peak_bytes=device.peak_bytes,
            reserved_bytes=device.reserved_bytes,
            peak_reserved_bytes=device.peak_reserved_bytes,
            cached_bytes=device.cached_bytes,
            num_allocs=device.num_allocs,
            num_reuses=device.num_reuses,
            num_limiter_waits=limiter.num_waits,
            limiter_wait_s=limiter.wait_s,
            num_alloc_retries=self._alloc_retries(),
            device=device,
            host=host,
            limiter=limiter,
        )

    def _alloc_retries(self) -> int:
        if self.device.type != "cuda":
            return 0
        return int(torch.cuda.memory_stats(self.device).get("num_alloc_retries", 0))

    def reset_peak_stats(self) -> None:
        """Set the pools' peaks to their current bytes."""
        self.pool.reset_peak_stats()
        self.host_pool.reset_peak_stats()

    def __repr__(self) -> str:
        c = self.config
        return (
            f"MemoryManager(device={str(c.device)!r}, max_inflight_all_gathers="
            f"{c.max_inflight_all_gathers}, max_inflight_bytes={c.max_inflight_bytes}, "
            f"pooling={c.pooling})"
        )
