"""The ``cupy-nccl`` backend: NCCL through ``cupy.cuda.nccl`` on torch CUDA tensors.

Tensors are handed to NCCL by pointer (``tensor.data_ptr()``, no copies) and every collective
runs on the caller's current torch CUDA stream, as torch.distributed's NCCL backend does.
Communicators meet through a torch.distributed store (see ``_nccl_ids.py``) and are watched by
a daemon thread that aborts them when a collective overruns ``FSDP_COMM_TIMEOUT`` (see
``_nccl_watchdog.py``). CuPy is imported only when a backend is created.

Note [what CuPy's NCCL lacks]
    CuPy binds neither ``ncclRedOpCreatePreMulSum`` nor non-blocking communicators. The
    pre-multiplied sum therefore scales the input into a copy (never the caller's tensor) and
    sums that; the copy costs one elementwise kernel and one buffer of the input's size.
    Creating a communicator blocks until every member joined, so it runs on a helper thread
    with a deadline. ``ncclAvg`` and bf16 need NCCL >= 2.10 (the extras pin newer); on older
    NCCL an average is a sum followed by a division on the same stream.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ._backend import Backend
from ._errors import BackendUnavailableError, CommError
from ._nccl_ids import exchange_unique_id, group_key, run_with_deadline, store_from_env, world_key
from ._nccl_lib import (
    NCCL_AVG_SINCE,
    NCCL_DTYPES,
    NCCL_OPS,
    NCCL_SUM,
    decode_unique_id,
    encode_unique_id,
    format_version,
    load_nccl,
    nccl_dtype,
    parse_nccl_version,
    torch_nccl_version,
    warn_on_nccl_version_mismatch,
)
from ._nccl_watchdog import EventWork, Pending, Watchdog
from ._reduce_op import ReduceKind, ReduceOp
from ._work import CompletedWork, Work

__all__ = ["CupyNcclBackend"]


class _GroupState(threading.local):
    """NCCL's group (``ncclGroupStart``) is per thread and spans every communicator, so the
    calls made inside it, whose events can only be recorded once the group is launched, are
    kept per thread too."""

    def __init__(self) -> None:
        self.depth = 0
        self.finishers: list[Callable[[], None]] = []


_GROUP = _GroupState()


class CupyNcclBackend(Backend):
    """Collectives of one NCCL communicator created through CuPy, on torch CUDA tensors.

    Options (all optional): ``store`` (a torch.distributed Store; by default one is built from
    torchrun's ``MASTER_ADDR``/``MASTER_PORT`` as ``env://`` does, or an in-memory one for a
    world of one), ``rank`` and ``world_size`` (default ``RANK``/``WORLD_SIZE``, else 0 and 1),
    ``device`` (default ``cuda:LOCAL_RANK``; one rank per GPU) and ``timeout`` (seconds,
    default ``FSDP_COMM_TIMEOUT``). Needs CuPy and NCCL: ``pip install "fsdp-comm[cupy]"``
    for torch's CUDA 12 builds, ``"fsdp-comm[cupy-cu13]"`` for CUDA 13 builds.

    Every collective is enqueued on the caller's current stream of ``device``; synchronous
    calls return once enqueued, so later work on that stream sees the result. `coalesce`
    groups several calls into one NCCL launch.
    """

    name = "cupy-nccl"

    def __init__(
        self,
        *,
        store: Any = None,
        rank: int | None = None,
        world_size: int | None = None,
        device: torch.device | str | int | None = None,
        timeout: float | None = None,
    ) -> None:
        super().__init__(timeout=timeout)
        self._nccl = load_nccl()
        rank, world_size = _resolve_rank(rank, world_size)
        self._device = _resolve_device(device, rank)
        owns_store = store is None
        if store is None:
            store = store_from_env(rank, world_size, self._timeout)
        warn_on_nccl_version_mismatch(self._nccl.get_version(), torch_nccl_version())
        self._connect(
            store, world_key(store, world_size), rank, tuple(range(world_size)), owns_store
        )

    @classmethod
    def from_options(cls, **options: Any) -> CupyNcclBackend:
        """Registry factory: ``get_backend("cupy-nccl", **options)``."""
        return cls(**options)

    @classmethod
    def _member_of(
        cls, parent: CupyNcclBackend, ranks: tuple[int, ...], key: str
    ) -> CupyNcclBackend:
        """A sub-group backend for ``ranks`` (parent-local ranks, this rank among them)."""
        sub = cls.__new__(cls)
        Backend.__init__(sub, timeout=parent._timeout)
        sub._nccl = parent._nccl
        sub._device = parent._device
        sub._connect(
            parent._store,
            key,
            ranks.index(parent._rank),
            tuple(parent._ranks[r] for r in ranks),
            owns_store=False,
        )
        return sub

    def _connect(
        self, store: Any, key: str, rank: int, ranks: tuple[int, ...], owns_store: bool
    ) -> None:
        """Exchange the unique id, create the communicator, start its watchdog, barrier."""
        self._store, self._owns_store, self._key = store, owns_store, key
        self._rank, self._ranks = rank, ranks
        self._groups_made = 0
        self._closed = False
        self._version = parse_nccl_version(self._nccl.get_version())
        who = self._describe("creating the NCCL communicator")
        uid = exchange_unique_id(
            store,
            key,
            is_root=rank == 0,
            timeout=self._timeout,
            who=who,
            make_id=lambda: encode_unique_id(self._nccl.get_unique_id()),
        )
        self._comm = _create_communicator(
            self._nccl, uid, len(ranks), rank, self._device, self._timeout, who
        )
        self._watchdog = Watchdog(self._comm, timeout=self._timeout, rank=rank, ranks=ranks)
        self._watchdog.start()
        # Stops the thread if the backend is dropped unclosed (and before interpreter exit).
        self._finalizer = weakref.finalize(self, self._watchdog.close)
        try:
            self._barrier_impl()  # every member is connected before anyone goes on
        except BaseException:
            self._closed = True
            self._finalizer()
            _abort_quietly(self._comm)
            raise

    def __enter__(self) -> CupyNcclBackend:
        return self

    # ---- identity ----------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return len(self._ranks)

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def ranks(self) -> tuple[int, ...]:
        return self._ranks

    @property
    def nccl_version(self) -> tuple[int, int, int]:
        """The version of the NCCL library CuPy loaded."""
        return self._version

    @property
    def communicator(self) -> Any:
        """The underlying ``cupy.cuda.nccl.NcclCommunicator`` (for calls this API lacks)."""
        return self._comm

    @property
    def capabilities(self) -> dict[str, str]:
        native_avg = self._version >= NCCL_AVG_SINCE
        return {
            "all_gather_into_tensor": "native ncclAllGather",
            "reduce_scatter_tensor": "native ncclReduceScatter",
            "all_reduce": "native ncclAllReduce",
            "broadcast": "native ncclBroadcast",
            "avg": "native ncclAvg"
            if native_avg
            else (f"NCCL {format_version(self._version)} lacks ncclAvg: sum, then divide"),
            "premul_sum": (
                "CuPy does not expose ncclRedOpCreatePreMulSum: the input is scaled "
                "into a copy (never in place), then summed"
            ),
            "barrier": "one-element ncclAllReduce; the CPU waits for its event",
            "coalesce": "backend.coalesce() groups calls in ncclGroupStart/ncclGroupEnd",
            "streams": "runs on the caller's current torch CUDA stream; no CPU blocking",
            "timeout": (
                f"watchdog thread aborts the communicator after {self._timeout:g} s "
                "(FSDP_COMM_TIMEOUT)"
            ),
            "nccl_version": format_version(self._version),
        }

    # ---- coalescing --------------------------------------------------------------------------
    @contextlib.contextmanager
    def coalesce(self) -> Iterator[None]:
        """Launch the collectives issued in the block as one NCCL group.

        Many small calls cost far more than one large one; grouping them lets NCCL fuse their
        launches. NCCL's group is per thread and covers every communicator, including other
        backends' calls in the block. The calls start when the outermost block ends, so a
        `Work` from inside the block may only be waited on after it; barriers and new groups
        are refused inside.
        """
        self._check_usable("coalesce")
        self._nccl.groupStart()
        _GROUP.depth += 1
        try:
            yield
        finally:
            _GROUP.depth -= 1
            self._end_group()

    def _end_group(self) -> None:
        try:
            self._nccl.groupEnd()
        except Exception as exc:
            if _GROUP.depth == 0:
                _GROUP.finishers.clear()
            raise self._error_for("coalesce", exc) from exc
        if _GROUP.depth == 0:
            finishers, _GROUP.finishers = _GROUP.finishers, []
            for finish in finishers:
                finish()

    # ---- collectives -------------------------------------------------------------------------
    def _all_gather_impl(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool) -> Work | None:
        dtype = self._dtype(inp, reducing=False)
        send, recv, count = self._ptr(inp), self._ptr(out), inp.numel()
        return self._enqueue(
            "all_gather_into_tensor",
            count,
            lambda s: self._comm.allGather(send, recv, count, dtype, s),
            async_op,
            keep=(inp, out),
        )

    def _reduce_scatter_impl(
        self, out: torch.Tensor, inp: torch.Tensor, op: ReduceOp, async_op: bool
    ) -> Work | None:
        dtype = self._dtype(inp, reducing=True)
        nccl_op, src, after = self._lower(op, inp, out)
        send, recv, count = self._ptr(src), self._ptr(out), out.numel()
        return self._enqueue(
            "reduce_scatter_tensor",
            count,
            lambda s: self._comm.reduceScatter(send, recv, count, dtype, nccl_op, s),
            async_op,
            after=after,
            keep=(src, out),
        )

    def _all_reduce_impl(self, tensor: torch.Tensor, op: ReduceOp, async_op: bool) -> Work | None:
        dtype = self._dtype(tensor, reducing=True)
        nccl_op, src, after = self._lower(op, tensor, tensor)
        send, recv, count = self._ptr(src), self._ptr(tensor), tensor.numel()
        return self._enqueue(
            "all_reduce",
            count,
            lambda s: self._comm.allReduce(send, recv, count, dtype, nccl_op, s),
            async_op,
            after=after,
            keep=(src, tensor),
        )

    def _broadcast_impl(self, tensor: torch.Tensor, src: int, async_op: bool) -> Work | None:
        dtype = self._dtype(tensor, reducing=False)
        ptr, count = self._ptr(tensor), tensor.numel()
        return self._enqueue(
            "broadcast",
            count,
            lambda s: self._comm.broadcast(ptr, ptr, count, dtype, src, s),
            async_op,
            keep=(tensor,),
        )

    def _barrier_impl(self) -> None:
        if _GROUP.depth:
            raise RuntimeError("barrier() inside coalesce() would wait for itself; call it after")
        flag = torch.zeros(1, dtype=torch.float32, device=self._device)
        ptr = self._ptr(flag)
        work = self._enqueue(
            "barrier",
            1,
            lambda s: self._comm.allReduce(ptr, ptr, 1, NCCL_DTYPES[torch.float32], NCCL_SUM, s),
            True,
            keep=(flag,),
        )
        assert isinstance(work, EventWork)
        work.synchronize()

    def _new_group_impl(self, ranks: tuple[int, ...]) -> Backend | None:
        self._check_usable("new_group")
        if _GROUP.depth:
            raise RuntimeError("new_group() inside coalesce() is not supported; call it after")
        key = group_key(self._key, self._groups_made, [self._ranks[r] for r in ranks])
        self._groups_made += 1  # on every rank, members or not, so keys stay in step
        if self._rank not in ranks:
            return None
        return CupyNcclBackend._member_of(self, ranks, key)

    def close(self) -> None:
        """Stop the watchdog and free the communicator (abort it if work is still pending)."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        self._finalizer.detach()
        clean = self._watchdog.error is None and self._watchdog.wait_idle(min(self._timeout, 10.0))
        self._watchdog.close()
        if clean:
            try:
                self._comm.destroy()
            except Exception:
                _abort_quietly(self._comm)
        else:  # destroy waits for pending work, which may never end; abort does not
            _abort_quietly(self._comm)
        if self._owns_store:
            self._store = None

    # ---- helpers -----------------------------------------------------------------------------
    def _enqueue(
        self,
        collective: str,
        count: int,
        call: Callable[[int], None],
        async_op: bool,
        *,
        after: Callable[[], object] | None = None,
        keep: tuple[torch.Tensor, ...] = (),
    ) -> Work | None:
        """Enqueue one NCCL call on the caller's current stream and watch it.

        ``after`` runs on the same stream once the call is launched (an average's division).
        ``keep`` holds the call's tensors alive until then: inside a group NCCL launches only
        at the group's end, and a tensor the caller (or we, for a scaled copy) dropped in the
        block could meanwhile be reallocated and overwritten by kernels queued before it.
        Once launched, stream order protects them as in torch.distributed.
        """
        self._check_usable(collective)
        if count == 0:  # nothing to move; NCCL may reject the null pointers of empty tensors
            return CompletedWork() if async_op else None
        stream = _current_stream(self._device)
        pending = self._watchdog.begin(collective)
        try:
            call(stream.cuda_stream)
        except Exception as exc:
            self._watchdog.discard(pending)
            raise self._error_for(collective, exc) from exc
        finish = _finisher(self._watchdog, pending, stream, after, keep)
        if _GROUP.depth:
            _GROUP.finishers.append(finish)
        else:
            finish()
        if not async_op:
            return None
        return EventWork(self._watchdog, pending, lambda: _current_stream(self._device))

    def _lower(
        self, op: ReduceOp, inp: torch.Tensor, out: torch.Tensor
    ) -> tuple[int, torch.Tensor, Callable[[], object] | None]:
        """NCCL op, the input to send and a step to run afterwards (Note [what CuPy's NCCL
        lacks])."""
        if op.kind is ReduceKind.PREMUL_SUM:
            assert op.factor is not None
            if not inp.is_floating_point():  # the scaled copy would change dtype under NCCL
                raise TypeError(
                    f"cupy-nccl: premul_sum needs a floating-point dtype, got {inp.dtype}"
                )
            return NCCL_SUM, inp * op.factor, None  # a scaled copy; the caller's input stays
        if op.kind is ReduceKind.AVG and self._version < NCCL_AVG_SINCE:
            n = self.world_size
            if out.is_floating_point():
                return NCCL_SUM, inp, lambda: out.div_(n)
            return NCCL_SUM, inp, lambda: out.div_(n, rounding_mode="trunc")
        return NCCL_OPS[op.kind], inp, None

    def _dtype(self, t: torch.Tensor, *, reducing: bool) -> int:
        return nccl_dtype(t.dtype, reducing=reducing, version=self._version)

    def _ptr(self, t: torch.Tensor) -> int:
        if t.device != self._device:
            raise ValueError(
                f"cupy-nccl: tensors must be on {self._device} (this "
                f"communicator's GPU), got one on {t.device}"
            )
        return int(t.data_ptr())

    def _check_usable(self, collective: str) -> None:
        if self._closed:
            raise CommError(f"{self._describe(collective)}: the backend is closed")
        self._watchdog.refuse(collective)

    def _error_for(self, collective: str, exc: BaseException) -> CommError:
        """The watchdog's error when it aborted the call, else the NCCL error wrapped."""
        error = self._watchdog.error
        if error is not None:
            return type(error)(f"{self._describe(collective)} failed: {error}")
        return self._wrap_error(collective, exc)


