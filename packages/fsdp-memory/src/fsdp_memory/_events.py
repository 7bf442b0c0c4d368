"""Events and completion handles: what ``after=`` accepts, and how the pool waits on it.

Three kinds of objects say "this work is done":

- CUDA events (`torch.cuda.Event`, or any object with ``query()`` and ``synchronize()``),
  which a CUDA stream can wait on without blocking the CPU;
- `CpuEvent`, the CPU stand-in, complete at once or tied to an asynchronous handle;
- any `CompletionHandle`: an object with ``wait()`` and ``is_completed()``, such as the `Work`
  returned by an asynchronous collective of fsdp-comm (duck typing: nothing is imported).
"""

from __future__ import annotations

import inspect
import time
from typing import Any, Protocol, Union, runtime_checkable

import torch

from ._errors import MemoryTimeoutError
from ._settings import resolve_timeout

__all__ = ["CompletionHandle", "CpuEvent", "Event", "After", "Completion", "completion_of", "DONE"]

# Polling starts fast (a collective may finish within microseconds) and backs off to a cap
# so a long wait costs little CPU yet notices completion within about a millisecond.
_POLL_FIRST_S = 20e-6
_POLL_MAX_S = 1e-3


@runtime_checkable
class CompletionHandle(Protocol):
    """Anything that can say whether asynchronous work is done: ``fsdp_comm.Work`` and the like.

    ``is_completed()`` must not block. ``wait()`` blocks until done; when it accepts a
    ``timeout`` keyword in seconds (fsdp-comm's `Work` does) it is used for blocking waits,
    otherwise ``is_completed()`` is polled until the deadline.
    """

    def wait(self) -> Any: ...

    def is_completed(self) -> bool: ...


class CpuEvent:
    """CPU stand-in for `torch.cuda.Event`: complete at once, or when ``handle`` completes.

    CPU work runs in program order on the calling thread, so an event recorded on a CPU stream
    is complete when recorded. Tied to an asynchronous handle (a collective running on another
    thread), it completes with that handle, so engine code that frees a buffer "after the
    all-gather" is the same on CPU and GPU.
    """

    __slots__ = ("_handle",)

    def __init__(self, handle: CompletionHandle | None = None) -> None:
        if handle is not None and not _is_handle(handle):
            raise TypeError(
                "CpuEvent(handle=...) needs an object with wait() and is_completed(), "
                f"got {type(handle).__name__}"
            )
        self._handle = handle

    @property
    def handle(self) -> CompletionHandle | None:
        """The handle this event follows, or None when it was complete when made."""
        return self._handle

    def record(self, stream: object = None) -> None:
        """Mark the event complete now: the CPU has done all work issued before this call."""
        del stream
        self._handle = None

    def query(self) -> bool:
        """True once complete (never blocks); same as `is_completed`."""
        return self._handle is None or bool(self._handle.is_completed())

    def is_completed(self) -> bool:
        """True once complete (never blocks)."""
        return self.query()

    def wait(self, timeout: float | None = None) -> None:
        """Block until complete; `MemoryTimeoutError` after ``timeout`` (default: the setting)."""
        if self._handle is None:
            return
        limit = resolve_timeout(timeout)
        if not _HandleCompletion(self._handle).block_until(time.monotonic() + limit):
            raise MemoryTimeoutError(f"CpuEvent.wait: handle not completed after {limit:g} s")

    def synchronize(self) -> None:
        """Same as ``wait()`` with the default timeout (mirrors `torch.cuda.Event`)."""
        self.wait()

    def __repr__(self) -> str:
        state = "complete" if self.query() else "pending"
        return f"CpuEvent({state})"


#: An event a stream can record: CUDA event on CUDA devices, `CpuEvent` on CPU.
Event = Union[torch.cuda.Event, CpuEvent]
#: What ``after=`` accepts: an event, a completion handle, or None (done now).
After = Union[torch.cuda.Event, CpuEvent, CompletionHandle, None]


