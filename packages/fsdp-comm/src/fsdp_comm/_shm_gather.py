"""All-gather through shared memory for gloo ranks on one host.

Note [shared-memory all-gather]
    gloo moves data between ranks of one host over TCP loopback, which here tops out near
    2 GB/s; memory copies run at ~11 GB/s. For ranks that share a host, each rank copies its
    input into its slot of one file in /dev/shm, a one-element all-reduce makes sure every slot
    is written, each rank copies the whole segment into its output, and a second all-reduce
    makes sure nobody overwrites a slot another rank still reads. Measured at 16 MiB: 5.5 ms
    against gloo's 21 ms (world size 2) and 14 ms against 33 ms (world size 4), where the
    pairwise exchange gave 1.4x and 1.6x. The segment grows to the largest all-gather seen
    (rounded up to a power of two) and is unlinked as soon as every rank has mapped it, so a
    killed rank leaves no file behind. Every rank maps and reads the whole segment, so its pages
    count in each rank's resident memory: the torch backend sends only gathers up to 32 MiB
    this way (a 200 M-parameter model's 67 MB root unit through a 128 MiB segment added
    ~170 MiB to each rank's peak RSS) and larger ones through the pairwise exchange.
"""

from __future__ import annotations

import os
import socket
import uuid
import zlib
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["SharedMemoryGather", "ranks_share_host"]

_SHM_DIR = "/dev/shm"
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _host_key() -> int:
    boot = ""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        pass
    return zlib.crc32(f"{socket.gethostname()}|{boot}".encode())


def ranks_share_host(group: Any, world_size: int) -> bool:
    """Collective: True when every rank of ``group`` runs on this host and /dev/shm exists."""
    mine = torch.tensor([_host_key() if os.path.isdir(_SHM_DIR) else -1], dtype=torch.int64)
    every = torch.empty(world_size, dtype=torch.int64)
    _ALL_GATHER(every, mine, group=group)
    return bool((every == every[0]).all()) and int(every[0]) >= 0


class SharedMemoryGather:
    """All-gather for the ranks of one gloo group on one host (Note [shared-memory all-gather])."""

    def __init__(self, group: Any, rank: int, world_size: int) -> None:
        self._group = group
        self._rank = rank
        self._world_size = world_size
        self._prefix: str | None = None
        self._generation = 0
        self._segment: torch.Tensor | None = None
        self._flag = torch.zeros(1)

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        """Collective: ``out`` gets every rank's ``inp`` in rank order."""
        nbytes = out.numel() * out.element_size()
        segment = self._ensure(nbytes)[:nbytes].view(out.dtype)
        n = inp.numel()
        segment[self._rank * n:(self._rank + 1) * n].copy_(inp)
        self._barrier()  # every slot written
        out.copy_(segment)
        self._barrier()  # every rank done reading before any slot is written again

    def _barrier(self) -> None:
        dist.all_reduce(self._flag, group=self._group)

    def _ensure(self, nbytes: int) -> torch.Tensor:
        if self._segment is not None and self._segment.numel() >= nbytes:
            return self._segment
        if self._prefix is None:
            self._prefix = self._agree_on_prefix()
        capacity = 1 << max(20, (nbytes - 1).bit_length())
        self._generation += 1
        path = os.path.join(_SHM_DIR, f"{self._prefix}-{self._generation}")
        self._segment = None  # drop the old mapping first
        self._segment = torch.from_file(path, shared=True, size=capacity, dtype=torch.uint8)
        self._barrier()  # every rank has mapped it: the name is no longer needed
        if self._rank == 0:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        return self._segment

    def _agree_on_prefix(self) -> str:
        """A file name prefix unique to this group, chosen by its first rank."""
        name = torch.zeros(32, dtype=torch.uint8)
        if self._rank == 0:
            text = f"fsdp-comm-{uuid.uuid4().hex[:20]}".encode()
            name[:len(text)] = torch.tensor(list(text), dtype=torch.uint8)
        root = dist.get_global_rank(self._group, 0) if self._group is not None else 0
        dist.broadcast(name, src=root, group=self._group)
        return bytes(name[name != 0].tolist()).decode()
