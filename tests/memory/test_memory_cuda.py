"""CUDA paths: real streams and events, reuse ordered by events (no record_stream), allocation
on the producer stream, pinned copies, poisoning, and ``num_alloc_retries`` kept at 0 by the
limiter. Skipped cleanly without a GPU."""

from __future__ import annotations

import pytest
import torch
from fsdp_memory import BufferPool, MemoryManager, StreamPool

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

MIB = 2**20


def _cycles_per_ms() -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1_000_000)  # warm up
    start.record()
    torch.cuda._sleep(1_000_000)
    end.record()
    end.synchronize()
    return 1_000_000 / max(start.elapsed_time(end), 1e-3)


@pytest.fixture(scope="module")
def cycles_per_ms() -> float:
    return _cycles_per_ms()


def test_streams_by_role_are_real_cuda_streams() -> None:
    pool = StreamPool("cuda")
    streams = [stream for _, stream in pool.items()]
    assert all(isinstance(s, torch.cuda.Stream) for s in streams)
    assert len({s.cuda_stream for s in streams}) == 5
    assert pool.compute == torch.cuda.current_stream()
    event = pool.record_event("all_gather")
    assert isinstance(event, torch.cuda.Event)
    with pool.use("reduce_scatter") as stream:
        assert torch.cuda.current_stream() == stream == pool.reduce_scatter


def test_fresh_buffers_are_allocated_on_the_producer_stream() -> None:
    mm = MemoryManager("cuda")
    ag = mm.streams.all_gather
    buf = mm.allocate(8 * MIB, torch.float32, stream=ag)
    ptr = buf.data_ptr()
    segments = torch.cuda.memory_snapshot()
    owner = [s for s in segments if s["address"] <= ptr < s["address"] + s["total_size"]]
    assert owner and owner[0]["stream"] == ag.cuda_stream
    mm.free(buf)


def test_reuse_while_the_consumer_runs_is_ordered_by_its_event(cycles_per_ms: float) -> None:
    mm = MemoryManager("cuda")
    ag, compute = mm.streams.all_gather, mm.streams.compute
    n = 4 * MIB
    buf = mm.allocate(n, torch.float32, stream=ag)
    with torch.cuda.stream(ag):
        buf.fill_(1.0)
    compute.wait_stream(ag)
    with torch.cuda.stream(compute):
        torch.cuda._sleep(int(50 * cycles_per_ms))  # the consumer is still busy ...
        total = buf.sum()
    done = mm.streams.record_event(compute)
    mm.free(buf, after=done)
    assert not done.query()
    again = mm.allocate(n, torch.float32, stream=ag)  # ... when the next producer reuses it
    assert again.data_ptr() == buf.data_ptr() and mm.stats().num_reuses == 1
    with torch.cuda.stream(ag):
        again.fill_(2.0)
    torch.cuda.synchronize()
    assert total.item() == n  # the consumer read 1.0s: the write waited for its event


def test_buffer_freed_after_a_late_handle_is_not_reused_before_it_completes(late_handle) -> None:
    pool = BufferPool("cuda")
    handle = late_handle()
    first = pool.allocate(MIB, torch.float32)
    pool.free(first, after=handle)
    assert pool.allocate(MIB, torch.float32).data_ptr() != first.data_ptr()
    handle.complete()
    assert pool.allocate(MIB, torch.float32).data_ptr() == first.data_ptr()


def test_free_without_event_records_one_on_the_current_stream(cycles_per_ms: float) -> None:
    pool = BufferPool("cuda")
    buf = pool.allocate(MIB, torch.float32)
    torch.cuda._sleep(int(20 * cycles_per_ms))
    pool.free(buf)
    assert pool.stats().pending_bytes > 0  # the stream has not reached the free yet
    torch.cuda.synchronize()
    assert pool.stats().cached_bytes == 4 * MIB


def test_limiter_blocks_on_cuda_events(cycles_per_ms: float) -> None:
    mm = MemoryManager("cuda", max_inflight_all_gathers=1, timeout=30)
    torch.cuda._sleep(int(30 * cycles_per_ms))
    mm.limiter.acquire(MIB).release(after=mm.streams.record_event())
    mm.limiter.acquire(MIB)
    stats = mm.stats()
    assert stats.num_limiter_waits == 1 and stats.limiter_wait_s > 0.005


