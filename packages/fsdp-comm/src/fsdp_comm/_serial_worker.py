"""A daemon thread that runs submitted calls one at a time, in submission order.

In-process backends run asynchronous collectives on it so the caller's thread keeps computing
while the exchange happens (the CPU analogue of a communication stream).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future

__all__ = ["SerialWorker"]


class SerialWorker:
    """Runs callables in order on one daemon thread; ``submit`` returns a `Future`."""

    def __init__(self, name: str) -> None:
        # A call and its future, or None: stop.
        self._queue: queue.SimpleQueue[tuple[Callable[[], None], Future[None]] | None] = (
            queue.SimpleQueue()
        )
        self._lock = threading.Lock()
        self._pending = 0
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], None]) -> Future[None]:
        future: Future[None] = Future()
        with self._lock:
            self._pending += 1
        self._queue.put((fn, future))
        return future

    def idle(self) -> bool:
        """True when nothing submitted is waiting or running."""
        with self._lock:
            return self._pending == 0

    def close(self) -> None:
        self._queue.put(None)

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, future = item
            if future.set_running_or_notify_cancel():
                try:
                    fn()
                except BaseException as exc:  # delivered to whoever waits on the future
                    future.set_exception(exc)
                else:
                    future.set_result(None)
            with self._lock:
                self._pending -= 1
