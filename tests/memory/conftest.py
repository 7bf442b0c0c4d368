"""Shared helpers for the fsdp-memory tests: completion handles that finish late."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest


class LateHandle:
    """A `CompletionHandle` (like fsdp-comm's `Work`) that completes only when told to."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self.num_waits = 0

    def complete(self) -> None:
        self._done.set()

    def is_completed(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> None:
        self.num_waits += 1
        if not self._done.wait(5.0 if timeout is None else timeout):
            raise TimeoutError("LateHandle.wait timed out")


class PollOnlyHandle:
    """A handle whose ``wait()`` takes no timeout: the memory layer must poll it instead."""

    def __init__(self) -> None:
        self._done = threading.Event()

    def complete(self) -> None:
        self._done.set()

    def is_completed(self) -> bool:
        return self._done.is_set()

    def wait(self) -> None:  # would block forever if called before complete()
        raise AssertionError("the memory layer must not call a wait() without a timeout")


@pytest.fixture
def late_handle() -> Callable[[], LateHandle]:
    """Factory of `LateHandle` objects."""
    return LateHandle


@pytest.fixture
def poll_only_handle() -> Callable[[], PollOnlyHandle]:
    """Factory of `PollOnlyHandle` objects."""
    return PollOnlyHandle


@pytest.fixture
def complete_later() -> Callable[[object, float], threading.Timer]:
    """``complete_later(handle, seconds)``: complete ``handle`` from a timer thread."""
    timers: list[threading.Timer] = []

    def start(handle: object, seconds: float) -> threading.Timer:
        timer = threading.Timer(seconds, handle.complete)  # type: ignore[attr-defined]
        timer.daemon = True
        timer.start()
        timers.append(timer)
        return timer

    yield start
    for timer in timers:
        timer.cancel()
