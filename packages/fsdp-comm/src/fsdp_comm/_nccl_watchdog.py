"""The watchdog of one NCCL communicator, and the `Work` of a collective enqueued on a stream.

NCCL through CuPy has no timeout: a collective whose peer died or never joined spins on the GPU
forever, and the CPU only notices when something synchronizes with it (also forever). The
watchdog, a daemon thread per communicator, polls ``comm.check_async_error()`` and the CUDA
event recorded after each collective; when one has not completed within the backend's timeout
(``FSDP_COMM_TIMEOUT``) it calls ``comm.abort()``, which ends NCCL's kernels and blocked calls,
and records the error. The backend then refuses every later call and `Work.wait` with that
error, naming the collective and the group's ranks.

The torch backend watches its NCCL process groups with the same class (Note [stream-ordered
waits] in ``_torch_backend.py``): there the "communicator" aborts the process group and the
"event" of a collective is its torch work, whose optional ``failure()`` reports a collective
that completed with an error (an event without that method, a CUDA event, only completes).

Only duck-typed objects are used (``comm.check_async_error/abort``, ``event.query`` and
optionally ``event.failure``, ``stream.wait_event``), so tests drive all of it with fakes and
no GPU.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ._errors import CommError, CommTimeoutError
from ._work import Work

__all__ = ["Pending", "Watchdog", "EventWork", "describe", "poll_until"]


def describe(collective: str, rank: int, ranks: tuple[int, ...]) -> str:
    """Same wording as `Backend._describe`, without holding the backend (see Watchdog)."""
    return f"{collective} on rank {rank} of group ranks {list(ranks)}"


@dataclass(eq=False)
class Pending:
    """One collective being watched. ``event`` is None until it is enqueued on its stream
    (calls inside a coalesced group are enqueued at the group's end)."""

    collective: str
    started: float
    event: Any = None
    #: What the collective waits for, named in errors ("with peer rank 1"); None: the group.
    peer: str | None = None


class Watchdog:
    """Polls one communicator for asynchronous errors and overdue collectives; aborts it.

    Holds no reference to the backend, so an unclosed backend can still be garbage collected.
    `poll_once` is the whole logic; `start` runs it every ``interval`` seconds on a thread.
    """

    def __init__(
        self,
        comm: Any,
        *,
        timeout: float,
        rank: int,
        ranks: tuple[int, ...],
        interval: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        subject: str = "NCCL communicator",
    ) -> None:
        self._comm = comm
        self._subject = subject  # what `comm.abort()` aborts, for messages
        self._timeout = timeout
        self._rank, self._ranks = rank, ranks
        # Often enough to abort within ~1% of the timeout, rarely enough to cost nothing.
        self._interval = interval if interval is not None else min(1.0, max(0.01, timeout / 100))
        self._clock = clock
        self._pending: list[Pending] = []
        self._lock = threading.Lock()
        self._error: CommError | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.aborted = False

    @property
    def error(self) -> CommError | None:
        """The failure that aborted the communicator, if any."""
        return self._error

    @property
    def timeout(self) -> float:
        return self._timeout

    @property
    def deadline_s(self) -> float:
        """How long a CPU wait may last: past the watchdog's own verdict, so that it decides."""
        return self._timeout + 2 * self._interval + 1.0

    # ---- tracking ----------------------------------------------------------------------------
    def begin(self, collective: str, peer: str | None = None) -> Pending:
        """Start watching a collective about to be enqueued (its event comes in `attach`).

        Completed collectives at the head of the list are dropped first, so that what their
        events hold (a torch work holds its tensors) goes at the next call, not the next poll.
        """
        pending = Pending(collective, self._clock(), peer=peer)
        with self._lock:
            self._drop_completed_head()
            self._pending.append(pending)
        return pending

    def _drop_completed_head(self) -> None:
        """Drop the oldest collectives while they completed without error (lock held)."""
        while self._pending:
            event = self._pending[0].event
            if event is None or not _query(event) or _failure(event) is not None:
                return
            self._pending.pop(0)

    def attach(self, pending: Pending, event: Any) -> None:
        """The event recorded on the collective's stream right after it was enqueued."""
        pending.event = event

    def discard(self, pending: Pending) -> None:
        """Stop watching a call that failed before it was enqueued."""
        with self._lock:
            if pending in self._pending:
                self._pending.remove(pending)

    def describe(self, collective: str) -> str:
        return describe(collective, self._rank, self._ranks)

    def refuse(self, collective: str) -> None:
        """Raise the recorded failure (a new exception of its type) for a later call."""
        error = self._error
        if error is not None:
            raise type(error)(
                f"{self.describe(collective)} refused: the {self._subject} was "
                f"aborted earlier: {error}"
            )

    def raise_error(self) -> None:
        """Raise the recorded failure itself (for `Work.wait` of the collective that failed)."""
        error = self._error
        if error is not None:
            raise type(error)(str(error))

    # ---- polling -----------------------------------------------------------------------------
    def poll_once(self) -> None:
        """Check NCCL's asynchronous error and every pending collective once; abort on failure."""
        if self._error is not None:
            return
        try:
            self._comm.check_async_error()
        except Exception as exc:
            oldest = self._oldest()
            what = oldest.collective if oldest is not None else "a collective"
            self.fail(
                CommError(
                    f"{describe(what, self._rank, self._ranks)} failed: NCCL reported an "
                    f"asynchronous error ({exc}); the {self._subject} was aborted"
                )
            )
            return
        overdue = self._prune_and_find_overdue()
        if overdue is not None:
            self.fail(
                CommTimeoutError(
                    f"{self._who(overdue)} did not complete within {self._timeout:g} s "
                    "(FSDP_COMM_TIMEOUT): a peer may have died or called a different collective. "
                    f"The {self._subject} was aborted; this backend cannot be used again."
                )
            )

    def _who(self, pending: Pending) -> str:
        who = describe(pending.collective, self._rank, self._ranks)
        return who if pending.peer is None else f"{who} ({pending.peer})"

    def _completed_with(self, pending: Pending, exc: BaseException) -> CommError:
        """The error of a collective whose event reported a failure: the wording of
        `Backend._wrap_error` (`CommTimeoutError` when it speaks of a timeout)."""
        what = f"{pending.peer}: {exc}" if pending.peer is not None else str(exc)
        cls = CommTimeoutError if _speaks_of_timeout(what) else CommError
        return cls(
            f"{describe(pending.collective, self._rank, self._ranks)} failed: {what}; "
            f"the {self._subject} was aborted"
        )

    def _oldest(self) -> Pending | None:
        with self._lock:
            return self._pending[0] if self._pending else None

    def _prune_and_find_overdue(self) -> Pending | None:
        now = self._clock()
        with self._lock:
            pending = list(self._pending)
        done: list[Pending] = []
        overdue: Pending | None = None
        for p in pending:
            if p.event is not None and _query(p.event):
                failure = _failure(p.event)
                if failure is not None:
                    self.fail(self._completed_with(p, failure))
                done.append(p)
            elif overdue is None and now - p.started > self._timeout:
                overdue = p
        if done:
            with self._lock:
                self._pending = [p for p in self._pending if p not in done]
        return overdue

    def fail(self, error: CommError) -> CommError:
        """Record ``error`` and abort the communicator, unless a failure was recorded before;
        return the recorded one (a waiter whose collective failed reports it here)."""
        with self._lock:
            first = self._error is None
            if first:
                # Published before aborting: a call the abort unblocks must see why it failed.
                self._error = error
        if first:
            try:
                self._comm.abort()
            except Exception:  # aborting is best effort; the error is already recorded
                pass
            self.aborted = True
        assert self._error is not None
        return self._error

    def idle(self) -> bool:
        """True when every watched collective has completed (polls their events)."""
        self._prune_and_find_overdue()
        with self._lock:
            return not self._pending

    def wait_idle(self, timeout: float) -> bool:
        """Poll until `idle` or ``timeout`` seconds passed; return whether it became idle."""
        deadline = time.monotonic() + timeout
        while not self.idle():
            if self._error is not None or time.monotonic() >= deadline:
                return False
            time.sleep(0.001)
        return True

    # ---- thread ------------------------------------------------------------------------------
    def start(self) -> Watchdog:
        self._thread = threading.Thread(target=self._run, name="fsdp-nccl-watchdog", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self.poll_once()
            except Exception as exc:  # a crashed watchdog must still fail loudly
                self.fail(
                    CommError(
                        f"{describe('watchdog', self._rank, self._ranks)}: polling failed: {exc}"
                    )
                )
            if self._error is not None:
                return

    def close(self) -> None:
        """Stop the thread (idempotent); the communicator itself is the backend's to close."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(self._interval + 1.0)


def _query(event: Any) -> bool:
    try:
        return bool(event.query())
    except Exception:  # a sticky CUDA error: leave it to the timeout and the async error
        return False


def _failure(event: Any) -> BaseException | None:
    """What a completed event's optional ``failure()`` reports; None: it succeeded, or it
    cannot tell (a CUDA event has no such method)."""
    failure: Callable[[], BaseException | None] | None = getattr(event, "failure", None)
    if failure is None:
        return None
    try:
        return failure()
    except Exception:  # cannot tell: the timeout and the waiters still see a failure
        return None


def _speaks_of_timeout(text: str) -> bool:
    lowered = text.lower()
    return "timed out" in lowered or "timeout" in lowered


def poll_until(done: Callable[[], bool], watchdog: Watchdog, limit: float, collective: str) -> None:
    """Block the CPU until ``done()``: the watchdog's error once it has one, `CommTimeoutError`
    after ``limit`` seconds. Polls from 10 us, doubling up to 1 ms: cheap for short waits,
    gentle for long ones."""
    deadline = time.monotonic() + limit
    delay = 1e-5
    while not done():
        watchdog.raise_error()
        if time.monotonic() >= deadline:
            raise CommTimeoutError(
                f"{watchdog.describe(collective)}: synchronize() timed out after {limit:g} s"
            )
        time.sleep(delay)
        delay = min(delay * 2, 1e-3)
    watchdog.raise_error()


class EventWork(Work):
    """An NCCL collective enqueued on a CUDA stream, completed when its event is.

    ``wait()`` orders the caller's current stream after the collective without blocking the
    CPU (the watchdog enforces ``FSDP_COMM_TIMEOUT`` and `wait` raises its error; ``timeout``
    is accepted for the `Work` interface). `synchronize` blocks the CPU, with a deadline.
    """

    def __init__(
        self, watchdog: Watchdog, pending: Pending, current_stream: Callable[[], Any]
    ) -> None:
        self._watchdog = watchdog
        self._pending = pending
        self._current_stream = current_stream

    @property
    def collective(self) -> str:
        return self._pending.collective

    def wait(self, timeout: float | None = None) -> None:
        self.wait_stream(self._current_stream())

    def wait_stream(self, stream: Any) -> None:
        stream.wait_event(self._event())

    def is_completed(self) -> bool:
        if self._watchdog.error is not None:
            return True  # so pollers move on to wait(), which raises
        return self._pending.event is not None and _query(self._pending.event)

    def synchronize(self, timeout: float | None = None) -> None:
        """Block the CPU until the collective completed. A collective that does not complete
        raises the watchdog's `CommTimeoutError` (after the backend's timeout), or this wait's
        own after ``timeout`` seconds if one is given and shorter."""
        event = self._event()
        limit = self._watchdog.deadline_s if timeout is None else timeout
        poll_until(lambda: _query(event), self._watchdog, limit, self.collective)

    def _event(self) -> Any:
        event = self._pending.event
        if event is not None and self._watchdog.error is not None and _query(event):
            return event  # finished before the failure: its result is good
        self._watchdog.raise_error()
        if event is None:
            raise RuntimeError(
                f"{self.collective}: wait() inside backend.coalesce(): the grouped collectives "
                "only start when the block ends; wait after it"
            )
        return event
