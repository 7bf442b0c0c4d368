"""Asynchronous all-gather and reduce-scatter through shared memory, for gloo ranks of one host.

Note [shared-memory collectives without gloo]
    The first shared-memory all-gather (Note [shared-memory all-gather] in ``_shm_gather.py``)
    fenced every call with two one-element gloo all-reduces and ran synchronously. On a busy
    machine each such fence is a point where the caller blocks until every peer has been
    scheduled (a gloo round trip wakes a worker thread on every rank): a GPT training step of
    8 blocks paid 32 of them in the main thread, and a prefetched gather gained nothing from
    being issued early. Here ranks signal each other through a small shared array of sequence
    numbers instead, and the reduce-scatter, which went over gloo's TCP loopback (pairwise
    exchange, ~2 GB/s against ~11 GB/s for memory copies), takes the same path:

    - each channel (all-gather, reduce-scatter) numbers its calls 1, 2, ... in issue order
      (identical on every rank: collectives are issued in one order everywhere) and owns one
      segment split in two halves; call ``k`` uses half ``k % 2``;
    - issuing call ``k`` copies this rank's input into its slot of the half and stores ``k``
      in ``written[rank]``; it first waits until every rank's ``read`` is at least ``k - 2``
      (nobody still reads the half's previous contents: two halves mean that wait is almost
      always already over, where one half would wait for the slowest peer after every call);
    - ``wait()`` waits until every rank's ``written`` is at least ``k``, then copies the
      whole half out (all-gather) or reduces this rank's chunk of every slot in rank order,
      with the pre-multiplication fused into the sum (reduce-scatter: bitwise the result of
      the pairwise exchange), and stores ``k`` in ``read[rank]``. Calls of a channel finish in
      order (waiting on ``k`` first finishes ``k - 1``), so ``read`` means "every call up to";
    - a prefetched gather's data is normally all there when it is waited for: the wait costs
      a look at ``world`` integers, no system call.

    Waiting polls the flags, yielding the CPU and then sleeping up to 1 ms between looks, and
    raises `CommTimeoutError` naming the late ranks after the backend's timeout. A late rank
    whose process died is noticed within about 0.1 s instead, and named with its pid (Note [a
    local peer's death] in ``_peer_liveness.py``): each rank's pid sits next to the flags. The
    flags rely on stores becoming visible in
    program order (data first, flag last), which x86-64 guarantees (TSO); elsewhere the backend
    keeps the fenced synchronous all-gather and the pairwise reduce-scatter.

    Memory: every rank maps the segments, and the pages it touches count in its resident
    memory. All-gather: both halves, whole (2x the output); reduce-scatter: its own slot and
    its chunk of every other slot, in both halves (about 2x(2 - 1/world) the input). The torch
    backend sends only calls up to 32 MiB this way; larger ones use the pairwise exchange.
"""

from __future__ import annotations

import datetime
import os
import platform
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ._errors import CommError, CommTimeoutError
from ._peer_liveness import PeerWatch
from ._reduce_op import ReduceOp
from ._shm_gather import agree_on_prefix, map_and_unlink, shm_dir
from ._work import Work

__all__ = ["SharedMemoryCollectives", "stores_are_ordered"]

_GATHER, _SCATTER = 0, 1  # channels
_WRITTEN, _READ = 0, 1  # phases
_NAMES = ("all_gather_into_tensor", "reduce_scatter_tensor")
_YIELDS = 20  # looks at the flags with a bare sched_yield before sleeping between looks
_MAX_SLEEP_S = 1e-3


def stores_are_ordered() -> bool:
    """True on CPUs whose stores become visible to other cores in program order (x86: TSO),
    which the flags of Note [shared-memory collectives without gloo] rely on."""
    return platform.machine().lower() in {"x86_64", "amd64", "i386", "i686"}


class _ShmWork(Work):
    """One call of a channel: ``wait()`` finishes it (Note [shared-memory collectives ...])."""

    def __init__(self, channel: _Channel, seq: int, finish: Any) -> None:
        self._channel = channel
        self.seq = seq
        self._finish = finish  # reads the half into the output, once every slot is written
        self.done = False

    def wait(self, timeout: float | None = None) -> None:
        if not self.done:
            self._channel.finish_through(self.seq, timeout)

    def is_completed(self) -> bool:
        if self.done:
            return True
        if self._channel.written_min() < self.seq:
            # A dead peer's call never completes: say "completed" so that pollers (the
            # engine's rate limiter) move on to `wait`, which raises the error naming it.
            return self._channel.peer_died(self.seq)
        self.wait()
        return True

    def run(self) -> None:
        self._finish()
        self.done = True


