"""MemoryManager on CPU: the surface the engine uses, host buffers and copies, stats, the
simulated 24-unit schedule, and the package's import rules."""

from __future__ import annotations

import ast
import dataclasses
import pathlib

import fsdp_memory
import pytest
import torch
from fsdp_memory import (
    CpuEvent,
    MemoryConfig,
    MemoryManager,
    MemoryStats,
    Transfer,
    simulate_schedule,
)

SRC = pathlib.Path(fsdp_memory.__file__).parent


def test_manager_defaults_match_the_design() -> None:
    mm = MemoryManager("cpu")
    assert mm.config == MemoryConfig(
        device=torch.device("cpu"),
        pin_host_memory=torch.cuda.is_available(),
        host_trim_bytes=256 * 2**20,
    )
    assert (mm.limiter.max_count, mm.limiter.max_bytes) == (2, None)
    assert mm.pool.pooling and mm.device == torch.device("cpu")
    with pytest.raises(dataclasses.FrozenInstanceError):
        mm.config.pooling = False  # type: ignore[misc]
    assert "max_inflight_all_gathers=2" in repr(mm)


def test_allocate_on_a_role_stream_and_free_after_an_event(late_handle) -> None:
    mm = MemoryManager("cpu")
    handle = late_handle()
    buf = mm.allocate(1024, torch.float32, stream=mm.streams.all_gather)
    same_role = mm.allocate(1024, torch.float32, stream="all_gather")
    mm.free(buf, after=handle)
    mm.free(same_role, after=mm.streams.record_event("compute"))
    stats = mm.stats()
    assert (
        stats.live_bytes == 0 and stats.device.pending_bytes == 4096 and stats.cached_bytes == 4096
    )


def test_stats_is_a_frozen_snapshot_with_the_design_fields() -> None:
    mm = MemoryManager("cpu")
    mm.free(mm.allocate(256, torch.float32))
    mm.free(mm.allocate(256, torch.float32))
    stats = mm.stats()
    assert isinstance(stats, MemoryStats)
    for name in (
        "live_bytes",
        "peak_bytes",
        "reserved_bytes",
        "num_allocs",
        "num_reuses",
        "num_limiter_waits",
        "limiter_wait_s",
        "num_alloc_retries",
    ):
        assert hasattr(stats, name)
    assert (stats.num_allocs, stats.num_reuses, stats.num_alloc_retries) == (2, 1, 0)
    assert (stats.peak_bytes, stats.reserved_bytes) == (1024, 1024)
    with pytest.raises(dataclasses.FrozenInstanceError):
        stats.live_bytes = 1  # type: ignore[misc]


def test_non_pooling_manager_is_the_ablation_baseline() -> None:
    mm = MemoryManager("cpu", pooling=False)
    for _ in range(3):
        mm.free(mm.allocate(1000, torch.float32))
    stats = mm.stats()
    assert (stats.num_allocs, stats.num_reuses, stats.reserved_bytes) == (3, 0, 0)


def test_host_buffers_and_copies_on_cpu() -> None:
    mm = MemoryManager("cpu")
    host = mm.allocate_host(12, torch.float32)
    assert host.is_pinned() == torch.cuda.is_available()
    host.copy_(torch.arange(12.0))
    to_dev = mm.copy_to_device(host.view(3, 4))
    assert isinstance(to_dev, Transfer) and isinstance(to_dev.done, CpuEvent)
    assert to_dev.done.query() and torch.equal(to_dev.tensor, torch.arange(12.0))
    back = mm.copy_to_host(to_dev.tensor)
    assert torch.equal(back.tensor, host)
    mm.free(to_dev.tensor, after=to_dev.done)
    mm.free_host(host, after=back.done)
    mm.free_host(back.tensor)
    stats = mm.stats()
    assert stats.host.num_allocs == 2 and stats.host.live_bytes == 0 and stats.num_allocs == 1
    assert mm.trim() == stats.host.cached_bytes + stats.cached_bytes


def test_copies_into_given_buffers_check_sizes() -> None:
    mm = MemoryManager("cpu")
    out = mm.allocate(4, torch.float32)
    assert mm.copy_to_device(torch.ones(4), out=out).tensor is out
    with pytest.raises(ValueError, match=r"out must have as many elements as src \(5\), got 4"):
        mm.copy_to_device(torch.ones(5), out=out)


