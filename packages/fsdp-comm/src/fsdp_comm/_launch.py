"""`launch`: run a function on N local ranks and collect what each returns.

Processes (``torch`` and any other process-based backend): each rank is a child process that
joins a TCP store hosted by the caller, exactly as under torchrun (``env://``), so the same
function runs unchanged under `launch`, torchrun or Slurm. Threads (``threads``): each rank is a
thread of this process. ``fake``: the ranks run one after another with no exchange.

Every rank has a deadline. When any rank raises, dies or overruns, the other ranks are ended
(processes are killed; an in-process group is aborted so blocked collectives raise) and the
error is raised here with the rank named.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

import torch

from ._errors import CommError, CommTimeoutError
from ._settings import resolve_timeout

__all__ = ["launch"]

_IN_PROCESS = {"threads", "fake"}


@dataclass(frozen=True)
class _RankFailure:
    rank: int
    exc_bytes: bytes | None
    exc_text: str
    remote_traceback: str


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
    here with ``[rank N]`` in its message and the rank's traceback as a note.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    limit = resolve_timeout(timeout)
    options = dict(backend_options or {})
    if backend == "threads":
        return _launch_threads(fn, world_size, tuple(args), limit, options)
    if backend == "fake":
        return _launch_fake(fn, world_size, tuple(args), options)
    return _launch_processes(fn, world_size, backend, tuple(args), limit, options,
                             start_method, threads_per_rank)


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
        except Exception as exc:
            _tag(exc, rank, traceback.format_exc())
            raise
    return results


def _launch_threads(
    fn: Callable[..., Any], world_size: int, args: tuple[Any, ...], limit: float,
    options: dict[str, Any],
) -> list[Any]:
    import threading

    from ._threads_backend import ThreadsBackend

    backends = ThreadsBackend.create(world_size, **options)
    world = backends[0].world
    results: list[Any] = [None] * world_size
    failures: list[tuple[int, BaseException, str]] = []
    lock = threading.Lock()

    def run(rank: int) -> None:
        try:
            results[rank] = fn(backends[rank], *args)
        except BaseException as exc:
            with lock:
                failures.append((rank, exc, traceback.format_exc()))
            world.abort(CommError(f"rank {rank} failed ({type(exc).__name__}: {exc}); "
                                  "the in-process group was aborted"))
        finally:
            backends[rank].close()

    threads = [threading.Thread(target=run, args=(r,), name=f"fsdp-rank{r}", daemon=True)
               for r in range(world_size)]
    for t in threads:
        t.start()
    _join_threads(threads, world, limit)
    if failures:
        rank, exc, tb = _first_cause(failures)
        _tag(exc, rank, tb)
        raise exc
    return results


def _join_threads(threads: list[Any], world: Any, limit: float) -> None:
    deadline = time.monotonic() + limit
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    alive = [i for i, t in enumerate(threads) if t.is_alive()]
    if alive:
        error = CommTimeoutError(f"launch: ranks {alive} still running after {limit:g} s")
        world.abort(error)
        for t in threads:
            t.join(2.0)
        raise error


def _first_cause(failures: list[tuple[int, BaseException, str]]) -> tuple[int, BaseException, str]:
    """The rank that failed first for its own reason, not because the group was aborted."""
    for failure in failures:
        if not isinstance(failure[1], CommError):
            return failure
    return failures[0]


def _tag(exc: BaseException, rank: int, remote_tb: str) -> None:
    """Name the rank in the exception's message (same type kept) and attach its traceback."""
    if exc.args and isinstance(exc.args[0], str):
        if not exc.args[0].startswith("[rank "):
            exc.args = (f"[rank {rank}] {exc.args[0]}",) + exc.args[1:]
    elif not exc.args:
        exc.args = (f"[rank {rank}]",)
    if hasattr(exc, "add_note"):
        exc.add_note(f"raised on rank {rank}; its traceback:\n{remote_tb}")


