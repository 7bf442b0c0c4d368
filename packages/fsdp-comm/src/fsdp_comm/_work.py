"""`Work`: the handle an asynchronous collective returns."""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from ._errors import CommError, CommTimeoutError
from ._settings import resolve_timeout

__all__ = ["Work", "CompletedWork", "FutureWork", "ChainedWork"]


class Work(ABC):
    """Handle of an asynchronous collective.

    ``wait()`` returns once the result may be used by the caller: on CPU the output tensor holds
    the result; on CUDA the caller's current stream is ordered after the collective (as with
    torch.distributed), so the CPU is not blocked. ``is_completed()`` never blocks.
    ``wait_stream(stream)`` orders another CUDA stream after the collective without blocking the
    CPU; on CPU it is the same as ``wait()``.
    """

    @abstractmethod
    def wait(self, timeout: float | None = None) -> None:
        """Block until the result is usable; raise `CommTimeoutError` after ``timeout`` seconds."""

    @abstractmethod
    def is_completed(self) -> bool:
        """True once the collective has finished (never blocks)."""

    def wait_stream(self, stream: Any) -> None:
        """Make ``stream`` wait for the collective; the default waits on the CPU."""
        del stream
        self.wait()

    def add_done_callback(self, fn: Callable[[], object]) -> bool:
        """Call ``fn()`` (on any thread) once the collective has finished; False when this
        work cannot tell (then nothing is called). For timelines: a profiler learns when the
        communication ended, not only when a wait returned."""
        del fn
        return False


class CompletedWork(Work):
    """A `Work` that is already done (world size 1, fake backends, synchronous fallbacks)."""

    def wait(self, timeout: float | None = None) -> None:
        return None

    def is_completed(self) -> bool:
        return True

    def add_done_callback(self, fn: Callable[[], object]) -> bool:
        fn()
        return True


class FutureWork(Work):
    """A `Work` backed by a `concurrent.futures.Future` run on a worker thread."""

    def __init__(self, future: Future[None], collective: str) -> None:
        self._future = future
        self._collective = collective

    def wait(self, timeout: float | None = None) -> None:
        limit = resolve_timeout(timeout)
        try:
            self._future.result(timeout=limit)
        except FutureTimeout:
            raise CommTimeoutError(
                f"{self._collective}: wait() timed out after {limit:g} s"
            ) from None

    def is_completed(self) -> bool:
        return self._future.done()

    def add_done_callback(self, fn: Callable[[], object]) -> bool:
        self._future.add_done_callback(lambda _: fn())
        return True


class ChainedWork(Work):
    """Several works plus a finishing step run once, after all of them complete.

    Used by the algorithm fallbacks: an all-gather made of one broadcast per rank, or a
    reduce-scatter made of an all-reduce and a copy of this rank's slice.
    """

    def __init__(
        self,
        works: Sequence[Work],
        collective: str,
        finish: Callable[[], object] | None = None,
        on_error: Callable[[BaseException], BaseException] | None = None,
    ) -> None:
        self._works = list(works)
        self._collective = collective
        self._finish = finish
        self._on_error = on_error
        self._done = False
        self._lock = threading.Lock()

    def wait(self, timeout: float | None = None) -> None:
        try:
            for work in self._works:
                work.wait(timeout)
        except CommError:
            raise
        except Exception as exc:  # backend-specific errors become CommError
            if self._on_error is None:
                raise CommError(f"{self._collective} failed: {exc}") from exc
            raise self._on_error(exc) from exc
        self._run_finish()

    def is_completed(self) -> bool:
        if self._done:
            return True
        if all(work.is_completed() for work in self._works):
            self._run_finish()
            return True
        return False

    def wait_stream(self, stream: Any) -> None:
        for work in self._works:
            work.wait_stream(stream)
        self._run_finish()

    def add_done_callback(self, fn: Callable[[], object]) -> bool:
        """Once every part has finished (the finishing step runs in the waiter)."""
        left = [len(self._works)]
        lock = threading.Lock()

        def one() -> None:
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                fn()

        if not left[0]:
            fn()
            return True
        if not all(hasattr(w, "add_done_callback") for w in self._works):
            return False
        watched = [w.add_done_callback(one) for w in self._works]
        return all(watched)

    def _run_finish(self) -> None:
        with self._lock:
            if self._done:
                return
            self._done = True
            if self._finish is not None:
                self._finish()