class Completion:
    """Internal view of an ``after=`` object: done?, block until done, order a stream after it."""

    __slots__ = ()

    def done(self) -> bool:
        raise NotImplementedError

    def block_until(self, deadline: float) -> bool:
        """Wait on the CPU until done or ``deadline`` (`time.monotonic`); return whether done."""
        raise NotImplementedError

    def order(self, stream: object) -> bool:
        """Make ``stream`` wait for this without blocking the CPU; False when that is impossible."""
        del stream
        return False


class _Done(Completion):
    __slots__ = ()

    def done(self) -> bool:
        return True

    def block_until(self, deadline: float) -> bool:
        return True

    def order(self, stream: object) -> bool:
        return True


#: The completion of work that is already done.
DONE: Completion = _Done()


class _DeviceEventCompletion(Completion):
    """A CUDA (or generic device) event: polled with ``query()``, ordered with ``wait_event``."""

    __slots__ = ("event",)

    def __init__(self, event: Any) -> None:
        self.event = event

    def done(self) -> bool:
        return bool(self.event.query())

    def block_until(self, deadline: float) -> bool:
        # Event.synchronize() has no timeout, and a collective that never ends would hang it.
        return _poll(self.event.query, deadline)

    def order(self, stream: object) -> bool:
        if isinstance(stream, torch.cuda.Stream):
            stream.wait_event(self.event)
            return True
        return False


class _HandleCompletion(Completion):
    """A handle with ``is_completed()`` and ``wait()`` (a `Work`); remembers completion."""

    __slots__ = ("handle", "_done")

    def __init__(self, handle: Any) -> None:
        self.handle = handle
        self._done = False

    def done(self) -> bool:
        if not self._done:
            self._done = bool(self.handle.is_completed())
        return self._done

    def block_until(self, deadline: float) -> bool:
        if self.done():
            return True
        if _wait_takes_timeout(self.handle):
            remaining = deadline - time.monotonic()
            if remaining > 0:
                try:
                    self.handle.wait(timeout=remaining)
                except TimeoutError:
                    pass  # our own deadline decides; fall through to the last check
                except TypeError:
                    # A timeout of another kind (a timedelta): poll this type from now on.
                    _wait_signature_cache[type(self.handle)] = False
        return _poll(self.done, deadline)


_wait_signature_cache: dict[type, bool] = {}


def _wait_takes_timeout(handle: object) -> bool:
    """Whether ``type(handle).wait`` has a ``timeout`` parameter (fsdp-comm's Work does)."""
    kind = type(handle)
    cached = _wait_signature_cache.get(kind)
    if cached is None:
        try:
            cached = "timeout" in inspect.signature(kind.wait).parameters  # type: ignore[attr-defined]
        except (TypeError, ValueError):  # builtins such as torch.distributed's Work
            cached = False
        _wait_signature_cache[kind] = cached
    return cached


def _poll(is_done: Any, deadline: float) -> bool:
    delay = _POLL_FIRST_S
    while True:
        if is_done():
            return True
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        time.sleep(min(delay, remaining))
        delay = min(delay * 2, _POLL_MAX_S)


def _is_handle(obj: object) -> bool:
    return callable(getattr(obj, "is_completed", None)) and callable(getattr(obj, "wait", None))


def completion_of(after: object, *, where: str) -> Completion:
    """Normalise an ``after=`` argument (not None) for the pool and the limiter."""
    if type(after) is CpuEvent:
        handle = after.handle
        return DONE if handle is None else _HandleCompletion(handle)
    if _is_handle(after):
        return _HandleCompletion(after)
    if callable(getattr(after, "query", None)) and callable(getattr(after, "synchronize", None)):
        return _DeviceEventCompletion(after)
    raise TypeError(
        f"{where}: after must be a torch.cuda.Event, a CpuEvent, an object with wait() and "
        f"is_completed() (such as fsdp_comm.Work), or None; got {type(after).__name__}"
    )
