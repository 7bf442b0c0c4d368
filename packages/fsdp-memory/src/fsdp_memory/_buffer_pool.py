"""`BufferPool`: flat buffers by numel and dtype, reused only after their ``after`` event.

Why a pool of our own: with torch's caching allocator, a buffer made on the all-gather stream
and read on the compute stream needs ``record_stream`` to be freed safely, and the allocator
then holds it until some later, unpredictable moment; a CPU thread that runs ahead makes that
memory pile up (the FSDP paper, Section 3.4). Here a free names the event after which the
buffer is unused, the pool keeps the memory and hands it out again once that event has
completed (or, on CUDA, orders the new owner's stream after it), so memory use follows the
program, not the allocator's timing. No ``record_stream`` anywhere.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import weakref
from collections import deque
from collections.abc import Iterator

import torch

from ._devices import DeviceLike, as_device
from ._events import DONE, Completion, _DeviceEventCompletion, completion_of
from ._poison import poison_
from ._settings import debug_from_env
from ._sizes import bucket_nbytes, check_dtype, check_numel
from ._stats import PoolStats
from ._streams import CpuStream

__all__ = ["BufferPool"]

_log = logging.getLogger("fsdp.memory")

# How many freed tensors the pool remembers (weakly) to tell "freed twice" from "not ours".
_FREED_MEMORY = 4096


class _Block:
    """One piece of memory the pool owns, and its state."""

    __slots__ = ("raw", "nbytes", "view", "view_key", "out", "completion", "poisoned", "seq")

    def __init__(self, raw: torch.Tensor, nbytes: int) -> None:
        self.raw = raw
        self.nbytes = nbytes
        self.view: torch.Tensor = raw
        self.view_key: tuple[torch.dtype, int] | None = None
        self.out: torch.Tensor | None = None
        self.completion: Completion = DONE
        self.poisoned = False
        self.seq = 0


class BufferPool:
    """Flat 1-D buffers for one device, pooled by size class, released by events.

    ``allocate(numel, dtype, stream=...)`` returns a 1-D tensor. New memory is allocated on
    ``stream`` (the producer: the stream that will first write the buffer), so the CUDA caching
    allocator files it under that stream. ``free(tensor, after=event)`` gives it back: the buffer
    is reused only once ``event`` has completed; on CUDA, a buffer whose CUDA event is still
    pending is handed out only with the new owner's stream made to wait on that event (no CPU
    stall, no extra memory). ``after=None`` means "unused from now on": on CUDA an event is
    recorded on the current stream, so pass the consumer's event when another stream used it.

    Size classes (`bucket_nbytes`): 512-byte granules, then 16 classes per doubling, so buffers
    of equal or nearly equal size share memory whatever their dtype. ``max_cached_bytes`` caps
    the free memory kept for reuse (oldest freed dropped first); `trim` drops it on demand.

    Variants: ``pooling=False`` allocates exactly ``numel`` elements with ``torch.empty`` each
    time and lets go of the memory once ``after`` completes (the ablation baseline).
    ``pin_memory=True`` (CPU pools, CUDA present) gives page-locked host buffers for offload.
    ``debug=True`` (or ``FSDP_MEMORY_DEBUG=1``) fills fresh and freed buffers with NaN (floating
    dtypes) or bytes 0xA5 (others) so a use after free shows up.

    Thread-safe: one lock guards the pool, so a background thread may free.
    """

    def __init__(
        self,
        device: DeviceLike = "cpu",
        *,
        pooling: bool = True,
        max_cached_bytes: int | None = None,
        pin_memory: bool = False,
        debug: bool | None = None,
    ) -> None:
        self.device = as_device(device, where="BufferPool")
        self.pooling = check_bool(pooling, name="pooling")
        self.max_cached_bytes = _check_cap(max_cached_bytes)
        self.pin_memory = self._check_pin(check_bool(pin_memory, name="pin_memory"))
        self.debug = debug_from_env() if debug is None else check_bool(debug, name="debug")
        self._is_cuda = self.device.type == "cuda"
        self._lock = threading.Lock()
        self._ready: dict[int, list[_Block]] = {}
        self._pending: dict[int, list[_Block]] = {}
        self._live: dict[int, _Block] = {}
        self._freed: deque[weakref.ref[torch.Tensor]] = deque(maxlen=_FREED_MEMORY)
        self._reset_counters()

    def _reset_counters(self) -> None:
        self._live_bytes = self._cached_bytes = self._pending_bytes = 0
        self._peak_live = self._peak_reserved = 0
        self._num_allocs = self._num_reuses = self._num_frees = 0
        self._num_pending = self._trimmed = self._seq = self._num_oom_trims = 0

    def _check_pin(self, pin: bool) -> bool:
        if pin and self.device.type != "cpu":
            raise ValueError(
                f"BufferPool: pin_memory=True is for host pools, device is {self.device}"
            )
        if pin and not torch.cuda.is_available():
            raise ValueError("BufferPool: pin_memory=True needs CUDA, which is not available here")
        return pin

    bucket_nbytes = staticmethod(bucket_nbytes)

    # ----------------------------------------------------------------------------- allocate

    def allocate(self, numel: int, dtype: torch.dtype, *, stream: object = None) -> torch.Tensor:
        """A 1-D tensor of ``numel`` elements of ``dtype`` (contents undefined).

        ``stream`` is the producer stream (default: the current one). `ValueError` for a
        ``numel`` that is not positive, `TypeError` for something that is not a usable dtype.
        """
        numel = check_numel(numel, where="BufferPool.allocate")
        nbytes = numel * check_dtype(dtype, where="BufferPool.allocate")
        self._check_stream(stream)
        with self._lock:
            if self._num_pending and not self.pooling:
                self._reap_all()
            block = self._take(bucket_nbytes(nbytes), stream) if self.pooling else None
            reused = block is not None
            if block is None:
                block = self._fresh(nbytes, numel, dtype, stream)
            out = self._hand_out(block, numel, dtype)
            self._count_alloc(block.nbytes, reused)
            if self.debug and not reused:
                with self._on_stream(stream):
                    poison_(block.view)
        return out

    def _check_stream(self, stream: object) -> None:
        if stream is None or (not self._is_cuda and isinstance(stream, CpuStream)):
            return
        if self._is_cuda and isinstance(stream, torch.cuda.Stream):
            if stream.device != self.device:
                raise ValueError(
                    f"BufferPool.allocate: stream must be on {self.device}, "
                    f"got one on {stream.device}"
                )
            return
        expected = "torch.cuda.Stream" if self._is_cuda else "CpuStream"
        raise TypeError(
            f"BufferPool.allocate: stream must be None or a {expected} for device "
            f"{self.device}, got {type(stream).__name__}"
        )

    def _take(self, bucket: int, stream: object) -> _Block | None:
        ready = self._ready.get(bucket)
        if not ready:
            self._reap(bucket)
            ready = self._ready.get(bucket)
        if ready:
            block = ready.pop()
            self._cached_bytes -= block.nbytes
            return block
        return self._take_ordered(bucket, stream)

    def _take_ordered(self, bucket: int, stream: object) -> _Block | None:
        """On CUDA, reuse a block whose CUDA event is pending by making ``stream`` wait on it."""
        pending = self._pending.get(bucket)
        if not self._is_cuda or not pending:
            return None
        target = stream if stream is not None else torch.cuda.current_stream(self.device)
        for index, block in enumerate(pending):
            if block.completion.order(target):
                del pending[index]
                self._num_pending -= 1
                self._pending_bytes -= block.nbytes
                if self.debug and not block.poisoned:
                    with self._on_stream(target):
                        poison_(block.view)  # ordered after the event, before the new owner
                return block
        return None

    def _fresh(self, nbytes: int, numel: int, dtype: torch.dtype, stream: object) -> _Block:
        if not self.pooling:
            # The baseline: exactly what `torch.empty(numel, dtype=dtype)` would take.
            block = _Block(self._empty(numel, dtype, stream), nbytes)
            block.view_key = (dtype, numel)
            return block
        size = bucket_nbytes(nbytes)
        return _Block(self._empty(size, torch.uint8, stream), size)

    def _empty(self, numel: int, dtype: torch.dtype, stream: object) -> torch.Tensor:
        with self._on_stream(stream):
            try:
                return self._torch_empty(numel, dtype)
            except torch.cuda.OutOfMemoryError:
                if self._cached_bytes == 0:
                    raise
                # Our cache holds memory torch's allocator cannot see as free: give it back
                # and try once more before failing.
                self._num_oom_trims += 1
                released = self._trim_to(0)
                _log.info(
                    "%s: out of memory for %d elements of %s; dropped %d cached bytes and retried",
                    self.device,
                    numel,
                    dtype,
                    released,
                )
                return self._torch_empty(numel, dtype)

    def _torch_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, device=self.device, pin_memory=self.pin_memory)

    def _on_stream(self, stream: object) -> contextlib.AbstractContextManager[object]:
        if self._is_cuda and stream is not None:
            return torch.cuda.stream(stream)  # type: ignore[arg-type]
        return contextlib.nullcontext()

    def _hand_out(self, block: _Block, numel: int, dtype: torch.dtype) -> torch.Tensor:
        key = (dtype, numel)
        if block.view_key != key:
            block.view = block.raw.view(dtype)[:numel]
            block.view_key = key
        # `.data` makes a new tensor with its own autograd version counter, so what the new
        # owner writes never trips in-place checks on tensors the previous owner saved.
        out = block.view.data
        block.out = out
        block.poisoned = False
        self._live[id(out)] = block
        return out

    def _count_alloc(self, nbytes: int, reused: bool) -> None:
        self._num_allocs += 1
        self._live_bytes += nbytes
        if self._live_bytes > self._peak_live:
            self._peak_live = self._live_bytes
        if reused:
            self._num_reuses += 1
            return
        reserved = self._live_bytes + self._cached_bytes + self._pending_bytes
        if reserved > self._peak_reserved:
            self._peak_reserved = reserved

    # --------------------------------------------------------------------------------- free

    def free(self, tensor: torch.Tensor, *, after: object = None) -> None:
        """Give back a buffer from `allocate`; it is reused only after ``after`` completes.

        ``after``: a `torch.cuda.Event`, a `CpuEvent`, any handle with ``wait()`` and
        ``is_completed()`` (fsdp-comm's `Work`), or None (unused from now on). Freeing a
        tensor twice, or one this pool did not hand out, raises `ValueError`.
        """
        completion = DONE if after is None else completion_of(after, where="BufferPool.free")
        with self._lock:
            block = self._live.pop(id(tensor), None)
            if block is None or block.out is not tensor:
                raise self._free_error(tensor)
            self._freed.append(weakref.ref(tensor))
            block.out = None
            if completion is DONE and self._is_cuda:
                # "Done now" on the CPU is not done on the GPU: kernels using the buffer may
                # still be queued, so order reuse after the current stream's work.
                completion = _DeviceEventCompletion(
                    torch.cuda.current_stream(self.device).record_event()
                )
            self._num_frees += 1
            self._live_bytes -= block.nbytes
            self._pending_bytes += block.nbytes
            block.completion = completion
            if not (completion.done() and self._settle(block)):
                self._park(block)
            self._after_free()

    def _after_free(self) -> None:
        if self._num_pending and not self.pooling:
            self._reap_all()
        if self.max_cached_bytes is not None and self._cached_bytes > self.max_cached_bytes:
            self._trim_to(self.max_cached_bytes)

    def _free_error(self, tensor: object) -> Exception:
        if not isinstance(tensor, torch.Tensor):
            return TypeError(
                f"BufferPool.free: tensor must be a torch.Tensor, got {type(tensor).__name__}"
            )
        what = f"{tensor.dtype} tensor of {tensor.numel()} elements at {tensor.data_ptr():#x}"
        if any(ref() is tensor for ref in self._freed):
            return ValueError(
                f"BufferPool.free: tensor must be a live buffer from allocate(), but this {what} "
                "was already freed (a second free of the same buffer)"
            )
        return ValueError(
            f"BufferPool.free: tensor must be the very tensor allocate() of this pool returned; "
            f"got a {what} that this pool did not hand out (views and copies do not count)"
        )

    def _park(self, block: _Block) -> None:
        self._pending.setdefault(block.nbytes, []).append(block)
        self._num_pending += 1

    def _settle(self, block: _Block) -> bool:
        """``block``'s event has completed: make it reusable (or drop it). False if it must
        wait for a debug poison fill queued on a CUDA stream."""
        if self.debug and not block.poisoned and not self._poison(block):
            return False
        self._pending_bytes -= block.nbytes
        if not self.pooling:
            block.raw = block.view = None  # type: ignore[assignment]
            return True
        self._seq += 1
        block.seq = self._seq
        self._ready.setdefault(block.nbytes, []).append(block)
        self._cached_bytes += block.nbytes
        return True

    def _poison(self, block: _Block) -> bool:
        poison_(block.view)
        block.poisoned = True
        if not self._is_cuda:
            return True
        # The fill runs on the current stream; the block waits until the fill is done, so it
        # cannot race with a later owner on another stream.
        event = torch.cuda.current_stream(self.device).record_event()
        block.completion = _DeviceEventCompletion(event)
        return False

    def _reap(self, bucket: int) -> None:
        pending = self._pending.get(bucket)
        if not pending:
            return
        keep = []
        for block in pending:
            if not (block.completion.done() and self._settle(block)):
                keep.append(block)
        self._num_pending -= len(pending) - len(keep)
        self._pending[bucket] = keep

    def _reap_all(self) -> None:
        for bucket in list(self._pending):
            self._reap(bucket)

    # -------------------------------------------------------------------------- trim, stats

    def trim(self, target_bytes: int = 0) -> int:
        """Drop cached free buffers, oldest freed first, until at most ``target_bytes`` stay
        cached; return the bytes let go. Buffers still waiting for their event are kept.

        On CUDA the memory goes back to torch's caching allocator; call
        `torch.cuda.empty_cache` to return it to the driver.
        """
        if isinstance(target_bytes, bool) or not isinstance(target_bytes, int) or target_bytes < 0:
            raise ValueError(
                f"BufferPool.trim: target_bytes must be an int >= 0, got {target_bytes!r}"
            )
        with self._lock:
            self._reap_all()
            released = self._trim_to(target_bytes)
        if released and _log.isEnabledFor(logging.DEBUG):
            _log.debug("%s pool trimmed %d bytes: %s", self.device, released, self.stats())
        return released

    def _trim_to(self, target: int) -> int:
        if self._cached_bytes <= target:
            return 0
        released = 0
        for block in sorted(self._iter_ready(), key=lambda b: b.seq):
            if self._cached_bytes <= target:
                break
            self._ready[block.nbytes].remove(block)
            self._cached_bytes -= block.nbytes
            released += block.nbytes
            block.raw = block.view = None  # type: ignore[assignment]
        self._trimmed += released
        self._ready = {size: blocks for size, blocks in self._ready.items() if blocks}
        return released

    def _iter_ready(self) -> Iterator[_Block]:
        for blocks in self._ready.values():
            yield from blocks

    def stats(self) -> PoolStats:
        """A snapshot of this pool's bytes and counters (completed events are taken in first)."""
        with self._lock:
            self._reap_all()
            self._after_free()
            return PoolStats(
                live_bytes=self._live_bytes,
                peak_bytes=self._peak_live,
                reserved_bytes=self._live_bytes + self._cached_bytes + self._pending_bytes,
                peak_reserved_bytes=self._peak_reserved,
                cached_bytes=self._cached_bytes,
                pending_bytes=self._pending_bytes,
                num_allocs=self._num_allocs,
                num_reuses=self._num_reuses,
                num_frees=self._num_frees,
                trimmed_bytes=self._trimmed,
                num_oom_trims=self._num_oom_trims,
            )

    def reset_peak_stats(self) -> None:
        """Set the peaks to the current live and reserved bytes."""
        with self._lock:
            self._peak_live = self._live_bytes
            self._peak_reserved = self._live_bytes + self._cached_bytes + self._pending_bytes

    def __repr__(self) -> str:
        mode = "pooled" if self.pooling else "unpooled"
        return f"BufferPool(device={str(self.device)!r}, {mode}, live={len(self._live)})"


def check_bool(value: object, *, name: str, where: str = "BufferPool") -> bool:
    """``value`` if it is a bool, else `TypeError` naming ``name``."""
    if not isinstance(value, bool):
        raise TypeError(f"{where}: {name} must be True or False, got {value!r}")
    return value


def _check_cap(cap: object) -> int | None:
    if cap is None:
        return None
    if isinstance(cap, bool) or not isinstance(cap, int) or cap < 0:
        raise ValueError(f"BufferPool: max_cached_bytes must be None or an int >= 0, got {cap!r}")
    return cap
