"""`launch`: run a function on N local ranks and collect what each returns.

Processes (``torch`` and any other process-based backend): each rank is a child process that
joins a TCP store hosted by the caller, exactly as under torchrun (``env://``), so the same
function runs unchanged under `launch`, torchrun or Slurm. Threads (``threads``): each rank is a
thread of this process. ``fake``: the ranks run one after another with no exchange.

Every rank has a deadline. When any rank raises, dies or overruns, the other ranks are ended
(processes are killed; an in-process group is aborted so blocked collectives raise) and the
error is raised here with the rank named. When several ranks fail, the root cause is raised and
the other ranks' errors ride along as notes (see ``_failures.py``).
"""

from __future__ import annotations

import faulthandler
import logging
import multiprocessing as mp
import os
import pickle
import sys
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from multiprocessing.connection import Connection, wait
from typing import Any

import torch

from ._errors import CommError, CommTimeoutError
from ._failures import DEATH, RankFailure, as_rank_error, is_settled, notes_for, pick_root, standing
from ._logging import child_environment, configure_from_environment
from ._settings import resolve_timeout

__all__ = ["launch"]

_log = logging.getLogger("fsdp.comm")

_IN_PROCESS = {"threads", "fake"}


def launch(
    fn: Callable[..., Any],
    world_size: int,
    *,
    backend: str = "torch",
    args: Sequence[Any] = (),
    timeout: float | None = None,
    backend_options: Mapping[str, Any] | None = None,
    start_method: str | None = None,
    threads_per_rank: int | None = None,
) -> list[Any]:
    """Run ``fn(backend, *args)`` on ``world_size`` local ranks; return their results in rank order.

    Args:
        fn: called on every rank with that rank's `Backend` first. For process backends it must
            be importable by the children when ``start_method="spawn"``.
        world_size: number of ranks, >= 1.
        backend: registry name: ``"torch"`` (processes over gloo, or NCCL with
            ``backend_options={"device": "cuda"}``), ``"threads"``, ``"fake"`` or another
            registered process backend that starts from torchrun's environment.
        args: extra positional arguments for ``fn`` (pickled for ``spawn``).
        timeout: seconds for the whole run (default ``FSDP_COMM_TIMEOUT``). Collectives inside
            the ranks have their own limit: ``backend_options["timeout"]``, else
            ``FSDP_COMM_TIMEOUT``.
        backend_options: keyword options for the backend's constructor.
        start_method: ``"forkserver"`` (the default where it exists), ``"spawn"`` or ``"fork"``
            (needed for closures; see Note [start methods] in ``_launch.py``).
        threads_per_rank: torch intra-op threads per process rank (default: cores / ranks).

    Returns any picklable value per rank, tensors included. An exception on a rank is re-raised
    here with ``[rank N]`` in its message and the rank's traceback as a note. When several ranks
    fail, the root cause is raised: a rank's own error before a rank that died, and both before
    errors that only echo another rank's failure (`CommError`, "another rank failed"); ties go to
    the lowest rank. The other ranks' errors are added as notes. A rank that calls ``sys.exit``
    fails with a `RuntimeError` naming it, never ends the caller.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    limit = resolve_timeout(timeout)
    options = dict(backend_options or {})
    _log.info("launch: %d ranks over %s (deadline %g s)", world_size, backend, limit)
    if backend == "threads":
        return _launch_threads(fn, world_size, tuple(args), limit, options)
    if backend == "fake":
        return _launch_fake(fn, world_size, tuple(args), options)
    return _launch_processes(
        fn, world_size, backend, tuple(args), limit, options, start_method, threads_per_rank
    )


# ---- in-process ------------------------------------------------------------------------------
def _launch_fake(
    fn: Callable[..., Any], world_size: int, args: tuple[Any, ...], options: dict[str, Any]
) -> list[Any]:
    from ._fake_backend import FakeBackend

    results = []
    for rank in range(world_size):
        backend = FakeBackend(rank=rank, world_size=world_size, **options)
        try:
            results.append(fn(backend, *args))
        except (Exception, SystemExit) as exc:
            error = as_rank_error(rank, exc)
            _tag(error, rank, traceback.format_exc())
            if error is exc:
                raise
            raise error from exc
    return results


def _launch_threads(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple[Any, ...],
    limit: float,
    options: dict[str, Any],
) -> list[Any]:
    import threading

    from ._threads_backend import ThreadsBackend

    backends = ThreadsBackend.create(world_size, **options)
    world = backends[0].world
    results: list[Any] = [None] * world_size
    failures: list[RankFailure] = []
    lock = threading.Lock()

    def run(rank: int) -> None:
        try:
            results[rank] = fn(backends[rank], *args)
        except BaseException as exc:
            failure = _thread_failure(rank, exc, traceback.format_exc())
            with lock:
                failures.append(failure)
            world.abort(
                CommError(
                    f"rank {rank} failed ({failure.exc_text}); the in-process group was aborted"
                )
            )
        finally:
            backends[rank].close()

    threads = [
        threading.Thread(target=run, args=(r,), name=f"fsdp-rank{r}", daemon=True)
        for r in range(world_size)
    ]
    for t in threads:
        t.start()
    overran = _join_threads(threads, world, limit)
    with lock:  # a thread still running after the deadline may yet append
        seen = list(failures)
    if seen:
        extra = [] if overran is None else [f"launch: {overran}"]
        _raise_root(seen, extra)
    if overran is not None:
        raise overran
    return results


def _thread_failure(rank: int, exc: BaseException, remote_tb: str) -> RankFailure:
    error = as_rank_error(rank, exc)
    return RankFailure(
        rank, standing(error), f"{type(error).__name__}: {error}", remote_tb, exc=error
    )


def _join_threads(threads: list[Any], world: Any, limit: float) -> CommTimeoutError | None:
    """Wait for every rank until the deadline; the timeout error when some rank overran."""
    deadline = time.monotonic() + limit
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    alive = [i for i, t in enumerate(threads) if t.is_alive()]
    if not alive:
        return None
    error = CommTimeoutError(f"launch: ranks {alive} still running after {limit:g} s")
    world.abort(error)
    for t in threads:
        t.join(2.0)
    return error


def _tag(exc: BaseException, rank: int, remote_tb: str) -> None:
    """Name the rank in the exception's message (same type kept) and attach its traceback."""
    if isinstance(exc, OSError) and isinstance(exc.strerror, str):
        # An OSError's message is built from errno, strerror and filename, not from args.
        if not exc.strerror.startswith("[rank "):
            exc.strerror = f"[rank {rank}] {exc.strerror}"
    elif exc.args and isinstance(exc.args[0], str):
        if not exc.args[0].startswith("[rank "):
            exc.args = (f"[rank {rank}] {exc.args[0]}",) + exc.args[1:]
    elif not exc.args:
        exc.args = (f"[rank {rank}]",)
    _add_note(exc, f"raised on rank {rank}; its traceback:\n{remote_tb}")


