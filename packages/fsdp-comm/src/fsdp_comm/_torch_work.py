"""The torch backend's `Work`, and the watchdog of its NCCL process groups.

On gloo (and every group but NCCL) a wait blocks the host until the collective finished, with
a timeout. On an NCCL group a wait only orders the caller's current CUDA stream after the
collective and returns, and a `_nccl_watchdog.Watchdog` (the one the cupy-nccl backend uses)
enforces ``FSDP_COMM_TIMEOUT``: Note [stream-ordered waits] in ``_torch_backend.py``.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ._errors import CommError
from ._nccl_watchdog import Watchdog, poll_until
from ._work import CompletedWork, Work

if TYPE_CHECKING:
    from ._torch_backend import TorchBackend

__all__ = [
    "NCCL_GROUP_TIMEOUT_GRACE_S",
    "GroupAborter",
    "WorkEvent",
    "abort_group",
    "blocking_wait_requested",
    "call_watched",
    "group_timeout",
    "new_watchdog",
    "stream_ordered_waits",
]

#: Seconds by which torch's own timeout of an NCCL group this backend creates exceeds the
#: backend's: ProcessGroupNCCL's watchdog tears the process down on its timeout
#: (TORCH_NCCL_ASYNC_ERROR_HANDLING), so ours must decide first (Note [stream-ordered waits]).
NCCL_GROUP_TIMEOUT_GRACE_S = 10.0

_BLOCKING_WAIT_VARS = ("TORCH_NCCL_BLOCKING_WAIT", "NCCL_BLOCKING_WAIT")
_TRUE = frozenset({"1", "true", "yes", "y", "on"})
_WORK_SUCCESS = 0  # torch's WorkResult.SUCCESS


# ---- deciding, once per backend ------------------------------------------------------------
def blocking_wait_requested(environ: Mapping[str, str] | None = None) -> bool:
    """True when ``TORCH_NCCL_BLOCKING_WAIT`` (or its old name) asks torch to block the host in
    every NCCL wait: then the backend keeps its host waits and needs no watchdog."""
    env = os.environ if environ is None else environ
    return any(env.get(name, "").strip().lower() in _TRUE for name in _BLOCKING_WAIT_VARS)


def stream_ordered_waits(group: Any, device: torch.device) -> bool:
    """Whether waits on ``group`` are stream-ordered and watched: an NCCL group (``"nccl"``,
    or ``"cpu:gloo,cuda:nccl"``) serving a CUDA device, unless `blocking_wait_requested`."""
    if device.type != "cuda" or blocking_wait_requested():
        return False
    return "nccl" in str(dist.get_backend(group))


def group_timeout(timeout: float, *, nccl: bool) -> datetime.timedelta:
    """torch's timeout for a group this backend creates: the backend's, plus
    `NCCL_GROUP_TIMEOUT_GRACE_S` for NCCL groups watched by a `Watchdog`."""
    grace = NCCL_GROUP_TIMEOUT_GRACE_S if nccl and not blocking_wait_requested() else 0.0
    return datetime.timedelta(seconds=timeout + grace)


# ---- the watchdog's adapters ---------------------------------------------------------------
def abort_group(group: Any) -> None:
    """``ProcessGroup.abort()``: ends the group's NCCL kernels and blocked calls, and stops
    ProcessGroupNCCL's own watchdog. Not torch's ``_abort_process_group``, which also removes
    the group from torch's registry: not safe from the watchdog's thread while the main thread
    uses torch.distributed, and `TorchBackend.close` still destroys the group."""
    group.abort()


class GroupAborter:
    """The watchdog's "communicator" for a process group: aborting aborts the group; errors
    come from each collective's `WorkEvent`, so there is no asynchronous error to check."""

    def __init__(self, group: Any) -> None:
        self._group = group

    def check_async_error(self) -> None:
        return None

    def abort(self) -> None:
        abort_group(self._group)


class WorkEvent:
    """The watchdog's "event" of one collective: its torch work. ``query`` never blocks."""

    __slots__ = ("_work",)

    def __init__(self, work: Any) -> None:
        self._work = work

    def query(self) -> bool:
        return bool(self._work.is_completed())

    def failure(self) -> BaseException | None:
        """How a completed work failed, from its result future (ProcessGroupNCCL marks it
        TIMEOUT or COMM_ERROR); None when it succeeded or cannot tell. The work's
        ``exception()`` would say more, but is deprecated and warns in torch 2.13."""
        try:
            future = self._work.get_future_result()
            if not future.done():
                return None
            result = int(future.value())
        except (RuntimeError, AttributeError, TypeError, ValueError):
            return None  # no result future (gloo, fakes), or no readable result
        if result == _WORK_SUCCESS:
            return None
        return RuntimeError(
            f"torch.distributed reported the collective's result as {_result_name(result)}"
        )


def _result_name(result: int) -> str:
    try:
        # Not in torch's stubs (and missing from older torch, which the except covers).
        name: str = torch._C._distributed_c10d.WorkResult(result).name  # type: ignore[attr-defined]
        return name
    except (AttributeError, ValueError):  # a torch without it, or a code it does not know
        return f"WorkResult {result}"


def new_watchdog(group: Any, timeout: float, rank: int, ranks: tuple[int, ...]) -> Watchdog:
    """A started `Watchdog` for the collectives of ``group``; it aborts the group."""
    return Watchdog(
        GroupAborter(group), timeout=timeout, rank=rank, ranks=ranks, subject="NCCL process group"
    ).start()