def test_a_24_unit_step_holds_two_units_in_flight_with_the_limiter() -> None:
    limited = simulate_schedule(MemoryManager("cpu"), unit_numel=256)
    unlimited = simulate_schedule(
        MemoryManager("cpu", max_inflight_all_gathers=None), unit_numel=256
    )
    # Without a limit the CPU issues all 48 gathers (and 24 gradients) before anything ends.
    assert unlimited.peak_reserved_bytes == 72 * unlimited.unit_bytes
    assert unlimited.num_fresh == 72 and unlimited.num_limiter_waits == 0
    assert limited.peak_reserved_bytes <= 6 * limited.unit_bytes
    assert limited.num_fresh <= 6 and limited.num_limiter_waits > 0
    assert limited.step_time == unlimited.step_time  # two in flight keep comm overlapped


def test_pooling_turns_fresh_allocations_into_reuses_in_the_schedule() -> None:
    pooled = simulate_schedule(MemoryManager("cpu"), unit_numel=256)
    unpooled = simulate_schedule(MemoryManager("cpu", pooling=False), unit_numel=256)
    assert unpooled.num_fresh == 72 and unpooled.num_reuses == 0
    assert pooled.num_reuses == 72 - pooled.num_fresh >= 60


def test_a_tight_limit_serialises_communication_and_compute() -> None:
    one = simulate_schedule(MemoryManager("cpu", max_inflight_all_gathers=1), unit_numel=256)
    two = simulate_schedule(MemoryManager("cpu"), unit_numel=256)
    assert one.step_time > 1.5 * two.step_time * 0.99


def test_fsdp_comm_work_handles_are_accepted_as_events() -> None:
    comm = pytest.importorskip("fsdp_comm")
    mm = MemoryManager("cpu", max_inflight_all_gathers=1, timeout=5)
    work = comm.CompletedWork()
    buf = mm.allocate(8, torch.float32)
    mm.free(buf, after=work)
    mm.limiter.acquire(8).release(after=work)
    mm.streams.wait(work)
    assert mm.stats().cached_bytes == 512 and mm.limiter.stats().inflight == 0


def _gather_twice(backend, numel: int) -> tuple[int, int, bool]:
    """One rank: two async all-gathers through a manager, the second reusing the first's buffer."""
    mm = MemoryManager("cpu", timeout=10)
    ptrs = []
    for step in range(2):
        ticket = mm.limiter.acquire(numel * 4 * backend.world_size)
        out = mm.allocate(numel * backend.world_size, torch.float32, stream="all_gather")
        shard = torch.full((numel,), float(backend.rank + step))
        work = backend.all_gather_into_tensor(out, shard, async_op=True)
        mm.streams.wait(work, stream="compute", timeout=10)
        ok = torch.equal(out.view(backend.world_size, numel)[:, 0], torch.arange(2.0) + step)
        ptrs.append(out.data_ptr())
        mm.free(out, after=work)
        ticket.release(after=work)
    return mm.stats().num_reuses, mm.stats().num_allocs, ok and ptrs[0] == ptrs[1]


def test_async_all_gathers_of_the_threads_backend_drive_the_pool() -> None:
    comm = pytest.importorskip("fsdp_comm")
    results = comm.launch(_gather_twice, 2, backend="threads", args=(64,), timeout=30)
    assert results == [(1, 2, True), (1, 2, True)]


def _imports(path: pathlib.Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_the_package_imports_only_torch_and_the_standard_library() -> None:
    import sys

    used = set().union(*(_imports(p) for p in SRC.glob("*.py")))
    third_party = {name for name in used if name not in sys.stdlib_module_names}
    assert third_party == {"torch"}


def test_no_record_stream_anywhere_in_the_package() -> None:
    for path in SRC.glob("*.py"):
        code = "".join(
            line
            for line in path.read_text().splitlines(keepends=True)
            if not line.lstrip().startswith("#")
        )
        tree = ast.parse(code)
        calls = [
            n for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr == "record_stream"
        ]
        assert not calls, f"{path.name} calls record_stream"


def test_public_names_are_exported() -> None:
    for name in (
        "MemoryManager",
        "StreamPool",
        "BufferPool",
        "RateLimiter",
        "MemoryStats",
        "CompletionHandle",
        "CpuEvent",
        "CpuStream",
        "Ticket",
    ):
        assert name in fsdp_memory.__all__ and hasattr(fsdp_memory, name)
    assert (SRC / "py.typed").exists()
