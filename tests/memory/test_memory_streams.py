"""StreamPool, CpuStream and CpuEvent on CPU: the same interface as CUDA, events done at once
or tied to an asynchronous handle."""

from __future__ import annotations

import time

import pytest
import torch
from fsdp_memory import (
    CompletionHandle,
    CpuEvent,
    CpuStream,
    MemoryManager,
    MemoryTimeoutError,
    StreamPool,
    StreamRole,
)

ROLES = ("compute", "all_gather", "reduce_scatter", "host_to_device", "device_to_host")


def test_cpu_pool_has_a_stream_per_role_reachable_by_attribute_and_name() -> None:
    pool = StreamPool("cpu")
    assert [role.value for role, _ in pool.items()] == list(ROLES)
    for role in ROLES:
        stream = getattr(pool, role)
        assert isinstance(stream, CpuStream)
        assert pool[role] is stream and pool[StreamRole(role)] is stream
        assert stream.role.value == role
    assert pool.current() is pool.compute
    with pytest.raises(ValueError, match="unknown stream role 'bogus'"):
        pool["bogus"]


def test_manager_exposes_the_stream_pool() -> None:
    mm = MemoryManager("cpu")
    assert isinstance(mm.streams, StreamPool)
    assert mm.streams.all_gather is mm.streams["all_gather"]


def test_cpu_stream_methods_mirror_cuda_streams() -> None:
    pool = StreamPool("cpu")
    ag = pool.all_gather
    event = ag.record_event()
    assert isinstance(event, CpuEvent) and event.query() and event.is_completed()
    ag.wait_stream(pool.compute)
    pool.compute.wait_event(event)
    assert ag.query()
    ag.synchronize()
    pool.synchronize()
    with pool.use("all_gather") as current:
        assert current is ag
    assert isinstance(pool.record_event("reduce_scatter"), CpuEvent)


def test_cpu_event_tied_to_a_handle_completes_with_it(late_handle, complete_later) -> None:
    handle = late_handle()
    event = CpuEvent(handle)
    assert not event.query() and not event.is_completed()
    assert isinstance(event, CompletionHandle)
    complete_later(handle, 0.05)
    event.wait(timeout=5)
    assert event.query()
    event.record()
    assert event.handle is None and event.query()


def test_cpu_stream_wait_event_blocks_until_the_handle_completes(
    late_handle, complete_later
) -> None:
    handle = late_handle()
    complete_later(handle, 0.05)
    start = time.monotonic()
    StreamPool("cpu").compute.wait_event(CpuEvent(handle))
    assert handle.is_completed()
    assert time.monotonic() - start >= 0.04


def test_waits_on_a_handle_that_never_completes_time_out(late_handle, monkeypatch) -> None:
    handle = late_handle()
    with pytest.raises(MemoryTimeoutError, match="not completed after 0.05 s"):
        CpuEvent(handle).wait(timeout=0.05)
    with pytest.raises(MemoryTimeoutError, match="not complete after 0.05 s"):
        StreamPool("cpu").wait(handle, timeout=0.05)
    monkeypatch.setenv("FSDP_MEMORY_TIMEOUT", "0.05")
    with pytest.raises(MemoryTimeoutError):
        StreamPool("cpu").all_gather.wait_event(handle)
    assert issubclass(MemoryTimeoutError, TimeoutError)


def test_stream_pool_wait_polls_handles_whose_wait_has_no_timeout(
    poll_only_handle, complete_later
) -> None:
    handle = poll_only_handle()
    complete_later(handle, 0.05)
    StreamPool("cpu").wait(handle, stream="compute", timeout=5)
    assert handle.is_completed()


def test_stream_pool_wait_accepts_none_and_done_events() -> None:
    pool = StreamPool("cpu")
    pool.wait(None)
    pool.wait(CpuEvent())


def test_bad_after_objects_are_type_errors() -> None:
    with pytest.raises(TypeError, match="after must be a torch.cuda.Event, a CpuEvent"):
        StreamPool("cpu").wait(object())
    with pytest.raises(TypeError, match="wait\\(\\) and is_completed\\(\\)"):
        CpuEvent(object())  # type: ignore[arg-type]


def test_bad_timeout_setting_is_a_value_error(monkeypatch, late_handle) -> None:
    monkeypatch.setenv("FSDP_MEMORY_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="FSDP_MEMORY_TIMEOUT must be a number"):
        CpuEvent(late_handle()).wait()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_cuda_stream_pool_is_refused_without_cuda() -> None:
    with pytest.raises(ValueError, match="CUDA is not available"):
        StreamPool("cuda")
