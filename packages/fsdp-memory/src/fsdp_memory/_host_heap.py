"""The host heap: glibc's mmap threshold, and what the heap holds.

Note [host heap]
    glibc serves an allocation below its mmap threshold from the heap and a larger one with its
    own ``mmap``, which goes back to the system on free. The threshold starts at 128 KiB and
    rises, up to 32 MiB, to the size of every mmapped block that is freed: once a model's
    parameters (tensors of 4 to 16 MiB) have been built and freed, every tensor below 16 MiB
    comes from the heap, where long-lived optimizer states sit between per-step gradients and
    activations. The holes those leave stay resident. Measured on the 200 M GPT at world size
    4 (``python -m fsdp.bench.engines --model 200m``): 418 MiB free but resident in the heap at
    the end of a step, and a peak RSS of 1.90 GiB per rank that a fixed 1 MiB threshold brings to
    1.68 GiB (DDP: 4.67 GiB either way; its memory is a few large, long-lived tensors). A fixed
    threshold also stops the rise, so every tensor of at least that size is mapped on its own
    and returned whole when freed; the cost is a page fault per 4 KiB page of each new tensor,
    which made steps 10% (4 MiB) to 28% (1 MiB) slower on the 8-block GPT here.

    The cheaper remedy, and the default on CPU: ``malloc_trim`` gives the free pages of the heap
    back without changing where tensors come from. The engine reports the bytes of
    per-parameter gradients each unit's backward freed; every 64 MiB reported,
    `MemoryManager.release_host_heap` looks at the heap (``mallinfo2``, ~40 us) and trims when
    more than ``host_trim_bytes`` of it is free.

    A trim is not free: the pages it returns are mostly the activations backward has just let
    go, and the next forward faults every one of them back in (a fault and a zeroed 4 KiB page,
    about 2 us). Where the heap's holes are reused step after step, trimming buys little
    memory for that time. ``"auto"`` lets 256 MiB stand (`AUTO_HOST_TRIM_BYTES`). Measured with
    ``python -m fsdp.bench.engines --engines ours,ddp --host-trim-bytes SIZE`` (its
    faults/step column), the 200 M column with ``--model 200m --world-size 4 --global-batch 4
    --steps 3 --warmup 1 --repeats 1``, 2026-11-23:

    ==============================  ====================  ====================
    limit                           8-block GPT, world 2  200 M GPT, world 4
    ==============================  ====================  ====================
    128 MiB (the old default)       2 trims a step,       peak RSS 1701 MiB
                                    50-75 K faults/step,  (0.36x DDP)
                                    peak RSS 880-920 MiB
    256 MiB (default)               no trim after step 1, 1846 MiB (0.39x)
                                    8-16 K faults/step,
                                    940-980 MiB, step
                                    -7% (3.61 against
                                    3.88 s)
    off (``None``)                  16-21 K faults/step,  2046 MiB (0.44x)
                                    943-973 MiB
    ==============================  ====================  ====================

    DDP's 8-block peak is ~1090 MiB per rank and its faults 1-20 K a step.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import warnings
from dataclasses import dataclass

__all__ = ["HostHeapStats", "host_heap_stats", "set_host_mmap_threshold", "trim_host_heap"]

_M_MMAP_THRESHOLD = -3  # mallopt parameter (malloc.h)
_MAX_THRESHOLD = 32 * 2**20  # glibc's HEAP_MAX-derived ceiling on 64-bit systems


@dataclass(frozen=True)
class HostHeapStats:
    """glibc's ``mallinfo2``: bytes the heap spans, in use, free (but possibly resident), and
    held in separately mapped blocks."""

    heap_bytes: int
    in_use_bytes: int
    free_bytes: int
    mmapped_bytes: int


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


@functools.lru_cache(maxsize=1)
def _glibc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.gnu_get_libc_version  # noqa: B018 - present only in glibc
    except (OSError, AttributeError):
        return None
    if hasattr(libc, "mallinfo2"):
        libc.mallinfo2.restype = _MallInfo2
    return libc


def set_host_mmap_threshold(nbytes: int = 2**20) -> bool:
    """Fix glibc's mmap threshold at ``nbytes`` for this process (Note [host heap]): host
    tensors of at least that size get their own mapping and go back to the system when freed,
    instead of fragmenting the heap. Affects every allocation of the process, from then on.

    Returns True when applied; False, with a warning, where the C library is not glibc."""
    if isinstance(nbytes, bool) or not isinstance(nbytes, int):
        raise TypeError(f"nbytes must be an int, got {type(nbytes).__name__}")
    if not 0 < nbytes <= _MAX_THRESHOLD:
        raise ValueError(f"nbytes must be in 1..{_MAX_THRESHOLD} (glibc's ceiling), got {nbytes}")
    libc = _glibc()
    if libc is None:
        warnings.warn(
            "set_host_mmap_threshold: the C library is not glibc; threshold left unchanged",
            RuntimeWarning,
            stacklevel=2,
        )
        return False
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, ctypes.c_int(nbytes)))


def trim_host_heap() -> bool:
    """Give the free pages inside glibc's heap back to the system (``malloc_trim(0)``): they
    stop counting in RSS until reused. Returns True when memory was released. Takes about 1 ms
    per 100 MiB of heap; `MemoryManager.release_host_heap` calls it at a bounded rate."""
    libc = _glibc()
    return bool(libc.malloc_trim(0)) if libc is not None else False


def host_heap_stats() -> HostHeapStats | None:
    """The process's glibc heap now, or None where ``mallinfo2`` is not available."""
    libc = _glibc()
    if libc is None or not hasattr(libc, "mallinfo2"):
        return None
    info = libc.mallinfo2()
    return HostHeapStats(
        heap_bytes=info.arena,
        in_use_bytes=info.uordblks,
        free_bytes=info.fordblks,
        mmapped_bytes=info.hblkhd,
    )
