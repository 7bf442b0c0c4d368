"""Taking rate-limiter tickets without deadlocking the one thread that releases them.

The memory layer's `RateLimiter` blocks while too many all-gathers are in flight. A ticket is
released either with an event (it then frees itself once the event completes) or still held by
this thread. Blocking on tickets only this thread can release would never end, so the guard
counts held tickets per limiter: when a blocking acquire could only wait on held tickets, a
prefetch is skipped (it will be issued on demand) and a demand all-gather goes ahead without a
ticket (counted in ``bypassed``).
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

__all__ = ["LimiterGuard"]

_lock = threading.Lock()
_guards: weakref.WeakKeyDictionary[Any, LimiterGuard] = weakref.WeakKeyDictionary()


class LimiterGuard:
    """Per-limiter count of tickets held (acquired, not yet released) by the engine."""

    def __init__(self, limiter: Any) -> None:
        self._limiter = limiter
        self.held_count = 0
        self.held_bytes = 0
        self.bypassed = 0

    @staticmethod
    def of(limiter: Any) -> LimiterGuard:
        with _lock:
            guard = _guards.get(limiter)
            if guard is None:
                guard = _guards[limiter] = LimiterGuard(limiter)
            return guard

    def _could_deadlock(self, nbytes: int) -> bool:
        max_count = getattr(self._limiter, "max_count", None)
        max_bytes = getattr(self._limiter, "max_bytes", None)
        if max_count is not None and self.held_count >= max_count:
            return True
        return (
            max_bytes is not None and self.held_count > 0 and self.held_bytes + nbytes > max_bytes
        )

    def acquire(self, nbytes: int, *, prefetch: bool) -> tuple[bool, Any | None]:
        """(go ahead?, ticket or None). A prefetch that could deadlock does not go ahead."""
        if self._could_deadlock(nbytes):
            if prefetch:
                return False, None
            self.bypassed += 1
            return True, None
        ticket = self._limiter.acquire(nbytes)
        self.held_count += 1
        self.held_bytes += nbytes
        return True, ticket

    def release(self, ticket: Any | None, nbytes: int, *, after: Any = None) -> None:
        if ticket is None:
            return
        ticket.release(after=after)
        self.held_count -= 1
        self.held_bytes -= nbytes
