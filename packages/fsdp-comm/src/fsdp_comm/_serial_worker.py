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

    def close(self, timeout: float = 10.0) -> None:
        """Stop once what was submitted has run, and wait up to ``timeout`` seconds for the
        thread to end. A daemon thread still running when the interpreter shuts down is ended
        by a forced unwind the moment it takes the GIL back from a torch call, and libstdc++
        aborts the process ("terminate called without an active exception"): the threads
        backend's README example did so at exit in 2 of 30 runs with OMP_NUM_THREADS=1, its
        worker still dropping its last collective's tensors after `launch` returned."""
        self._queue.put(None)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

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
            del fn, future, item  # the call's tensors go now, not with the next call
            with self._lock:
                self._pending -= 1
