"""BufferPool on CPU: event-ordered reuse, size classes, trimming, errors, debug poisoning."""

from __future__ import annotations

import threading

import pytest
import torch
from fsdp_memory import POISON_BYTE, BufferPool, CpuEvent, MemoryManager, bucket_nbytes


def test_allocate_returns_a_flat_buffer_of_the_asked_size() -> None:
    pool = BufferPool("cpu")
    buf = pool.allocate(1000, torch.bfloat16)
    assert buf.shape == (1000,) and buf.dtype == torch.bfloat16 and buf.device.type == "cpu"
    buf.fill_(3)  # writable
    stats = pool.stats()
    assert stats.live_bytes == bucket_nbytes(2000) == stats.peak_bytes == stats.reserved_bytes
    assert (stats.num_allocs, stats.num_reuses, stats.num_fresh) == (1, 0, 1)


def test_free_without_event_makes_the_buffer_reusable_at_once() -> None:
    pool = BufferPool("cpu")
    first = pool.allocate(4096, torch.float32)
    pool.free(first)
    second = pool.allocate(4096, torch.float32)
    assert second.data_ptr() == first.data_ptr()
    assert second is not first
    assert pool.stats().num_reuses == 1


def test_buffer_is_reused_only_after_its_event_completes(late_handle) -> None:
    pool = BufferPool("cpu")
    handle = late_handle()
    first = pool.allocate(4096, torch.float32)
    pool.free(first, after=handle)
    assert pool.stats().pending_bytes == bucket_nbytes(4096 * 4)
    second = pool.allocate(4096, torch.float32)  # the all-gather still reads `first`
    assert second.data_ptr() != first.data_ptr()
    assert pool.stats().num_reuses == 0
    handle.complete()
    pool.free(second)
    third = pool.allocate(4096, torch.float32)
    fourth = pool.allocate(4096, torch.float32)
    assert {third.data_ptr(), fourth.data_ptr()} == {first.data_ptr(), second.data_ptr()}
    assert pool.stats().num_reuses == 2
    assert handle.num_waits == 0  # the pool never blocks on a handle


def test_cpu_event_tied_to_a_handle_orders_reuse_too(late_handle) -> None:
    pool = BufferPool("cpu")
    handle = late_handle()
    first = pool.allocate(100, torch.float32)
    pool.free(first, after=CpuEvent(handle))
    assert pool.allocate(100, torch.float32).data_ptr() != first.data_ptr()
    handle.complete()
    assert pool.allocate(100, torch.float32).data_ptr() == first.data_ptr()


def test_completed_events_and_handles_free_at_once(late_handle) -> None:
    pool = BufferPool("cpu")
    done = late_handle()
    done.complete()
    for after in (CpuEvent(), done, pool_event()):
        buf = pool.allocate(64, torch.int32)
        pool.free(buf, after=after)
        assert pool.stats().cached_bytes == 512


def pool_event() -> CpuEvent:
    return MemoryManager("cpu").streams.record_event("compute")


def test_equal_and_nearly_equal_sizes_share_memory_across_dtypes() -> None:
    pool = BufferPool("cpu")
    a = pool.allocate(1_000_000, torch.float32)
    pool.free(a)
    b = pool.allocate(2_000_010, torch.bfloat16)  # 4_000_020 bytes: same size class
    assert b.data_ptr() == a.data_ptr()
    assert b.numel() == 2_000_010 and b.dtype == torch.bfloat16
    pool.free(b)
    c = pool.allocate(500_000, torch.float32)  # another class: new memory
    assert c.data_ptr() != a.data_ptr()


def test_each_allocation_gets_its_own_autograd_version_counter() -> None:
    pool = BufferPool("cpu")
    first = pool.allocate(16, torch.float32)
    saved_version = first._version
    pool.free(first)
    second = pool.allocate(16, torch.float32)
    second.add_(1)
    assert first._version == saved_version


def test_second_free_of_the_same_buffer_is_a_value_error() -> None:
    pool = BufferPool("cpu")
    buf = pool.allocate(10, torch.float32)
    pool.free(buf)
    with pytest.raises(ValueError, match=r"tensor must be a live buffer .* already freed"):
        pool.free(buf)
    again = pool.allocate(10, torch.float32)  # same memory, new owner
    with pytest.raises(ValueError, match="already freed"):
        pool.free(buf)  # the stale tensor must not free the new owner's buffer
    pool.free(again)


def test_second_free_is_caught_while_the_first_free_waits_on_an_event(late_handle) -> None:
    pool = BufferPool("cpu")
    buf = pool.allocate(10, torch.float32)
    pool.free(buf, after=late_handle())
    with pytest.raises(ValueError, match="second free"):
        pool.free(buf)


def test_freeing_foreign_tensors_views_and_non_tensors_is_refused() -> None:
    pool = BufferPool("cpu")
    buf = pool.allocate(10, torch.float32)
    with pytest.raises(ValueError, match="did not hand out"):
        pool.free(torch.empty(10))
    with pytest.raises(ValueError, match="did not hand out"):
        pool.free(buf[2:])
    with pytest.raises(TypeError, match="tensor must be a torch.Tensor"):
        pool.free("buf")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="after must be"):
        pool.free(buf, after=42)
    pool.free(buf)  # the failed calls left it live