class _Channel:
    """One collective's segment (two halves), its call counter and its unfinished calls."""

    def __init__(self, owner: SharedMemoryCollectives, index: int) -> None:
        self._owner = owner
        self.index = index
        self.seq = 0
        self.half = 0  # bytes per half
        self.segment: torch.Tensor | None = None
        self.pending: list[_ShmWork] = []  # issued, not finished: at most two, in order
        self._generation = 0
        flags = owner.flags[index]
        self._written, self._read = flags[_WRITTEN], flags[_READ]

    def written_min(self) -> int:
        return int(self._written.min())

    def peer_died(self, seq: int) -> bool:
        """True when a rank that has not written call ``seq`` has died (looked at most once
        per `CHECK_INTERVAL_S`)."""
        if not self._owner.watch.due():
            return False
        late = [r for r in range(len(self._written)) if self._written[r] < seq]
        return self._owner.watch.first_dead(late) is not None

    def begin(self, nbytes: int) -> tuple[int, torch.Tensor]:
        """Number the next call and return it with its half (``nbytes`` long, as bytes), once
        nobody reads that half any more."""
        if nbytes > self.half:
            self._grow(nbytes)
        self.seq += 1
        seq = self.seq
        if len(self.pending) == 2:  # the half's previous call is not finished here yet
            self.finish_through(self.pending[0].seq, None)
        self._owner.await_flags(self._read, seq - 2, _NAMES[self.index], "read")
        assert self.segment is not None
        start = (seq % 2) * self.half
        return seq, self.segment[start : start + nbytes]

    def publish(self, work: _ShmWork) -> None:
        """This rank's slot of ``work``'s half is written."""
        self.pending.append(work)
        self._written[self._owner.rank] = work.seq

    def finish_through(self, seq: int, timeout: float | None) -> None:
        """Finish every pending call up to ``seq``, in order."""
        while self.pending and self.pending[0].seq <= seq:
            work = self.pending[0]
            self._owner.await_flags(self._written, work.seq, _NAMES[self.index], "written", timeout)
            work.run()
            self.pending.pop(0)
            self._read[self._owner.rank] = work.seq

    def _grow(self, nbytes: int) -> None:
        """A larger segment: every call so far finished by every rank, then a new file that
        every rank maps before its name is removed (collective: all ranks grow at the same
        call, since calls and sizes are the same everywhere)."""
        if self.pending:
            self.finish_through(self.pending[-1].seq, None)
        self._owner.await_flags(self._read, self.seq, _NAMES[self.index], "read")
        half = 1 << max(20, (nbytes - 1).bit_length())
        self._generation += 1
        self.segment = None  # drop the old mapping first
        self.segment = self._owner.map_file(f"{self.index}-{self._generation}", 2 * half)
        self.half = half


