"""RateLimiter: count and byte bounds, releases after events, waits counted, never a hang."""

from __future__ import annotations

import threading
import time

import pytest
from fsdp_memory import CpuEvent, MemoryManager, RateLimiter, RateLimitTimeoutError

MIB = 2**20


def test_count_bound_blocks_the_third_acquire_until_a_release() -> None:
    limiter = RateLimiter(max_count=2, timeout=5)
    first, _second = limiter.acquire(MIB), limiter.acquire(MIB)
    threading.Timer(0.05, first.release).start()
    start = time.monotonic()
    limiter.acquire(MIB)
    assert time.monotonic() - start >= 0.04
    stats = limiter.stats()
    assert stats.num_waits == 1 and stats.wait_s >= 0.04
    assert stats.inflight == 2 and stats.peak_inflight == 2 and stats.num_acquires == 3


def test_count_bound_times_out_naming_the_bound() -> None:
    limiter = RateLimiter(max_count=2)
    limiter.acquire(MIB)
    limiter.acquire(MIB)
    with pytest.raises(
        RateLimitTimeoutError, match=r"max_count=2 \(2 all-gathers in flight\)"
    ) as info:
        limiter.acquire(MIB, timeout=0.05)
    assert info.value.bounds == ("max_count",) and info.value.nbytes == MIB
    assert isinstance(info.value, TimeoutError)
    assert "2 ticket(s) not released yet" in str(info.value)
    assert limiter.stats().num_waits == 1


def test_byte_bound_admits_while_the_sum_fits() -> None:
    limiter = RateLimiter(max_count=None, max_bytes=3 * MIB)
    limiter.acquire(MIB)
    limiter.acquire(2 * MIB)
    with pytest.raises(RateLimitTimeoutError, match="max_bytes=3145728") as info:
        limiter.acquire(1, timeout=0.05)
    assert info.value.bounds == ("max_bytes",)
    assert limiter.stats().peak_inflight_bytes == 3 * MIB


def test_a_request_larger_than_the_byte_bound_runs_alone() -> None:
    limiter = RateLimiter(max_count=4, max_bytes=MIB)
    big = limiter.acquire(10 * MIB)  # nothing in flight: admitted, or it would never run
    with pytest.raises(RateLimitTimeoutError):
        limiter.acquire(1, timeout=0.05)
    big.release()
    limiter.acquire(MIB)


def test_both_bounds_apply_together() -> None:
    limiter = RateLimiter(max_count=3, max_bytes=10 * MIB)
    limiter.acquire(MIB)
    limiter.acquire(MIB)
    limiter.acquire(MIB)
    with pytest.raises(RateLimitTimeoutError) as info:
        limiter.acquire(9 * MIB, timeout=0.05)
    assert info.value.bounds == ("max_count", "max_bytes")


def test_release_after_an_event_counts_until_the_event_completes(
    late_handle, complete_later
) -> None:
    limiter = RateLimiter(max_count=1, timeout=5)
    handle = late_handle()
    ticket = limiter.acquire(MIB)
    ticket.release(after=handle)
    assert ticket.released and limiter.stats().inflight == 1
    complete_later(handle, 0.05)
    limiter.acquire(MIB)  # blocks on the handle's wait(timeout=...), then goes on
    assert handle.is_completed() and handle.num_waits >= 1
    assert limiter.stats().num_waits == 1


def test_release_after_a_poll_only_handle_is_polled(poll_only_handle, complete_later) -> None:
    limiter = RateLimiter(max_count=1, timeout=5)
    handle = poll_only_handle()
    limiter.acquire(MIB).release(after=CpuEvent(handle))
    complete_later(handle, 0.05)
    limiter.acquire(MIB)


def test_release_after_a_handle_that_never_completes_times_out(late_handle) -> None:
    limiter = RateLimiter(max_count=1)
    limiter.acquire(MIB).release(after=late_handle())
    with pytest.raises(RateLimitTimeoutError, match="1 released ticket\\(s\\) waiting on an event"):
        limiter.acquire(MIB, timeout=0.1)