def test_trim_drops_cached_buffers_oldest_first() -> None:
    pool = BufferPool("cpu")
    bufs = [pool.allocate(1024 * (i + 1), torch.uint8) for i in range(3)]
    for buf in bufs:
        pool.free(buf)
    assert pool.stats().cached_bytes == 1024 + 2048 + 3072
    assert pool.trim(3072 + 2048) == 1024  # the oldest freed goes first
    assert pool.trim() == 2048 + 3072
    stats = pool.stats()
    assert stats.cached_bytes == 0 and stats.reserved_bytes == 0 and stats.trimmed_bytes == 6144
    with pytest.raises(ValueError, match="target_bytes must be an int >= 0, got -1"):
        pool.trim(-1)


def test_trim_keeps_buffers_whose_event_is_pending(late_handle) -> None:
    pool = BufferPool("cpu")
    handle = late_handle()
    pool.free(pool.allocate(1024, torch.uint8), after=handle)
    assert pool.trim() == 0
    assert pool.stats().pending_bytes == 1024
    handle.complete()
    assert pool.trim() == 1024


def test_cap_on_cached_bytes_is_enforced_on_free() -> None:
    pool = BufferPool("cpu", max_cached_bytes=4096)
    bufs = [pool.allocate(1024, torch.uint8) for _ in range(8)]
    for buf in bufs:
        pool.free(buf)
    stats = pool.stats()
    assert stats.cached_bytes == 4096 and stats.trimmed_bytes == 4096
    assert MemoryManager("cpu", max_cached_bytes=0).pool.max_cached_bytes == 0


def test_stats_track_live_peak_reserved_and_reset() -> None:
    pool = BufferPool("cpu")
    a, b = pool.allocate(512, torch.uint8), pool.allocate(1024, torch.uint8)
    pool.free(a)
    stats = pool.stats()
    assert (stats.live_bytes, stats.peak_bytes, stats.cached_bytes) == (1024, 1536, 512)
    assert stats.reserved_bytes == stats.peak_reserved_bytes == 1536
    assert stats.num_frees == 1
    pool.reset_peak_stats()
    assert pool.stats().peak_bytes == 1024
    pool.free(b)


def test_non_pooling_pool_takes_fresh_memory_and_lets_go_after_the_event(late_handle) -> None:
    pool = BufferPool("cpu", pooling=False)
    handle = late_handle()
    first = pool.allocate(1000, torch.float32)
    assert first.untyped_storage().nbytes() == 4000  # exactly torch.empty's size, no class
    pool.free(first, after=handle)
    assert pool.stats().reserved_bytes == 4000  # held until the event completes
    handle.complete()
    stats = pool.stats()
    assert stats.reserved_bytes == 0 and stats.cached_bytes == 0
    pool.allocate(1000, torch.float32)
    assert pool.stats().num_reuses == 0 and pool.stats().num_allocs == 2


def test_debug_mode_poisons_freed_float_buffers_with_nan() -> None:
    pool = BufferPool("cpu", debug=True)
    buf = pool.allocate(100, torch.float32)
    assert torch.isnan(buf).all()  # fresh memory too: reading before writing shows
    buf.fill_(1.0)
    pool.free(buf)
    assert torch.isnan(buf).all()  # the stale tensor now reads NaN


def test_debug_mode_poisons_integer_buffers_with_a_byte_pattern() -> None:
    pool = BufferPool("cpu", debug=True)
    buf = pool.allocate(100, torch.int32)
    buf.zero_()
    pool.free(buf)
    assert (buf.view(torch.uint8) == POISON_BYTE).all()


def test_debug_mode_poisons_only_after_the_event(late_handle) -> None:
    pool = BufferPool("cpu", debug=True)
    handle = late_handle()
    buf = pool.allocate(100, torch.float32)
    buf.fill_(2.0)
    pool.free(buf, after=handle)
    pool.stats()
    assert (buf == 2.0).all()  # the all-gather may still read it
    handle.complete()
    pool.stats()
    assert torch.isnan(buf).all()


def test_debug_mode_from_the_environment(monkeypatch) -> None:
    monkeypatch.setenv("FSDP_MEMORY_DEBUG", "1")
    mm = MemoryManager("cpu")
    assert mm.config.debug and mm.pool.debug
    buf = mm.allocate(8, torch.float64)
    mm.free(buf)
    assert torch.isnan(buf).all()
    monkeypatch.setenv("FSDP_MEMORY_DEBUG", "0")
    assert not MemoryManager("cpu").config.debug
    assert MemoryManager("cpu", debug=True).config.debug


def test_cpu_pool_refuses_cuda_streams_and_pinning_without_cuda() -> None:
    pool = BufferPool("cpu")
    with pytest.raises(TypeError, match="stream must be None or a CpuStream"):
        pool.allocate(4, torch.float32, stream="compute")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="pin_memory=True needs CUDA"):
            BufferPool("cpu", pin_memory=True)


def test_frees_from_background_threads_keep_the_pool_consistent() -> None:
    pool = BufferPool("cpu")
    errors: list[BaseException] = []

    def churn() -> None:
        try:
            for i in range(300):
                buf = pool.allocate(256 + (i % 4) * 512, torch.float32)
                buf.fill_(i)
                pool.free(buf)
        except BaseException as exc:  # collected for the main thread
            errors.append(exc)

    threads = [threading.Thread(target=churn) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=20)
    assert not errors and not any(t.is_alive() for t in threads)
    stats = pool.stats()
    assert stats.live_bytes == 0 and stats.num_allocs == stats.num_frees == 1200
    assert stats.reserved_bytes == stats.cached_bytes <= 4 * 4 * bucket_nbytes(4 * 1792)
