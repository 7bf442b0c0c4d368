"""`RateLimiter`: bounds the all-gathers in flight by count and by bytes.

An all-gather is "in flight" from ``acquire`` until its ticket is released and the release's
``after`` event (typically: the consumer finished with the gathered parameters) has completed.
The CPU blocks in ``acquire`` only while a bound would be exceeded, which stops a fast CPU
thread from queueing gathers whose memory the GPU cannot yet give back (FSDP paper, Sec. 3.4).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from types import TracebackType

from ._errors import RateLimitTimeoutError
from ._events import Completion, completion_of
from ._settings import resolve_timeout
from ._sizes import check_nbytes, format_bytes
from ._stats import LimiterStats

#: All-gathers in flight by default: the unit computing and the one prefetched.
DEFAULT_MAX_INFLIGHT_ALL_GATHERS = 2

__all__ = ["RateLimiter", "Ticket", "DEFAULT_MAX_INFLIGHT_ALL_GATHERS"]

# A blocked acquire waits on the oldest pending release in slices this long, so a ticket
# released by another thread meanwhile is noticed promptly.
_WAIT_SLICE_S = 0.005

_HELD, _RELEASING, _DONE = 0, 1, 2


class Ticket:
    """Permission for one all-gather of ``nbytes``, from `RateLimiter.acquire`.

    Call ``release(after=event)`` once the gathered buffer is no longer needed; the limiter
    counts the gather as in flight until ``event`` completes. Usable as a context manager
    (released with ``after=None`` on exit).
    """

    __slots__ = ("_limiter", "nbytes", "_state")

    def __init__(self, limiter: RateLimiter, nbytes: int) -> None:
        self._limiter = limiter
        self.nbytes = nbytes
        self._state = _HELD

    @property
    def released(self) -> bool:
        """True once `release` has been called (its event may still be pending)."""
        return self._state != _HELD

    def release(self, *, after: object = None) -> None:
        """Release the ticket once ``after`` (event, handle or None for now) completes.

        Never blocks. Releasing twice raises `ValueError`.
        """
        self._limiter._release(self, after)

    def __enter__(self) -> Ticket:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._state == _HELD:
            self.release()

    def __repr__(self) -> str:
        state = ("held", "releasing", "released")[self._state]
        return f"Ticket(nbytes={self.nbytes}, {state})"


class RateLimiter:
    """Bounds in-flight all-gathers: at most ``max_count`` of them and, beyond the first, at
    most ``max_bytes`` bytes in all (None: no bound of that kind).

    A request is always admitted when nothing is in flight, so a single all-gather larger than
    ``max_bytes`` still runs, alone. ``acquire`` blocks while over a bound, for at most
    ``timeout`` seconds (default ``FSDP_MEMORY_TIMEOUT``, 300 s), then raises
    `RateLimitTimeoutError` naming the bound. Waits and time spent waiting are counted.
    `RateLimiter.unlimited()` never blocks (the ablation baseline). Thread-safe.
    """

    def __init__(
        self,
        *,
        max_count: int | None = DEFAULT_MAX_INFLIGHT_ALL_GATHERS,
        max_bytes: int | None = None,
        timeout: float | None = None,
    ) -> None:
        self.max_count = check_bound(max_count, name="max_count")
        self.max_bytes = check_bound(max_bytes, name="max_bytes")
        self.timeout = None if timeout is None else resolve_timeout(timeout)
        self._cond = threading.Condition(threading.Lock())
        self._pending: deque[tuple[Ticket, Completion]] = deque()
        self._count = self._bytes = 0
        self._peak_count = self._peak_bytes = 0
        self._num_acquires = self._num_waits = 0
        self._wait_s = 0.0

    @classmethod
    def unlimited(cls, *, timeout: float | None = None) -> RateLimiter:
        """A limiter with no bounds: counts, never blocks."""
        return cls(max_count=None, max_bytes=None, timeout=timeout)

    @property
    def is_unlimited(self) -> bool:
        """True when neither bound is set."""
        return self.max_count is None and self.max_bytes is None

    def acquire(self, nbytes: int, *, timeout: float | None = None) -> Ticket:
        """A ticket for an all-gather of ``nbytes``; blocks while a bound would be exceeded.

        `ValueError` for ``nbytes`` that is not positive; `RateLimitTimeoutError` when still
        over a bound after ``timeout`` seconds (default: the limiter's, else the setting).
        """
        nbytes = check_nbytes(nbytes, where="RateLimiter.acquire")
        if timeout is not None:
            resolve_timeout(timeout)  # a bad timeout is an error even when no wait is needed
        with self._cond:
            if self._pending:
                self._reap()
            if self._admits(nbytes):
                return self._admit(nbytes)
        limit = resolve_timeout(self.timeout if timeout is None else timeout)
        return self._acquire_slow(nbytes, limit)

    def _admits(self, nbytes: int) -> bool:
        if self._count == 0:
            return True
        if self.max_count is not None and self._count >= self.max_count:
            return False
        return self.max_bytes is None or self._bytes + nbytes <= self.max_bytes

    def _admit(self, nbytes: int) -> Ticket:
        self._count += 1
        self._bytes += nbytes
        self._num_acquires += 1
        self._peak_count = max(self._peak_count, self._count)
        self._peak_bytes = max(self._peak_bytes, self._bytes)
        return Ticket(self, nbytes)

    def _acquire_slow(self, nbytes: int, limit: float) -> Ticket:
        start = time.perf_counter()
        deadline = time.monotonic() + limit
        try:
            while True:
                with self._cond:
                    self._reap()
                    if self._admits(nbytes):
                        return self._admit(nbytes)
                    if time.monotonic() >= deadline:
                        raise self._timeout_error(nbytes, limit)
                    oldest = self._pending[0][1] if self._pending else None
                    if oldest is None:
                        # Every in-flight ticket is still held: wait for a release().
                        self._cond.wait(max(0.0, deadline - time.monotonic()))
                        continue
                # Outside the lock, so other threads can release meanwhile.
                oldest.block_until(min(deadline, time.monotonic() + _WAIT_SLICE_S))
        finally:
            with self._cond:
                self._num_waits += 1
                self._wait_s += time.perf_counter() - start

    def _timeout_error(self, nbytes: int, limit: float) -> RateLimitTimeoutError:
        bounds: list[str] = []
        if self.max_count is not None and self._count >= self.max_count:
            bounds.append("max_count")
        if self.max_bytes is not None and self._bytes + nbytes > self.max_bytes:
            bounds.append("max_bytes")
        detail = " and ".join(
            f"max_count={self.max_count} ({self._count} all-gathers in flight)"
            if bound == "max_count"
            else f"max_bytes={self.max_bytes} ({format_bytes(self._bytes)} in flight)"
            for bound in bounds
        )
        held = self._count - len(self._pending)
        message = (
            f"RateLimiter.acquire(nbytes={nbytes}) still over {detail} after {limit:g} s; "
            f"{held} ticket(s) not released yet, {len(self._pending)} released ticket(s) waiting "
            "on an event that has not completed (was a ticket never released?)"
        )
        return RateLimitTimeoutError(message, bounds=tuple(bounds), nbytes=nbytes)

    def _release(self, ticket: Ticket, after: object) -> None:
        completion = None if after is None else completion_of(after, where="Ticket.release")
        with self._cond:
            if ticket._state != _HELD:
                raise ValueError(
                    f"Ticket.release: a ticket is released once, but {ticket!r} was released "
                    "already"
                )
            if completion is None or completion.done():
                self._retire(ticket)
            else:
                ticket._state = _RELEASING
                self._pending.append((ticket, completion))
                # An acquire blocked on the condition (every ticket was held) must switch to
                # waiting on this event; without a wake-up it would sleep until its timeout.
                self._cond.notify_all()

    def _retire(self, ticket: Ticket) -> None:
        ticket._state = _DONE
        self._count -= 1
        self._bytes -= ticket.nbytes
        self._cond.notify_all()

    def _reap(self) -> None:
        if not self._pending:
            return
        still: deque[tuple[Ticket, Completion]] = deque()
        for ticket, completion in self._pending:
            if completion.done():
                self._retire(ticket)
            else:
                still.append((ticket, completion))
        self._pending = still

    def stats(self) -> LimiterStats:
        """A snapshot of in-flight counts, peaks, waits and seconds waited."""
        with self._cond:
            self._reap()
            return LimiterStats(
                max_count=self.max_count,
                max_bytes=self.max_bytes,
                inflight=self._count,
                inflight_bytes=self._bytes,
                peak_inflight=self._peak_count,
                peak_inflight_bytes=self._peak_bytes,
                num_acquires=self._num_acquires,
                num_waits=self._num_waits,
                wait_s=self._wait_s,
            )

    def __repr__(self) -> str:
        return f"RateLimiter(max_count={self.max_count}, max_bytes={self.max_bytes})"


def check_bound(value: object, *, name: str, where: str = "RateLimiter") -> int | None:
    """``value`` if it is None or an int >= 1, else `ValueError` naming ``name``."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{where}: {name} must be None or an int >= 1, got {value!r}")
    return value