def _finisher(
    watchdog: Watchdog,
    pending: Pending,
    stream: Any,
    after: Callable[[], object] | None,
    keep: tuple[torch.Tensor, ...],
) -> Callable[[], None]:
    """Record the event that ends ``pending`` (after ``after``) once the call is launched."""
    keep_alive = list(keep)

    def finish() -> None:
        del keep_alive[:]  # launched: stream order protects the tensors from here on
        if after is not None:
            with _stream_context(stream):
                after()
        event = _new_event()
        event.record(stream)
        watchdog.attach(pending, event)

    return finish


def _abort_quietly(comm: Any) -> None:
    try:
        comm.abort()
    except Exception:
        pass  # already aborted (the watchdog got there first): nothing left to free


# ---- seams over CUDA (tests replace these with fakes to run without a GPU) ------------------
def _current_stream(device: torch.device) -> Any:
    return torch.cuda.current_stream(device)


def _new_event() -> Any:
    return torch.cuda.Event()  # type: ignore[no-untyped-call]  # unannotated in torch


def _stream_context(stream: Any) -> Any:
    return torch.cuda.stream(stream)


def _resolve_rank(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """Explicit values, else torchrun's ``RANK``/``WORLD_SIZE``, else a world of one."""
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if rank is None:
        if "RANK" in os.environ and world_size != 1:
            rank = int(os.environ["RANK"])
        elif world_size == 1:
            rank = 0
        else:
            raise ValueError(f"cupy-nccl: world_size={world_size} needs rank= (or RANK set)")
    for name, value in (("rank", rank), ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"cupy-nccl: {name} must be an int, got {value!r}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(
            f"cupy-nccl: need 0 <= rank < world_size, got rank={rank} world_size={world_size}"
        )
    return rank, world_size


def _resolve_device(device: torch.device | str | int | None, rank: int) -> torch.device:
    """The GPU of this rank (default ``cuda:LOCAL_RANK``), made torch's current device."""
    dev = (
        torch.device("cuda", device)
        if isinstance(device, int)
        else torch.device(device if device is not None else "cuda")
    )
    if dev.type != "cuda":
        raise ValueError(
            f"cupy-nccl runs on CUDA devices only, got device={dev}; use the "
            "torch backend (gloo) for CPU tensors"
        )
    if dev.index is None:
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    count = torch.cuda.device_count()
    if dev.index >= count:
        raise BackendUnavailableError(
            f"cupy-nccl: rank {rank} needs {dev} but {count} GPU(s) are visible; NCCL runs one "
            "rank per GPU (set CUDA_VISIBLE_DEVICES, or start fewer ranks)"
        )
    torch.cuda.set_device(dev)
    return dev


def _create_communicator(
    nccl: Any, uid: bytes, nranks: int, rank: int, device: torch.device, timeout: float, who: str
) -> Any:
    """``NcclCommunicator(nranks, uid, rank)`` on ``device``, bounded by ``timeout``."""
    cupy = sys.modules.get("cupy")  # imported by load_nccl; only its version is read here
    as_tuple = cupy is not None and int(cupy.__version__.split(".")[0]) < 14  # CuPy 13: tuple
    commid = decode_unique_id(uid, as_tuple=as_tuple)

    def create() -> Any:
        if device.type == "cuda":  # the current device is per thread; NCCL binds to it
            torch.cuda.set_device(device)
        return nccl.NcclCommunicator(nranks, commid, rank)

    try:
        return run_with_deadline(create, timeout, who)
    except CommError:
        raise
    except Exception as exc:
        raise CommError(f"{who} failed: {exc}") from exc