def call_watched(
    backend: TorchBackend,
    watchdog: Watchdog,
    collective: str,
    fn: Callable[..., Any],
    *args: Any,
    **kwargs: Any,
) -> Work:
    """``fn(*args, **kwargs)``, a torch collective on an NCCL group, issued asynchronously and
    watched by ``watchdog``; a synchronous call waits on the current stream."""
    watchdog.refuse(collective)
    sync = not kwargs.get("async_op", False)
    kwargs["async_op"] = True
    peer = backend._peer()
    pending = watchdog.begin(collective, peer)
    try:
        work = fn(*args, **kwargs)
    except Exception as exc:
        watchdog.discard(pending)
        error = watchdog.error  # the abort ended the call: the watchdog says why
        if error is not None:
            raise type(error)(f"{backend._describe(collective)} failed: {error}") from exc
        raise backend._wrap_error(collective, exc) from exc
    if work is None:
        watchdog.discard(pending)
        return CompletedWork()
    watchdog.attach(pending, WorkEvent(work))
    wrapped = _TorchWork(work, backend, collective, peer, watchdog=watchdog)
    if sync:
        wrapped.wait()
    return wrapped


# ---- the work ------------------------------------------------------------------------------
class _TorchWork(Work):
    """A torch.distributed work handle with errors translated to `CommError`, naming the peer
    (``peer``: "send to peer rank 2") where the work has one.

    A work is waited for once: later waits return, or raise its error, at once (gloo's send
    and receive works wait for the transfer again on every wait). Once a collective of a group
    has failed by itself (its peer closed the connection, or its own timeout passed: the work
    completed with an error, unlike a shorter timeout given to ``wait``), every later wait on
    an unfinished work of that group fails at once with that error. gloo starts a send's or
    receive's timeout only when it is waited for, so clean-up after a failure (a hook
    resharding a unit whose all-gather failed, the next waits of a pairwise exchange) would
    otherwise wait out the whole timeout again, once per work: a cut link took two timeouts
    to surface (issue #13).

    With ``watchdog`` (the backend's, which watches this collective: an NCCL group), ``wait``
    is stream-ordered instead: Note [stream-ordered waits] in _torch_backend.py."""

    def __init__(
        self,
        work: Any,
        backend: TorchBackend,
        collective: str,
        peer: str | None = None,
        watchdog: Watchdog | None = None,
    ) -> None:
        self._work = work
        self._backend = backend
        self._collective = collective
        self._peer = peer
        self._done = False
        self._error: CommError | None = None
        self._watchdog = watchdog

    def wait(self, timeout: float | None = None) -> None:
        if self._watchdog is not None:
            self._wait_on_stream(self._watchdog)  # ``timeout``: the watchdog's
            return
        if self._done:
            return
        if self._error is not None:
            raise self._error
        earlier = self._backend._failed_wait
        if earlier is not None and not self._work.is_completed():
            raise type(earlier)(
                f"{self._backend._describe(self._collective)} failed: "
                f"{self._peer or 'not waited for'}: an earlier collective "
                f"of this group failed: {earlier}"
            )
        limit = self._backend.timeout if timeout is None else timeout
        try:
            ok = self._work.wait(datetime.timedelta(seconds=limit))
        except Exception as exc:
            error = self._failed(exc)
            if self._work.is_completed():  # the collective failed, not just this wait
                self._error = self._backend._failed_wait = error
            raise error from exc
        if ok is False:
            raise self._failed(TimeoutError(f"timed out after {limit:g} s"))
        self._done = True

    def _wait_on_stream(self, watchdog: Watchdog) -> None:
        """Make the current stream wait for the collective (torch's ``wait()`` without a
        timeout returns at once on NCCL); raise the watchdog's error once it has one. Every
        call orders its own current stream, so nothing is cached."""
        watchdog.raise_error()
        try:
            self._work.wait()
        except Exception as exc:  # the collective failed: the whole group is done for
            error = watchdog.fail(self._failed(exc))
            raise type(error)(str(error)) from exc

    def synchronize(self) -> None:
        """Block the host until the collective finished (a barrier does). On a watched group
        the watchdog bounds it: its error after ``FSDP_COMM_TIMEOUT``, ours a little later;
        elsewhere it is `wait`."""
        self.wait()
        watchdog = self._watchdog
        if watchdog is not None:
            poll_until(self._work.is_completed, watchdog, watchdog.deadline_s, self._collective)

    def _failed(self, exc: BaseException) -> CommError:
        if self._peer is not None:
            exc = RuntimeError(f"{self._peer}: {exc}")
        return self._backend._wrap_error(self._collective, exc)

    def is_completed(self) -> bool:
        if self._watchdog is not None and self._watchdog.error is not None:
            return True  # so pollers move on to wait(), which raises
        return bool(self._work.is_completed())

    def wait_stream(self, stream: Any) -> None:
        with torch.cuda.stream(stream):
            self.wait()

    def add_done_callback(self, fn: Callable[[], object]) -> bool:
        """Through the torch work's future (gloo completes it on its own thread); False for
        works without one (gloo's point-to-point works)."""
        try:
            self._work.get_future().then(lambda _: fn())
        except (RuntimeError, AttributeError):
            return False
        return True