def _add_note(exc: BaseException, note: str) -> None:
    if hasattr(exc, "add_note"):  # Python 3.11+
        exc.add_note(note)


def _raise_root(failures: list[RankFailure], extra_notes: Sequence[str] = ()) -> None:
    """Raise the root cause among ``failures``, the other ranks' errors added as notes."""
    root, others = pick_root(failures)
    exc = root.exception()
    _tag(exc, root.rank, root.remote_traceback)
    for note in [*notes_for(others), *extra_notes]:
        _add_note(exc, note)
    raise exc


# ---- processes -------------------------------------------------------------------------------
def _launch_processes(
    fn: Callable[..., Any],
    world_size: int,
    backend: str,
    args: tuple[Any, ...],
    limit: float,
    options: dict[str, Any],
    start_method: str | None,
    threads_per_rank: int | None,
) -> list[Any]:
    # Not re-exported in torch's stubs, hence the ignore.
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    ctx = _context(start_method, fn, args)
    store = TCPStore(
        "127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False, timeout=_td(limit)
    )
    nthreads = threads_per_rank or max(1, (os.cpu_count() or 1) // world_size)
    procs, conns = [], []
    try:
        for rank in range(world_size):
            parent_end, child_end = ctx.Pipe(duplex=False)
            env = _rank_env(rank, world_size, store.port)
            p = ctx.Process(
                target=_rank_main,
                name=f"fsdp-rank{rank}",
                daemon=True,
                args=(fn, rank, env, backend, options, args, child_end, nthreads),
            )
            p.start()
            child_end.close()
            procs.append(p)
            conns.append(parent_end)
        return _collect(procs, conns, limit)
    finally:
        _end_all(procs)
        del store


def _context(start_method: str | None, fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
    """The multiprocessing context; see Note [start methods]."""
    methods = mp.get_all_start_methods()
    method = start_method or ("forkserver" if "forkserver" in methods else "spawn")
    if method not in methods:
        raise ValueError(f"start_method must be one of {methods}, got {method!r}")
    if method != "fork":
        try:
            pickle.dumps((fn, args))
        except Exception as exc:
            raise TypeError(
                f"launch: fn and args must be picklable for start_method={method!r} (define fn "
                f"at module level), or pass start_method='fork': {exc}"
            ) from exc
    if method == "forkserver":
        mp.set_forkserver_preload(["torch", "torch.distributed", "fsdp_comm"])
    return mp.get_context(method)


# Note [start methods]
#     "fork" starts a rank in ~0.1 s but copies the caller's threads' state: after torch ran an
#     OpenMP parallel region on a non-main thread (the threads backend does this), a forked
#     child hung in about 1 of 8 runs here. "forkserver" forks ranks from a clean server that
#     imported torch once (~2 s, first launch only), so later launches start in ~0.1 s and
#     never inherit threads; it is the default. "spawn" imports torch in every rank (~4 s).


def _td(seconds: float) -> Any:
    import datetime

    return datetime.timedelta(seconds=seconds)


def _rank_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    # The caller's whole environment as it is now: a forkserver was started earlier and would
    # otherwise hand ranks the environment of that moment (FSDP_COMM_* set later would be lost).
    return {
        **os.environ,
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        **child_environment(),  # ranks log at this process's level
    }


def _rank_main(
    fn: Callable[..., Any],
    rank: int,
    env: dict[str, str],
    backend_name: str,
    options: dict[str, Any],
    args: tuple[Any, ...],
    conn: Connection,
    nthreads: int,
) -> None:
    os.environ.clear()
    os.environ.update(env)
    # A rank killed by a signal (a segfault in a native library) prints every thread's Python
    # stack to stderr, so "exited (exit code -11)" comes with where it was.
    faulthandler.enable(file=sys.stderr, all_threads=True)
    configure_from_environment()  # a forkserver imported fsdp_comm under another environment
    torch.set_num_threads(nthreads)
    backend = None
    try:
        from ._registry import get_backend

        if options.get("device") == "cuda" and torch.cuda.is_available():
            options = {**options, "device": f"cuda:{rank % torch.cuda.device_count()}"}
        backend = get_backend(backend_name, **options)
        payload = pickle.dumps(("ok", fn(backend, *args)), protocol=pickle.HIGHEST_PROTOCOL)
    except BaseException as exc:
        payload = pickle.dumps(("err", _failure(rank, exc)), protocol=pickle.HIGHEST_PROTOCOL)
    try:
        conn.send_bytes(payload)
    finally:
        conn.close()
        if backend is not None:
            try:
                backend.close()
            except Exception:
                pass  # the result is sent; a failing teardown must not hide it


def _failure(rank: int, exc: BaseException) -> RankFailure:
    """The rank's failure, judged here where the exception's cause chain is still attached."""
    error = as_rank_error(rank, exc)
    exc_bytes: bytes | None
    try:
        exc_bytes = pickle.dumps(error)
        pickle.loads(exc_bytes)
    except Exception:
        exc_bytes = None
    return RankFailure(
        rank, standing(error), f"{type(error).__name__}: {error}", traceback.format_exc(), exc_bytes
    )


def _collect(procs: list[Any], conns: list[Connection], limit: float) -> list[Any]:
    deadline = time.monotonic() + limit
    results: dict[int, Any] = {}
    failures: list[RankFailure] = []
    pending = dict(enumerate(conns))
    while pending and not is_settled(failures, list(pending)):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        ready = wait(list(pending.values()) + [procs[r].sentinel for r in pending], remaining)
        for rank in sorted(pending):
            if pending[rank] in ready or procs[rank].sentinel in ready:
                failure = _receive(rank, pending.pop(rank), procs[rank], results)
                if failure is not None and not failures:
                    # Give the other ranks a moment to report: the first error to arrive is
                    # often a peer's "connection closed" or "another rank failed", not the cause.
                    deadline = min(deadline, time.monotonic() + _FAILURE_GRACE_S)
                if failure is not None:
                    failures.append(failure)
    if failures:
        ended = [f"ranks {sorted(pending)} had not finished and were ended"] if pending else []
        _raise_root(failures, ended)
    if pending:
        raise CommTimeoutError(
            f"launch: ranks {sorted(pending)} did not finish within {limit:g} s "
            "(FSDP_COMM_TIMEOUT or timeout=); every rank was ended"
        )
    return [results[r] for r in range(len(procs))]


_FAILURE_GRACE_S = 2.0


def _receive(rank: int, conn: Connection, proc: Any, results: dict[int, Any]) -> RankFailure | None:
    try:
        kind, value = pickle.loads(conn.recv_bytes())
    except (EOFError, OSError):
        proc.join(1.0)
        text = (
            f"launch: rank {rank} exited (exit code {proc.exitcode}) without returning a "
            "result; the other ranks were ended"
        )
        return RankFailure(rank, DEATH, f"CommError: {text}", "", pickle.dumps(CommError(text)))
    if kind == "ok":
        results[rank] = value
        return None
    return value  # type: ignore[no-any-return]


def _end_all(procs: list[Any]) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + 3.0
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(1.0)
