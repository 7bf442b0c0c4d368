"""`set_host_mmap_threshold` and `host_heap_stats` (Note [host heap] in fsdp_memory)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from fsdp_memory import host_heap_stats, set_host_mmap_threshold

_PROBE = """
import torch
from fsdp_memory import host_heap_stats, set_host_mmap_threshold
big = torch.ones(8 * 2**20 // 4); del big  # freed: glibc raises its threshold past 8 MiB
if {apply}:
    assert set_host_mmap_threshold(2**20)
before = host_heap_stats().mmapped_bytes
t = torch.ones(2 * 2**20 // 4)  # 2 MiB
print(host_heap_stats().mmapped_bytes - before)
"""


def _mapped_by_2mib_tensor(apply: bool) -> int:
    out = subprocess.run(
        [sys.executable, "-c", _PROBE.format(apply=apply)],
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(host_heap_stats() is None, reason="needs glibc's mallinfo2")
def test_fixed_threshold_maps_mid_size_tensors() -> None:
    assert _mapped_by_2mib_tensor(False) == 0  # from the heap: glibc's threshold had risen
    assert _mapped_by_2mib_tensor(True) >= 2 * 2**20  # its own mapping


@pytest.mark.parametrize("bad", [0, -1, 64 * 2**20])
def test_threshold_out_of_range_is_named(bad: int) -> None:
    with pytest.raises(ValueError, match=f"nbytes must be in 1..33554432.*got {bad}"):
        set_host_mmap_threshold(bad)


def test_threshold_must_be_an_int() -> None:
    with pytest.raises(TypeError, match="nbytes must be an int, got float"):
        set_host_mmap_threshold(1.5)  # type: ignore[arg-type]


@pytest.mark.skipif(host_heap_stats() is None, reason="needs glibc's mallinfo2")
def test_heap_stats_are_consistent() -> None:
    stats = host_heap_stats()
    assert stats is not None
    assert stats.in_use_bytes + stats.free_bytes == stats.heap_bytes


def test_manager_trims_when_the_heap_holds_enough_free(monkeypatch) -> None:
    import fsdp_memory._manager as manager_module
    from fsdp_memory import HostHeapStats, MemoryManager

    trims, free = [], [0]
    monkeypatch.setattr(manager_module, "trim_host_heap", lambda: trims.append(1) or True)
    monkeypatch.setattr(
        manager_module, "host_heap_stats", lambda: HostHeapStats(2**40, 0, free[0], 0)
    )
    mm = MemoryManager("cpu", host_trim_bytes=100)
    assert mm.config.host_trim_bytes == 100
    step = manager_module.HOST_CHECK_BYTES // 2
    free[0] = 500
    assert not mm.release_host_heap(step) and not trims  # not looked yet
    assert mm.release_host_heap(step) and len(trims) == 1  # looked: 500 free >= 100
    free[0] = 50
    assert not mm.release_host_heap(2 * step) and len(trims) == 1  # looked: too little free


def test_manager_trim_defaults_and_opt_out() -> None:
    from fsdp_memory import MemoryManager

    assert MemoryManager("cpu").config.host_trim_bytes == 256 * 2**20
    off = MemoryManager("cpu", host_trim_bytes=None)
    assert off.config.host_trim_bytes is None and not off.release_host_heap(2**40)


@pytest.mark.parametrize("bad", [0, -5, 1.5, True])
def test_manager_trim_bytes_is_checked(bad) -> None:
    from fsdp_memory import MemoryManager

    with pytest.raises(
        ValueError, match=f"host_trim_bytes must be None or an int >= 1, got {bad!r}"
    ):
        MemoryManager("cpu", host_trim_bytes=bad)


@pytest.mark.skipif(host_heap_stats() is None, reason="needs glibc's mallinfo2")
def test_trim_returns_free_heap_pages() -> None:
    probe = """
import torch, sys
from fsdp_memory import trim_host_heap
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
big = torch.ones(16 * 2**20 // 4); del big   # raises glibc's mmap threshold to 16 MiB
keep, drop = [], []
for i in range(64):                           # 64 x 2 MiB from the heap, interleaved
    (keep if i % 2 else drop).append(torch.ones(2**19))
drop.clear()                                  # 64 MiB of holes, still resident
before = rss()
trim_host_heap()
print(before - rss())
"""
    out = subprocess.run(
        [sys.executable, "-c", probe], check=True, capture_output=True, text=True, timeout=120
    )
    assert int(out.stdout.split()[-1]) > 32 * 2**20