class SharedMemoryCollectives:
    """Asynchronous all-gather and reduce-scatter for the ranks of one gloo group that share
    a host (Note [shared-memory collectives without gloo]). ``timeout`` bounds every wait."""

    def __init__(
        self,
        group: Any,
        rank: int,
        world_size: int,
        timeout: float,
        directory: str | None = None,
        ranks: tuple[int, ...] | None = None,
    ) -> None:
        self._group = group
        self._dir = shm_dir() if directory is None else directory
        self.rank = rank
        self._world_size = world_size
        self._ranks = tuple(range(world_size)) if ranks is None else ranks  # for messages
        self._timeout = timeout
        self._prefix = self._agree_on_prefix()
        # The flags, then each rank's pid and pid namespace (Note [a local peer's death]).
        self._flag_file = self.map_file("flags", (2 * 2 + 2) * world_size * 8)
        words = self._flag_file.view(torch.int64)
        self.flags = words[: 4 * world_size].view(2, 2, world_size).numpy()
        self.watch = PeerWatch(words[4 * world_size :].view(2, world_size).numpy(), rank)
        self.watch.publish()
        self._channels = (_Channel(self, _GATHER), _Channel(self, _SCATTER))
        self.all_gather_calls = 0  # calls served: tests and FSDP_COMM_DEBUG readers check
        self.reduce_scatter_calls = 0

    # ---- collectives -------------------------------------------------------------------------
    def all_gather(
        self,
        out: torch.Tensor,
        inp: torch.Tensor,
        copy_out: Callable[[torch.Tensor, torch.Tensor], object] | None = None,
    ) -> Work:
        """Start an all-gather of ``inp`` (flat) into ``out`` (``out`` world times longer):
        the gathered half is copied into ``out`` with ``copy_out(half, out)`` where given
        (Note [staged collectives] in _backend.py), else as it is."""
        self.all_gather_calls += 1
        channel = self._channels[_GATHER]
        seq, half = channel.begin(out.numel() * out.element_size())
        data = half.view(out.dtype)
        n = inp.numel()
        data[self.rank * n : (self.rank + 1) * n].copy_(inp)
        finish = (lambda: out.copy_(data)) if copy_out is None else (lambda: copy_out(data, out))
        work = _ShmWork(channel, seq, finish)
        channel.publish(work)
        return work

    def reduce_scatter(
        self,
        out: torch.Tensor,
        inp: torch.Tensor,
        op: ReduceOp,
        copy_in: Callable[[torch.Tensor, torch.Tensor], object] | None = None,
    ) -> Work:
        """Start a reduce-scatter of ``inp`` (world times ``out``, flat) with ``op``; this
        rank's slot is written with ``copy_in(inp, slot)`` where given (Note [staged
        collectives] in _backend.py), else as a copy of ``inp``."""
        self.reduce_scatter_calls += 1
        channel = self._channels[_SCATTER]
        nbytes = inp.numel() * inp.element_size()
        seq, half = channel.begin(nbytes * self._world_size)
        slots = half.view(inp.dtype).view(self._world_size, self._world_size, out.numel())
        if copy_in is None:
            slots[self.rank].view(-1).copy_(inp)
        else:
            copy_in(inp, slots[self.rank].view(-1))
        parts = [slots[j, self.rank] for j in range(self._world_size)]
        work = _ShmWork(channel, seq, lambda: op.reduce(parts, out))
        channel.publish(work)
        return work

    # ---- flags and files ---------------------------------------------------------------------
    def await_flags(
        self, row: Any, target: int, collective: str, phase: str, timeout: float | None = None
    ) -> None:
        """Return once every entry of ``row`` (one per rank) is at least ``target``."""
        if row.min() >= target:
            return
        limit = self._timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        looks = 0
        while row.min() < target:
            looks += 1
            if looks <= _YIELDS:
                os.sched_yield()
            else:
                time.sleep(min(_MAX_SLEEP_S, 2e-5 * (looks - _YIELDS)))
            if looks > _YIELDS and self.watch.due():
                self._raise_if_dead(row, target, collective, phase)
            if time.monotonic() > deadline:
                late = [r for r in range(self._world_size) if row[r] < target]
                raise CommTimeoutError(
                    f"{collective} through shared memory: timed out after {limit:g} s waiting "
                    f"for ranks {late} (group ranks) to have {phase} call {target}"
                )

    def _raise_if_dead(self, row: Any, target: int, collective: str, phase: str) -> None:
        late = [r for r in range(self._world_size) if row[r] < target]
        dead = self.watch.first_dead(late)
        if dead is None:
            return
        r, pid, how = dead
        raise CommError(
            f"{collective} through shared memory: rank {self._ranks[r]} (pid {pid}) {how} "
            f"while rank {self._ranks[self.rank]} waited for it to have {phase} call {target}; "
            "its peers cannot go on without it"
        )

    def map_file(self, name: str, nbytes: int) -> torch.Tensor:
        """Map a new shared file of ``nbytes`` (zeros) on every rank, then remove its name
        (collective), so a killed rank leaves no file behind."""
        path = os.path.join(self._dir, f"{self._prefix}-{name}")
        return map_and_unlink(path, nbytes, barrier=self._barrier, rank=self.rank)

    def _barrier(self) -> None:
        work = dist.all_reduce(torch.zeros(1), group=self._group, async_op=True)
        work.wait(datetime.timedelta(seconds=self._timeout))

    def _agree_on_prefix(self) -> str:
        return agree_on_prefix(self._group, self.rank)