# ---- processes -------------------------------------------------------------------------------
def _launch_processes(
    fn: Callable[..., Any], world_size: int, backend: str, args: tuple[Any, ...], limit: float,
    options: dict[str, Any], start_method: str | None, threads_per_rank: int | None,
) -> list[Any]:
    from torch.distributed import TCPStore

    ctx = _context(start_method, fn, args)
    store = TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False,
                     timeout=_td(limit))
    nthreads = threads_per_rank or max(1, (os.cpu_count() or 1) // world_size)
    procs, conns = [], []
    try:
        for rank in range(world_size):
            parent_end, child_end = ctx.Pipe(duplex=False)
            env = _rank_env(rank, world_size, store.port)
            p = ctx.Process(target=_rank_main, name=f"fsdp-rank{rank}", daemon=True,
                            args=(fn, rank, env, backend, options, args, child_end, nthreads))
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
                f"at module level), or pass start_method='fork': {exc}") from exc
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
        "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port), "TORCHELASTIC_USE_AGENT_STORE": "True",
    }


def _rank_main(
    fn: Callable[..., Any], rank: int, env: dict[str, str], backend_name: str,
    options: dict[str, Any], args: tuple[Any, ...], conn: Connection, nthreads: int,
) -> None:
    os.environ.clear()
    os.environ.update(env)
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


def _failure(rank: int, exc: BaseException) -> _RankFailure:
    try:
        exc_bytes: bytes | None = pickle.dumps(exc)
        pickle.loads(exc_bytes)
    except Exception:
        exc_bytes = None
    return _RankFailure(rank, exc_bytes, f"{type(exc).__name__}: {exc}", traceback.format_exc())


def _collect(procs: list[Any], conns: list[Connection], limit: float) -> list[Any]:
    deadline = time.monotonic() + limit
    results: dict[int, Any] = {}
    failures: list[_RankFailure] = []
    pending = dict(enumerate(conns))
    while pending:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        ready = wait(list(pending.values()) + [procs[r].sentinel for r in pending], remaining)
        for rank in list(pending):
            if pending[rank] in ready or procs[rank].sentinel in ready:
                failure = _receive(rank, pending.pop(rank), procs[rank], results)
                if failure is not None and not failures:
                    # Give the other ranks a moment to report: the first error to arrive is
                    # often a peer's "connection closed", not the cause.
                    deadline = min(deadline, time.monotonic() + _FAILURE_GRACE_S)
                if failure is not None:
                    failures.append(failure)
    if failures:
        _raise_failure(_root_cause(failures))
    if pending:
        raise CommTimeoutError(
            f"launch: ranks {sorted(pending)} did not finish within {limit:g} s "
            "(FSDP_COMM_TIMEOUT or timeout=); every rank was ended")
    return [results[r] for r in range(len(procs))]


_FAILURE_GRACE_S = 2.0


def _receive(
    rank: int, conn: Connection, proc: Any, results: dict[int, Any]
) -> _RankFailure | None:
    try:
        kind, value = pickle.loads(conn.recv_bytes())
    except (EOFError, OSError):
        proc.join(1.0)
        text = (f"launch: rank {rank} exited (exit code {proc.exitcode}) without returning a "
                "result; the other ranks were ended")
        return _RankFailure(rank, pickle.dumps(CommError(text)), text, "")
    if kind == "ok":
        results[rank] = value
        return None
    return value  # type: ignore[no-any-return]


def _root_cause(failures: list[_RankFailure]) -> _RankFailure:
    """Prefer a rank's own error over the CommErrors its peers saw because it failed."""
    for failure in failures:
        exc = pickle.loads(failure.exc_bytes) if failure.exc_bytes is not None else None
        if exc is not None and not isinstance(exc, CommError):
            return failure
    for failure in failures:  # then a death (exit code) over a peer's "connection closed"
        if "without returning" in failure.exc_text:
            return failure
    return failures[0]


def _raise_failure(failure: _RankFailure) -> None:
    exc: BaseException | None = None
    if failure.exc_bytes is not None:
        exc = pickle.loads(failure.exc_bytes)
    if exc is None:
        exc = CommError(failure.exc_text)
    _tag(exc, failure.rank, failure.remote_traceback)
    raise exc


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
