"""Errors raised by fsdp-memory. Bad arguments raise the built-in `ValueError` / `TypeError`."""

from __future__ import annotations

__all__ = ["MemoryTimeoutError", "RateLimitTimeoutError"]


class MemoryTimeoutError(TimeoutError):
    """A blocking wait (on an event, a handle or the rate limiter) passed its deadline."""


class RateLimitTimeoutError(MemoryTimeoutError):
    """`RateLimiter.acquire` stayed over a bound until its deadline.

    ``bounds`` names the bounds that were still exceeded (``"max_count"``, ``"max_bytes"``);
    ``nbytes`` is the size that was asked for.
    """

    def __init__(self, message: str, *, bounds: tuple[str, ...], nbytes: int) -> None:
        super().__init__(message)
        self.bounds = bounds
        self.nbytes = nbytes