def test_pinned_host_buffers_and_copies_on_the_copy_streams() -> None:
    mm = MemoryManager("cuda")
    host = mm.allocate_host(MIB, torch.float32)
    assert host.is_pinned() and mm.config.pin_host_memory
    host.copy_(torch.arange(MIB, dtype=torch.float32))
    up = mm.copy_to_device(host)
    assert isinstance(up.done, torch.cuda.Event) and up.tensor.is_cuda
    mm.streams.wait(up.done)
    doubled = up.tensor * 2  # kept alive until the device-to-host copy has read it
    down = mm.copy_to_host(doubled)
    down.done.synchronize()
    assert torch.equal(down.tensor, host * 2)
    mm.free_host(host, after=up.done)
    mm.free(up.tensor, after=down.done)
    mm.free_host(down.tensor)
    torch.cuda.synchronize()
    assert mm.stats().host.live_bytes == 0


def test_debug_mode_poisons_freed_cuda_buffers() -> None:
    mm = MemoryManager("cuda", debug=True)
    buf = mm.allocate(1024, torch.float32)
    assert torch.isnan(buf).all()
    buf.fill_(1.0)
    mm.free(buf)
    torch.cuda.synchronize()
    mm.stats()  # takes in the completed free: the poison fill is queued
    torch.cuda.synchronize()
    mm.stats()
    assert torch.isnan(buf).all()


def _run_units(mm: MemoryManager, *, units: int, numel: int, cycles_per_ms: float) -> None:
    """FSDP-like forward: gather (a fill) on the all-gather stream, compute (a spin) on compute.

    The first unit's compute is long, so without a limiter the CPU issues every gather before
    any compute ends (the run-ahead of the paper's Section 3.4).
    """
    ag, compute = mm.streams.all_gather, mm.streams.compute
    for index in range(units):
        ticket = mm.limiter.acquire(numel * 4, timeout=60)
        buf = mm.allocate(numel, torch.float32, stream=ag)
        with torch.cuda.stream(ag):
            buf.fill_(1.0)
        compute.wait_stream(ag)
        with torch.cuda.stream(compute):
            torch.cuda._sleep(int((200 if index == 0 else 5) * cycles_per_ms))
            buf.sum()
        done = mm.streams.record_event(compute)
        mm.free(buf, after=done)
        ticket.release(after=done)
    torch.cuda.synchronize()
    mm.trim()  # everything freed goes back to torch's caching allocator


def _retries(mm: MemoryManager, cycles_per_ms: float) -> int:
    """Alloc retries of one step: 24 units of 64 MiB, then 1 GiB of other tensors, under a cap
    of 2 GiB above what the process held before."""
    device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(device).total_memory
    cap = torch.cuda.memory_reserved(device) + 2048 * MIB
    torch.cuda.set_per_process_memory_fraction(cap / total, device)
    try:
        before = mm.stats().num_alloc_retries
        _run_units(mm, units=24, numel=16 * MIB, cycles_per_ms=cycles_per_ms)
        # The rest of the step (activations, gradients) on the compute stream: the gathers'
        # cached blocks belong to another stream, so without headroom the allocator must free
        # its cache and retry.
        other = torch.empty(256 * MIB, dtype=torch.float32, device=device)
        del other
        return mm.stats().num_alloc_retries - before
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def test_limiter_keeps_alloc_retries_at_zero_where_run_ahead_retries(cycles_per_ms: float) -> None:
    """Without pooling, run-ahead reserves every gather at once and makes torch's allocator
    free its cache and retry; the limiter keeps two gathers and no retries."""
    unlimited = MemoryManager("cuda", max_inflight_all_gathers=None, pooling=False, timeout=60)
    limited = MemoryManager("cuda", max_inflight_all_gathers=2, pooling=False, timeout=60)
    assert _retries(unlimited, cycles_per_ms) > 0
    assert _retries(limited, cycles_per_ms) == 0
    assert unlimited.stats().peak_reserved_bytes >= 20 * 64 * MIB
    assert limited.stats().peak_reserved_bytes <= 3 * 64 * MIB


def test_pool_reuse_bounds_run_ahead_by_itself(cycles_per_ms: float) -> None:
    """With pooling, a freed buffer whose event is pending is handed to the next gather with
    its stream made to wait on that event, so even unlimited run-ahead reuses one buffer: on an
    H100 (2026-11-23) 24 gathers in flight reserved 64 MiB, and no retries."""
    for limit in (None, 2):
        mm = MemoryManager("cuda", max_inflight_all_gathers=limit, pooling=True, timeout=60)
        assert _retries(mm, cycles_per_ms) == 0
        assert mm.stats().peak_reserved_bytes <= 3 * 64 * MIB, mm.stats()