def test_the_environment_timeout_applies_by_default(monkeypatch) -> None:
    monkeypatch.setenv("FSDP_MEMORY_TIMEOUT", "0.05")
    limiter = RateLimiter(max_count=1)
    limiter.acquire(1)
    with pytest.raises(RateLimitTimeoutError, match="after 0.05 s"):
        limiter.acquire(1)


def test_acquire_wakes_when_another_thread_releases() -> None:
    limiter = RateLimiter(max_count=1, timeout=5)
    ticket = limiter.acquire(MIB)
    got = threading.Event()

    def second() -> None:
        limiter.acquire(MIB).release()
        got.set()

    thread = threading.Thread(target=second)
    thread.start()
    time.sleep(0.02)
    assert not got.is_set()
    ticket.release()
    thread.join(timeout=5)
    assert got.is_set() and not thread.is_alive()


def test_release_with_a_pending_event_wakes_an_acquire_blocked_in_another_thread(
    poll_only_handle, complete_later
) -> None:
    # B blocks while A's ticket is held (nothing pending to wait on); A then releases after an
    # event that completes 50 ms later. B must notice the pending release at once, not sleep
    # on the condition until its timeout (2 s here, 300 s by default).
    limiter = RateLimiter(max_count=1, timeout=2)
    ticket = limiter.acquire(MIB)
    waited: list[float] = []

    def second() -> None:
        start = time.monotonic()
        limiter.acquire(MIB).release()
        waited.append(time.monotonic() - start)

    thread = threading.Thread(target=second, daemon=True)
    thread.start()
    time.sleep(0.1)  # let B reach the blocking wait
    assert thread.is_alive()
    handle = poll_only_handle()
    ticket.release(after=CpuEvent(handle))
    complete_later(handle, 0.05)
    thread.join(timeout=5)
    assert not thread.is_alive() and len(waited) == 1
    assert waited[0] < 0.1 + 0.6, f"acquire waited {waited[0]:.2f} s for a 50 ms event"


def test_unlimited_limiter_never_blocks_but_counts() -> None:
    limiter = RateLimiter.unlimited()
    assert limiter.is_unlimited
    tickets = [limiter.acquire(MIB) for _ in range(50)]
    stats = limiter.stats()
    assert stats.inflight == stats.peak_inflight == 50 and stats.num_waits == 0
    for ticket in tickets:
        ticket.release()
    assert limiter.stats().inflight_bytes == 0
    assert MemoryManager("cpu", max_inflight_all_gathers=None).limiter.is_unlimited


def test_second_release_and_bad_sizes_are_value_errors() -> None:
    limiter = RateLimiter()
    ticket = limiter.acquire(10)
    ticket.release()
    with pytest.raises(ValueError, match="released once"):
        ticket.release()
    with pytest.raises(ValueError, match=r"nbytes must be a positive integer \(> 0\), got 0"):
        limiter.acquire(0)
    with pytest.raises(ValueError, match="got -3"):
        limiter.acquire(-3)
    with pytest.raises(TypeError, match="nbytes must be an int"):
        limiter.acquire(1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_count must be None or an int >= 1, got 0"):
        RateLimiter(max_count=0)
    with pytest.raises(TypeError, match="after must be"):
        limiter.acquire(1).release(after="done")


def test_ticket_as_context_manager_releases_on_exit() -> None:
    limiter = RateLimiter(max_count=1)
    with limiter.acquire(MIB) as ticket:
        assert limiter.stats().inflight == 1
    assert ticket.released and limiter.stats().inflight == 0


def test_manager_limiter_uses_the_manager_bounds() -> None:
    mm = MemoryManager("cpu", max_inflight_all_gathers=3, max_inflight_bytes=8 * MIB, timeout=1)
    assert (mm.limiter.max_count, mm.limiter.max_bytes, mm.limiter.timeout) == (3, 8 * MIB, 1.0)
    tickets = [mm.limiter.acquire(MIB) for _ in range(3)]
    with pytest.raises(RateLimitTimeoutError):
        mm.limiter.acquire(MIB, timeout=0.02)
    tickets[0].release()
    mm.limiter.acquire(MIB)
    stats = mm.stats()
    assert stats.num_limiter_waits == 1 and stats.limiter_wait_s > 0
