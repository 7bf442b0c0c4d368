"""`StreamPool`: the streams FSDP needs, by role, with a CPU stand-in of the same interface."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from enum import Enum
from typing import Union

import torch

from ._devices import DeviceLike, as_device
from ._errors import MemoryTimeoutError
from ._events import DONE, CpuEvent, Event, completion_of
from ._settings import resolve_timeout

__all__ = ["StreamRole", "CpuStream", "Stream", "StreamPool"]


class StreamRole(str, Enum):
    """What a stream is for. The values are also the attribute names on `StreamPool`."""

    COMPUTE = "compute"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    HOST_TO_DEVICE = "host_to_device"
    DEVICE_TO_HOST = "device_to_host"


# Communication streams get the highest priority so a collective's copy kernels are not queued
# behind compute kernels (what delays the next all-gather delays the whole pipeline).
_HIGH_PRIORITY_ROLES = (StreamRole.ALL_GATHER, StreamRole.REDUCE_SCATTER)


class CpuStream:
    """A CPU stand-in for `torch.cuda.Stream` with the same methods.

    CPU work runs in program order on the calling thread, so ``wait_stream`` is a no-op and
    recorded events are complete at once; ``wait_event`` blocks on events tied to an
    asynchronous handle (with the ``FSDP_MEMORY_TIMEOUT`` deadline).
    """

    __slots__ = ("role",)

    device = torch.device("cpu")

    def __init__(self, role: StreamRole | str = StreamRole.COMPUTE) -> None:
        self.role = StreamRole(role)

    def wait_event(self, event: object) -> None:
        """Block until ``event`` (a `CpuEvent` or a completion handle) completes."""
        completion = completion_of(event, where="CpuStream.wait_event")
        limit = resolve_timeout(None)
        if not completion.block_until(time.monotonic() + limit):
            raise MemoryTimeoutError(
                f"CpuStream({self.role.value}).wait_event: {event!r} not complete after {limit:g} s"
            )

    def wait_stream(self, stream: object) -> None:
        """No-op: work issued on another CPU stream has already run."""
        del stream

    def record_event(self, event: CpuEvent | None = None) -> CpuEvent:
        """Return a complete `CpuEvent` (``event`` itself, re-recorded, when given)."""
        if event is None:
            return CpuEvent()
        event.record(self)
        return event

    def query(self) -> bool:
        """Always True: nothing is queued on a CPU stream."""
        return True

    def synchronize(self) -> None:
        """No-op: nothing is queued on a CPU stream."""

    def __repr__(self) -> str:
        return f"CpuStream({self.role.value!r})"


#: A stream of a `StreamPool`: `torch.cuda.Stream` on CUDA, `CpuStream` on CPU.
Stream = Union[torch.cuda.Stream, CpuStream]


class StreamPool:
    """The streams one FSDP device needs, by role: ``compute``, ``all_gather``,
    ``reduce_scatter``, ``host_to_device`` and ``device_to_host``.

    On CUDA, ``compute`` is the current stream when the pool is made and the others are new
    streams (communication ones at high priority). On CPU all roles are `CpuStream` objects whose
    events are complete at once, so engine code written against this interface runs unchanged.
    """

    def __init__(self, device: DeviceLike = "cpu") -> None:
        self.device = as_device(device, where="StreamPool")
        self.is_cuda = self.device.type == "cuda"
        self._streams: dict[StreamRole, Stream] = {r: self._make(r) for r in StreamRole}

    def _make(self, role: StreamRole) -> Stream:
        if not self.is_cuda:
            return CpuStream(role)
        if role is StreamRole.COMPUTE:
            return torch.cuda.current_stream(self.device)
        priority = -1 if role in _HIGH_PRIORITY_ROLES else 0
        # torch.cuda.Stream.__new__ carries no annotations in torch's sources.
        return torch.cuda.Stream(device=self.device, priority=priority)  # type: ignore[no-untyped-call]

    @property
    def compute(self) -> Stream:
        """The stream forward and backward kernels run on."""
        return self._streams[StreamRole.COMPUTE]

    @property
    def all_gather(self) -> Stream:
        """The stream parameter all-gathers (and their output buffers) live on."""
        return self._streams[StreamRole.ALL_GATHER]

    @property
    def reduce_scatter(self) -> Stream:
        """The stream gradient reduce-scatters (and all-reduces) run on."""
        return self._streams[StreamRole.REDUCE_SCATTER]

    @property
    def host_to_device(self) -> Stream:
        """The stream copies from (pinned) host memory to the device run on."""
        return self._streams[StreamRole.HOST_TO_DEVICE]

    @property
    def device_to_host(self) -> Stream:
        """The stream copies from the device to (pinned) host memory run on."""
        return self._streams[StreamRole.DEVICE_TO_HOST]

    def __getitem__(self, role: StreamRole | str) -> Stream:
        """The stream of ``role`` (a `StreamRole` or its value, such as ``"all_gather"``).

        An unknown role raises `ValueError` listing the roles.
        """
        try:
            return self._streams[StreamRole(role)]
        except ValueError:
            roles = ", ".join(r.value for r in StreamRole)
            raise ValueError(f"unknown stream role {role!r}; roles are {roles}") from None

    def items(self) -> list[tuple[StreamRole, Stream]]:
        """(role, stream) pairs in role order."""
        return list(self._streams.items())

    def current(self) -> Stream:
        """The stream kernels are issued on now (``compute`` on CPU)."""
        if self.is_cuda:
            return torch.cuda.current_stream(self.device)
        return self.compute

    def _resolve(self, stream: Stream | StreamRole | str | None) -> Stream:
        if stream is None:
            return self.current()
        if isinstance(stream, (StreamRole, str)):
            return self[stream]
        return stream

    @contextlib.contextmanager
    def use(self, stream: Stream | StreamRole | str) -> Iterator[Stream]:
        """Make ``stream`` (or the stream of a role) current inside the ``with`` block."""
        target = self._resolve(stream)
        if isinstance(target, torch.cuda.Stream):
            with torch.cuda.stream(target):
                yield target
        else:
            yield target

    def record_event(self, stream: Stream | StreamRole | str | None = None) -> Event:
        """Record an event on ``stream`` (default: the current stream) and return it."""
        target = self._resolve(stream)
        if isinstance(target, torch.cuda.Stream):
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]  # unannotated in torch
            event.record(target)
            return event
        return CpuEvent()

    def wait(
        self,
        after: object,
        *,
        stream: Stream | StreamRole | str | None = None,
        timeout: float | None = None,
    ) -> None:
        """Order ``stream`` (default: current) after ``after``; block the CPU only if needed.

        A CUDA event makes a CUDA stream wait on the GPU; a handle with ``wait_stream(stream)``
        (fsdp-comm's `Work`) is asked to do the same; anything else is waited for on the CPU,
        raising `MemoryTimeoutError` after ``timeout`` seconds (default ``FSDP_MEMORY_TIMEOUT``).
        """
        if after is None:
            return
        target = self._resolve(stream)
        completion = completion_of(after, where="StreamPool.wait")
        if completion is DONE or completion.order(target):
            return
        if isinstance(target, torch.cuda.Stream) and callable(getattr(after, "wait_stream", None)):
            after.wait_stream(target)  # type: ignore[attr-defined]
            return
        limit = resolve_timeout(timeout)
        if not completion.block_until(time.monotonic() + limit):
            raise MemoryTimeoutError(f"StreamPool.wait: {after!r} not complete after {limit:g} s")

    def synchronize(self) -> None:
        """Block until every stream of the pool is idle (no-op on CPU)."""
        for stream in self._streams.values():
            stream.synchronize()

    def __repr__(self) -> str:
        return f"StreamPool(device={str(self.device)!r})"
