"""The ``cupy-nccl`` backend.

Without a GPU (this machine) everything but NCCL's kernels is tested: install hints, version
checks, unique-id exchange through real torch.distributed stores (with CuPy's real
``get_unique_id``), the watchdog, and the whole backend driven through a fake NCCL whose
communicators exchange data by pointer between threads (`FakeNccl`), so pointers, counts,
dtypes, ops, pre-multiplied sums, groups, sub-groups and timeouts are exercised end to end.
Real collectives run in the ``gpu`` tests, skipped without enough GPUs.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import fsdp_comm
import pytest
import torch
import torch.distributed as dist
from fsdp_comm import BackendUnavailableError, CommError, CommTimeoutError, ReduceOp
from fsdp_comm import _cupy_backend as cb
from fsdp_comm import _nccl_lib as lib
from fsdp_comm._nccl_ids import (
    KEY_PREFIX,
    exchange_unique_id,
    group_key,
    run_with_deadline,
    store_from_env,
    world_key,
)
from fsdp_comm._nccl_watchdog import EventWork, Watchdog

# ---- install hints and availability --------------------------------------------------------


@pytest.mark.parametrize(
    "cuda, extra", [("12.4", '"fsdp-comm[cupy]"'), ("13.0", '"fsdp-comm[cupy-cu13]"')]
)
def test_install_hint_follows_torch_cuda(cuda: str, extra: str) -> None:
    hint = lib.install_hint(cuda)
    assert hint.startswith(f"pip install {extra}") and cuda in hint


def test_install_hint_for_cpu_torch_names_both_extras() -> None:
    hint = lib.install_hint(None)
    assert '"fsdp-comm[cupy]"' in hint and '"fsdp-comm[cupy-cu13]"' in hint


def test_install_hint_for_other_cuda() -> None:
    assert "cupy-cuda11x nvidia-nccl-cu11" in lib.install_hint("11.8")


@pytest.mark.parametrize(
    "cuda, extra", [("12.1", "fsdp-comm[cupy]"), ("13.0", "fsdp-comm[cupy-cu13]")]
)
def test_without_cupy_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch, cuda: str, extra: str
) -> None:
    monkeypatch.setitem(sys.modules, "cupy", None)  # makes `import cupy` raise ImportError
    monkeypatch.setattr(torch.version, "cuda", cuda)
    with pytest.raises(BackendUnavailableError, match="CuPy is not installed") as info:
        fsdp_comm.get_backend("cupy-nccl")
    assert f'pip install "{extra}"' in str(info.value)


def test_without_cupy_on_cpu_torch_also_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cupy", None)
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(BackendUnavailableError) as info:
        lib.load_nccl()
    text = str(info.value)
    assert '"fsdp-comm[cupy]"' in text and "CPU-only build" in text


def test_without_nccl_library(monkeypatch: pytest.MonkeyPatch) -> None:
    nccl = pytest.importorskip("cupy.cuda.nccl")
    monkeypatch.setattr(nccl, "available", False)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    with pytest.raises(BackendUnavailableError, match="cannot load the NCCL library") as info:
        lib.load_nccl()
    assert 'pip install "fsdp-comm[cupy]"' in str(info.value)


def test_without_gpu_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("cupy")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", None)
    with pytest.raises(BackendUnavailableError, match="CPU-only build"):
        lib.load_nccl()
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(BackendUnavailableError, match="no NVIDIA GPU.*CUDA_VISIBLE_DEVICES=''"):
        lib.load_nccl()


def test_gpu_seen_by_torch_but_not_by_cupy(monkeypatch: pytest.MonkeyPatch) -> None:
    cupy = pytest.importorskip("cupy")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cupy.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    with pytest.raises(BackendUnavailableError, match="CuPy .* does not") as info:
        lib.load_nccl()
    assert "fsdp-comm[cupy-cu13]" in str(info.value)


def test_import_fsdp_comm_does_not_import_cupy() -> None:
    code = "import sys, fsdp_comm; assert 'cupy' not in sys.modules, 'cupy imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# ---- tables and versions -------------------------------------------------------------------


def test_tables_match_cupy_constants() -> None:
    nccl = pytest.importorskip("cupy.cuda.nccl")
    assert lib.NCCL_DTYPES == {
        torch.int8: nccl.NCCL_INT8,
        torch.uint8: nccl.NCCL_UINT8,
        torch.int32: nccl.NCCL_INT32,
        torch.int64: nccl.NCCL_INT64,
        torch.float16: nccl.NCCL_FLOAT16,
        torch.float32: nccl.NCCL_FLOAT32,
        torch.float64: nccl.NCCL_FLOAT64,
        torch.bfloat16: nccl.NCCL_BFLOAT16,
    }
    assert lib.NCCL_DTYPES[torch.bfloat16] == 9 and lib.NCCL_AVG == nccl.NCCL_AVG == 4
    assert (lib.NCCL_SUM, lib.NCCL_MAX) == (nccl.NCCL_SUM, nccl.NCCL_MAX)


def test_dtype_mapping_refuses_what_nccl_cannot_do() -> None:
    new = (2, 21, 5)
    assert lib.nccl_dtype(torch.bfloat16, reducing=True, version=new) == 9
    assert lib.nccl_dtype(torch.bool, reducing=False, version=new) == 1  # bytes for copies
    with pytest.raises(TypeError, match="bool only for all-gather and broadcast"):
        lib.nccl_dtype(torch.bool, reducing=True, version=new)
    with pytest.raises(TypeError, match="complex64 is not supported by NCCL 2.21.5"):
        lib.nccl_dtype(torch.complex64, reducing=False, version=new)
    with pytest.raises(TypeError, match="bfloat16 is not supported by NCCL 2.9.9"):
        lib.nccl_dtype(torch.bfloat16, reducing=False, version=(2, 9, 9))


@pytest.mark.parametrize(
    "code, version",
    [
        (23203, (2, 32, 3)),
        (21005, (2, 10, 5)),
        (2708, (2, 7, 8)),
        (2406, (2, 4, 6)),
        (30001, (3, 0, 1)),
    ],
)
def test_parse_nccl_version(code: int, version: tuple[int, int, int]) -> None:
    assert lib.parse_nccl_version(code) == version


def test_parse_nccl_version_refuses_nonsense() -> None:
    with pytest.raises(ValueError):
        lib.parse_nccl_version(0)


def test_version_mismatch() -> None:
    assert lib.nccl_version_mismatch(23203, (2, 32, 3)) is None
    assert lib.nccl_version_mismatch(23203, (2, 32, 3, "+cuda12.9")) is None  # suffix ignored
    assert lib.nccl_version_mismatch(23203, None) is None  # torch without NCCL: nothing to say
    text = lib.nccl_version_mismatch(23203, (2, 21, 5))
    assert text is not None and "2.32.3" in text and "2.21.5" in text
    assert "nvidia-nccl-cu12==2.21.5" in text


def test_version_mismatch_warns() -> None:
    with pytest.warns(UserWarning, match="CuPy loaded NCCL 2.32.3 but torch uses NCCL 2.27.3"):
        lib.warn_on_nccl_version_mismatch(23203, (2, 27, 3))


def test_real_cupy_version_parses() -> None:
    nccl = pytest.importorskip("cupy.cuda.nccl")
    if not nccl.available:
        pytest.skip("CuPy cannot load libnccl")
    assert lib.parse_nccl_version(nccl.get_version()) >= (2, 0, 0)


# ---- unique ids and stores -----------------------------------------------------------------


def test_unique_id_encoding_round_trips() -> None:
    raw = bytes(range(0, 256, 2))  # 128 bytes, half with the high bit set
    assert lib.encode_unique_id(raw) == raw
    signed = lib.decode_unique_id(raw, as_tuple=True, signed_char=True)
    assert isinstance(signed, tuple) and min(signed) < 0  # CuPy 13 on x86: C chars are signed
    assert lib.encode_unique_id(signed) == raw
    unsigned = lib.decode_unique_id(raw, as_tuple=True, signed_char=False)
    assert lib.encode_unique_id(unsigned) == raw and min(unsigned) >= 0
    assert lib.decode_unique_id(raw, as_tuple=False) == raw


def _two_ranks(fn: Callable[[int], Any], timeout: float = 10.0) -> list[Any]:
    """Run ``fn(rank)`` on two threads; return their results or raise the first error."""
    results: list[Any] = [None, None]
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            results[rank] = fn(rank)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    if errors:
        raise errors[0]
    return results


def test_unique_id_exchange_over_tcp_store() -> None:
    nccl = pytest.importorskip("cupy.cuda.nccl")
    if not nccl.available:
        pytest.skip("CuPy cannot load libnccl")
    master = dist.TCPStore(
        "127.0.0.1", 0, 2, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10)
    )
    client = dist.TCPStore(
        "127.0.0.1", master.port, 2, is_master=False, timeout=timedelta(seconds=10)
    )
    stores = [master, client]

    def rank(r: int) -> bytes:
        time.sleep(0.1 * (1 - r))  # the reader arrives first and must wait
        key = world_key(stores[r], 2)
        return exchange_unique_id(
            stores[r],
            key,
            is_root=r == 0,
            timeout=5,
            who=f"rank {r}",
            make_id=lambda: lib.encode_unique_id(nccl.get_unique_id()),
        )

    ids = _two_ranks(rank)
    assert ids[0] == ids[1] and len(ids[0]) == 128


def test_unique_id_wait_times_out_naming_the_key() -> None:
    store = dist.HashStore()
    t0 = time.monotonic()
    with pytest.raises(CommTimeoutError, match=r"rank 1 of group ranks \[0, 1\].*'k/x'.*0.3 s"):
        exchange_unique_id(
            store,
            "k/x",
            is_root=False,
            make_id=bytes,
            timeout=0.3,
            who="rank 1 of group ranks [0, 1]",
        )
    assert time.monotonic() - t0 < 3


def test_world_keys_agree_across_ranks_and_never_repeat() -> None:
    store = dist.HashStore()
    first = [world_key(store, 2), world_key(store, 2)]  # both ranks join the first world
    second = [world_key(store, 2), world_key(store, 2)]
    assert first[0] == first[1] and second[0] == second[1] and first[0] != second[0]
    assert world_key(store, 1) != first[0] and first[0].startswith(KEY_PREFIX)
    assert group_key(first[0], 0, [0, 2]) != group_key(first[0], 1, [0, 2])


def test_store_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    assert isinstance(store_from_env(0, 1, 5.0), dist.HashStore)
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    with pytest.raises(ValueError, match="MASTER_ADDR and MASTER_PORT"):
        store_from_env(0, 2, 5.0)
    agent = dist.TCPStore(
        "127.0.0.1", 0, 2, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10)
    )
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(agent.port))
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    client = store_from_env(0, 2, 5.0)  # rank 0 joins the agent's store instead of hosting
    client.set("hello", b"world")
    assert agent.get("hello") == b"world"


def test_run_with_deadline() -> None:
    assert run_with_deadline(lambda: 7, 1.0, "quick") == 7
    with pytest.raises(CommTimeoutError, match="creating did not finish within 0.2 s"):
        run_with_deadline(lambda: time.sleep(5), 0.2, "creating")
    with pytest.raises(ZeroDivisionError):
        run_with_deadline(lambda: 1 // 0, 1.0, "failing")


# ---- watchdog with fake communicator and events --------------------------------------------


class FakeEvent:
    def __init__(self, done: bool = False) -> None:
        self.done = done
        self.recorded_on: Any = None

    def query(self) -> bool:
        return self.done

    def record(self, stream: Any) -> None:
        self.recorded_on = stream


class FakeStream:
    cuda_stream = 0x5EED

    def __init__(self) -> None:
        self.waited: list[Any] = []

    def wait_event(self, event: Any) -> None:
        self.waited.append(event)


class WatchedComm:
    def __init__(self) -> None:
        self.aborts = 0
        self.async_error: Exception | None = None

    def check_async_error(self) -> None:
        if self.async_error is not None:
            raise self.async_error

    def abort(self) -> None:
        self.aborts += 1


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _watchdog(comm: WatchedComm, clock: Clock, timeout: float = 5.0) -> Watchdog:
    return Watchdog(comm, timeout=timeout, rank=1, ranks=(0, 1), clock=clock)


def test_watchdog_forgets_completed_collectives() -> None:
    comm, clock = WatchedComm(), Clock()
    wd = _watchdog(comm, clock)
    p = wd.begin("all_reduce")
    wd.attach(p, FakeEvent(done=True))
    clock.now += 60
    wd.poll_once()
    assert wd.error is None and comm.aborts == 0 and wd.idle()


def test_watchdog_aborts_an_overdue_collective() -> None:
    comm, clock = WatchedComm(), Clock()
    wd = _watchdog(comm, clock)
    event = FakeEvent()
    wd.attach(wd.begin("reduce_scatter_tensor"), event)
    clock.now += 4.9
    wd.poll_once()
    assert wd.error is None
    clock.now += 0.2
    wd.poll_once()
    wd.poll_once()
    assert comm.aborts == 1 and isinstance(wd.error, CommTimeoutError)
    assert "reduce_scatter_tensor on rank 1 of group ranks [0, 1]" in str(wd.error)
    assert "5 s (FSDP_COMM_TIMEOUT)" in str(wd.error)
    with pytest.raises(CommTimeoutError, match=r"all_gather_into_tensor on rank 1 .* refused"):
        wd.refuse("all_gather_into_tensor")


def test_watchdog_times_out_a_call_stuck_before_its_event() -> None:
    """A call blocked inside NCCL (no event yet) is watched from the moment it began."""
    comm, clock = WatchedComm(), Clock()
    wd = _watchdog(comm, clock, timeout=1.0)
    wd.begin("broadcast")
    clock.now += 2
    wd.poll_once()
    assert comm.aborts == 1 and "broadcast" in str(wd.error)


def test_watchdog_aborts_on_async_error() -> None:
    comm, clock = WatchedComm(), Clock()
    wd = _watchdog(comm, clock)
    wd.begin("all_reduce")
    comm.async_error = RuntimeError("ncclRemoteError: remote process exited")
    wd.poll_once()
    assert comm.aborts == 1 and type(wd.error) is CommError
    assert "all_reduce on rank 1" in str(wd.error) and "ncclRemoteError" in str(wd.error)


def test_watchdog_thread_aborts_within_the_timeout() -> None:
    comm = WatchedComm()
    wd = Watchdog(comm, timeout=0.2, rank=0, ranks=(0, 1, 2), interval=0.01).start()
    try:
        t0 = time.monotonic()
        wd.attach(wd.begin("all_gather_into_tensor"), FakeEvent())
        while comm.aborts == 0 and time.monotonic() - t0 < 5:
            time.sleep(0.01)
        assert 0.2 <= time.monotonic() - t0 < 2
        assert comm.aborts == 1 and isinstance(wd.error, CommTimeoutError)
        assert "group ranks [0, 1, 2]" in str(wd.error)
    finally:
        wd.close()


def test_event_work_orders_streams_without_blocking() -> None:
    comm, clock = WatchedComm(), Clock()
    wd = _watchdog(comm, clock)
    current, other = FakeStream(), FakeStream()
    pending = wd.begin("all_gather_into_tensor")
    work = EventWork(wd, pending, lambda: current)
    assert not work.is_completed()
    with pytest.raises(RuntimeError, match="inside backend.coalesce"):
        work.wait()  # no event yet: the group has not been launched
    event = FakeEvent()
    wd.attach(pending, event)
    work.wait()
    work.wait_stream(other)
    assert current.waited == [event] and other.waited == [event]
    assert not work.is_completed()
    event.done = True
    assert work.is_completed()
    work.synchronize(timeout=1)


def test_event_work_raises_after_the_watchdog_aborted() -> None:
    comm, clock = WatchedComm(), Clock()
    wd = _watchdog(comm, clock, timeout=1.0)
    good, bad = wd.begin("broadcast"), wd.begin("all_reduce")
    good_event, bad_event = FakeEvent(done=True), FakeEvent()
    wd.attach(good, good_event)
    wd.attach(bad, bad_event)
    clock.now += 2
    wd.poll_once()
    assert wd.error is not None
    EventWork(wd, good, FakeStream).wait()  # finished before the failure: still fine
    work = EventWork(wd, bad, FakeStream)
    assert work.is_completed()  # pollers move on to wait(), which raises
    with pytest.raises(CommTimeoutError, match="all_reduce on rank 1 of group ranks"):
        work.wait()
    with pytest.raises(CommTimeoutError):
        work.synchronize()


def test_event_work_synchronize_has_a_deadline() -> None:
    wd = _watchdog(WatchedComm(), Clock())
    pending = wd.begin("all_reduce")
    wd.attach(pending, FakeEvent())
    t0 = time.monotonic()
    with pytest.raises(CommTimeoutError, match="synchronize.. timed out after 0.1 s"):
        EventWork(wd, pending, FakeStream).synchronize(timeout=0.1)
    assert time.monotonic() - t0 < 2


# ---- the backend end to end over a fake NCCL -----------------------------------------------

_TORCH_DTYPES = {code: dtype for dtype, code in lib.NCCL_DTYPES.items()}


def _view(ptr: int, count: int, dtype_code: int) -> torch.Tensor:
    dtype = _TORCH_DTYPES[dtype_code]
    nbytes = count * torch.empty(0, dtype=dtype).element_size()
    return torch.frombuffer((ctypes.c_char * nbytes).from_address(ptr), dtype=dtype)


def _reduce(op: int, inputs: list[torch.Tensor]) -> torch.Tensor:
    stacked = torch.stack(inputs).double()
    if op == lib.NCCL_MAX:
        return stacked.max(0).values
    total = stacked.sum(0)
    return total / len(inputs) if op == lib.NCCL_AVG else total


class FakeWorld:
    """The members of one fake communicator, exchanging through a barrier (never hangs)."""

    def __init__(self, size: int) -> None:
        self.barrier = threading.Barrier(size, timeout=10)
        self.slots: list[Any] = [None] * size

    def exchange(self, rank: int, value: torch.Tensor) -> list[torch.Tensor]:
        self.slots[rank] = value.clone()
        self.barrier.wait()
        values = list(self.slots)
        self.barrier.wait()
        return values


class FakeComm:
    """``NcclCommunicator``'s surface on CPU memory: reads and writes tensors by pointer."""

    def __init__(self, nccl: FakeNccl, ndev: int, commid: bytes, rank: int) -> None:
        assert isinstance(commid, bytes) and len(commid) == 128
        with nccl.lock:
            self.world = nccl.worlds.setdefault(commid, FakeWorld(ndev))
        self.nccl, self.rank, self.size = nccl, rank, ndev
        self.aborted = self.destroyed = False
        self.calls: list[str] = []
        nccl.comms.append(self)

    def _run(self, name: str, body: Callable[[], None]) -> None:
        if self.aborted:
            raise RuntimeError("ncclInvalidArgument: communicator was aborted")
        self.calls.append(name)
        self.nccl.block(self)
        if self.nccl.group.depth:  # inside a group: NCCL launches at groupEnd
            self.nccl.group.queued.append(body)
        else:
            body()

    def allGather(self, send: int, recv: int, count: int, dtype: int, stream: int) -> None:
        def body() -> None:
            parts = self.world.exchange(self.rank, _view(send, count, dtype))
            _view(recv, count * self.size, dtype).copy_(torch.cat(parts))

        self._run("allGather", body)

    def reduceScatter(
        self, send: int, recv: int, count: int, dtype: int, op: int, stream: int
    ) -> None:
        def body() -> None:
            parts = self.world.exchange(self.rank, _view(send, count * self.size, dtype))
            lo = self.rank * count
            _view(recv, count, dtype).copy_(_reduce(op, [p[lo : lo + count] for p in parts]))

        self._run("reduceScatter", body)

    def allReduce(self, send: int, recv: int, count: int, dtype: int, op: int, stream: int) -> None:
        def body() -> None:
            parts = self.world.exchange(self.rank, _view(send, count, dtype))
            _view(recv, count, dtype).copy_(_reduce(op, parts))

        self._run("allReduce", body)

    def broadcast(
        self, send: int, recv: int, count: int, dtype: int, root: int, stream: int
    ) -> None:
        def body() -> None:
            parts = self.world.exchange(self.rank, _view(send, count, dtype))
            _view(recv, count, dtype).copy_(parts[root])

        self._run("broadcast", body)

    def check_async_error(self) -> None:
        pass

    def abort(self) -> None:
        self.aborted = True
        self.nccl.unblock.set()

    def destroy(self) -> None:
        self.destroyed = True


class GroupState(threading.local):
    def __init__(self) -> None:
        self.depth = 0
        self.queued: list[Callable[[], None]] = []


class FakeNccl:
    """Stands in for ``cupy.cuda.nccl`` (module functions and the communicator class)."""

    available = True

    def __init__(self, version: int = 23203) -> None:
        self.version = version
        self.lock = threading.Lock()
        self.worlds: dict[bytes, FakeWorld] = {}
        self.comms: list[FakeComm] = []
        self.group = GroupState()
        self.hang_events = False  # events recorded from now on never complete
        self.block_calls = False  # NCCL calls block until the communicator is aborted
        self.unblock = threading.Event()

    def get_version(self) -> int:
        return self.version

    def get_unique_id(self) -> bytes:
        return os.urandom(128)

    def NcclCommunicator(self, ndev: int, commid: bytes, rank: int) -> FakeComm:  # noqa: N802
        return FakeComm(self, ndev, commid, rank)

    def groupStart(self) -> None:  # noqa: N802
        self.group.depth += 1

    def groupEnd(self) -> None:  # noqa: N802
        self.group.depth -= 1
        if self.group.depth == 0:
            queued, self.group.queued = self.group.queued, []
            for body in queued:
                body()

    def block(self, comm: FakeComm) -> None:
        if self.block_calls:
            self.unblock.wait(10)
            if comm.aborted:
                raise RuntimeError("ncclInternalError: aborted while blocked")

    def new_event(self) -> FakeEvent:
        return FakeEvent(done=not self.hang_events)


@pytest.fixture
def fake_nccl(monkeypatch: pytest.MonkeyPatch) -> FakeNccl:
    """Make `CupyNcclBackend` run on CPU tensors over `FakeNccl`."""
    nccl = FakeNccl()
    monkeypatch.setattr(cb, "load_nccl", lambda: nccl)
    monkeypatch.setattr(cb, "_resolve_device", lambda device, rank: torch.device("cpu"))
    monkeypatch.setattr(cb, "_current_stream", lambda device: FakeStream())
    monkeypatch.setattr(cb, "_new_event", nccl.new_event)
    monkeypatch.setattr(cb, "_stream_context", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(cb, "torch_nccl_version", lambda: None)
    return nccl


@contextlib.contextmanager
def _backends(world_size: int, store: Any, **options: Any) -> Iterator[list[cb.CupyNcclBackend]]:
    """One fake-backed backend per rank, created concurrently as real ranks would."""
    made: list[Any] = [None] * world_size

    def create(rank: int) -> None:
        made[rank] = cb.CupyNcclBackend(store=store, rank=rank, world_size=world_size, **options)

    threads = [threading.Thread(target=create, args=(r,)) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert all(b is not None for b in made), "creating a backend failed or hung"
    try:
        yield made
    finally:
        for b in made:
            b.close()


def _on_ranks(backends: list[Any], fn: Callable[[Any], Any]) -> list[Any]:
    if len(backends) == 1:
        return [fn(backends[0])]
    assert len(backends) == 2
    return _two_ranks(lambda r: fn(backends[r]))


def test_fake_world_of_one(fake_nccl: FakeNccl) -> None:
    with _backends(1, dist.HashStore(), timeout=5) as (be,):
        assert (be.rank, be.world_size, be.ranks, be.name) == (0, 1, (0,), "cupy-nccl")
        inp = torch.arange(4.0)
        out = torch.zeros(4)
        be.all_gather_into_tensor(out, inp)
        assert torch.equal(out, inp)
        out = torch.zeros(4)
        be.reduce_scatter_tensor(out, inp, op=ReduceOp.premul_sum(0.5))
        assert torch.equal(out, inp * 0.5) and torch.equal(inp, torch.arange(4.0))
        t = torch.arange(4.0)
        be.all_reduce(t, op=ReduceOp.premul_sum(3.0))
        assert torch.equal(t, torch.arange(4.0) * 3)
        assert "copy" in be.capabilities["premul_sum"]
        assert be.capabilities["avg"] == "native ncclAvg"
        comm = be.communicator
    assert comm.destroyed and not comm.aborted  # close() freed it cleanly
    with pytest.raises(CommError, match="closed"):
        be.barrier()


def _battery(be: Any) -> dict[str, Any]:
    w, r = be.world_size, be.rank
    got: dict[str, Any] = {}
    out = torch.empty(3 * w, dtype=torch.bfloat16)
    be.all_gather_into_tensor(out, torch.full((3,), float(r + 1), dtype=torch.bfloat16))
    got["all_gather"] = out.tolist()
    inp = torch.arange(4.0 * w) + 10 * r
    for name, op in (
        ("sum", ReduceOp.SUM),
        ("avg", ReduceOp.AVG),
        ("max", ReduceOp.MAX),
        ("premul", ReduceOp.premul_sum(0.5)),
    ):
        o = torch.empty(4)
        work = be.reduce_scatter_tensor(o, inp, op=op, async_op=True)
        work.wait()
        got[f"rs_{name}"] = o.tolist()
    assert torch.equal(inp, torch.arange(4.0 * w) + 10 * r), "premul scaled the input"
    t = torch.full((5,), float(r), dtype=torch.float16)
    be.all_reduce(t, op=ReduceOp.SUM)
    got["all_reduce"] = t.tolist()
    b = torch.full((2,), float(r), dtype=torch.int64)
    be.broadcast(b, src=w - 1)
    got["broadcast"] = b.tolist()
    return got


def test_fake_world_of_two_collectives(fake_nccl: FakeNccl) -> None:
    with _backends(2, dist.HashStore(), timeout=5) as backends:
        r0, r1 = _on_ranks(backends, _battery)
    assert r0["all_gather"] == r1["all_gather"] == [1.0] * 3 + [2.0] * 3
    full = (torch.arange(8.0) * 2 + 10).tolist()  # sum over ranks of arange + 10 r
    assert r0["rs_sum"] == full[:4] and r1["rs_sum"] == full[4:]
    assert r0["rs_avg"] == [v / 2 for v in full[:4]]
    assert r1["rs_max"] == (torch.arange(4.0, 8.0) + 10).tolist()
    assert r1["rs_premul"] == [v / 2 for v in full[4:]]
    assert r0["all_reduce"] == r1["all_reduce"] == [1.0] * 5
    assert r0["broadcast"] == r1["broadcast"] == [1, 1]


def test_fake_avg_before_nccl_2_10_sums_then_divides(fake_nccl: FakeNccl) -> None:
    fake_nccl.version = 20907
    with _backends(2, dist.HashStore(), timeout=5) as backends:

        def avg(be: Any) -> list[float]:
            t = torch.full((3,), float(be.rank) + 1)
            be.all_reduce(t, op=ReduceOp.AVG)
            return t.tolist()

        assert _on_ranks(backends, avg) == [[1.5] * 3, [1.5] * 3]
        assert "lacks ncclAvg" in backends[0].capabilities["avg"]
        assert backends[0].communicator.calls[-1] == "allReduce"
        with pytest.raises(TypeError, match="bfloat16 is not supported by NCCL 2.9.7"):
            backends[0].all_reduce(torch.ones(2, dtype=torch.bfloat16))


def test_fake_coalesce_launches_at_the_end_of_the_block(fake_nccl: FakeNccl) -> None:
    with _backends(2, dist.HashStore(), timeout=5) as backends:

        def grouped(be: Any) -> list[list[float]]:
            outs = [torch.zeros(2 * be.world_size) for _ in range(3)]
            with be.coalesce():
                works = [
                    be.all_gather_into_tensor(
                        o, torch.full((2,), float(be.rank + i)), async_op=True
                    )
                    for i, o in enumerate(outs)
                ]
                with pytest.raises(RuntimeError, match="inside backend.coalesce"):
                    works[0].wait()
                with pytest.raises(RuntimeError, match="barrier.. inside coalesce"):
                    be.barrier()
                # Inside the group nothing moved yet.
                assert all(o.sum() == 0 for o in outs)
            for w in works:
                w.wait()
                assert w.is_completed()
            return [o.tolist() for o in outs]

        r0, r1 = _on_ranks(backends, grouped)
    assert r0 == r1 == [[0, 0, 1, 1], [1, 1, 2, 2], [2, 2, 3, 3]]


def test_fake_new_group(fake_nccl: FakeNccl) -> None:
    with _backends(2, dist.HashStore(), timeout=5) as backends:

        def groups(be: Any) -> tuple[Any, ...]:
            subs = [be.new_group([0]), be.new_group([1]), be.new_group([0, 1])]
            mine = [s for s in subs[:2] if s is not None]
            assert len(mine) == 1 and subs[1 - be.rank] is None
            t = torch.ones(1) * (be.rank + 1)
            subs[2].all_reduce(t)
            result = (mine[0].ranks, mine[0].rank, mine[0].world_size, subs[2].ranks, t.item())
            for s in (mine[0], subs[2]):
                s.close()
            return result

        r0, r1 = _on_ranks(backends, groups)
    assert r0 == ((0,), 0, 1, (0, 1), 3.0) and r1 == ((1,), 0, 1, (0, 1), 3.0)


def test_fake_refuses_bad_input_before_communicating(fake_nccl: FakeNccl) -> None:
    with _backends(1, dist.HashStore(), timeout=5) as (be,):
        calls = list(be.communicator.calls)
        with pytest.raises(TypeError, match="bool only for all-gather and broadcast"):
            be.all_reduce(torch.ones(2, dtype=torch.bool))
        with pytest.raises(TypeError, match="premul_sum needs a floating-point dtype"):
            be.all_reduce(torch.ones(2, dtype=torch.int32), op=ReduceOp.premul_sum(2.0))
        with pytest.raises(ValueError, match="world_size"):
            be.all_gather_into_tensor(torch.empty(3), torch.empty(2))
        assert be.communicator.calls == calls
        flags = torch.tensor([True, False])
        out = torch.zeros(2, dtype=torch.bool)
        be.all_gather_into_tensor(out, flags)
        assert out.tolist() == [True, False]
        empty = be.all_reduce(torch.empty(0), async_op=True)
        assert empty is not None and empty.is_completed()  # empty: no NCCL call
        assert be.communicator.calls == calls + ["allGather"]


def _eventually(predicate: Callable[[], bool], within: float = 2.0) -> None:
    deadline = time.monotonic() + within
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.005)


def test_fake_collective_that_never_completes(fake_nccl: FakeNccl) -> None:
    with _backends(1, dist.HashStore(), timeout=0.3) as (be,):
        fake_nccl.hang_events = True
        t0 = time.monotonic()
        work = be.all_gather_into_tensor(torch.empty(2), torch.ones(2), async_op=True)
        assert isinstance(work, EventWork)
        be.all_reduce(torch.ones(2))  # synchronous calls are watched too
        with pytest.raises(CommTimeoutError) as info:
            work.synchronize()
        assert time.monotonic() - t0 < 3
        assert "all_gather_into_tensor on rank 0 of group ranks [0]" in str(info.value)
        _eventually(lambda: be.communicator.aborted)  # the error is published just before
        with pytest.raises(CommTimeoutError, match=r"broadcast on rank 0 .* refused"):
            be.broadcast(torch.ones(1), src=0)
        with pytest.raises(CommTimeoutError):
            work.wait()


def test_fake_call_blocked_inside_nccl_is_aborted(fake_nccl: FakeNccl) -> None:
    """A call that blocks in NCCL (say, connecting to a dead peer) is unblocked by the abort."""
    with _backends(1, dist.HashStore(), timeout=0.3) as (be,):
        fake_nccl.block_calls = True
        t0 = time.monotonic()
        with pytest.raises(CommTimeoutError, match="reduce_scatter_tensor on rank 0"):
            be.reduce_scatter_tensor(torch.empty(2), torch.ones(2))
        assert time.monotonic() - t0 < 3


def test_fake_creation_times_out_when_a_member_never_joins(fake_nccl: FakeNccl) -> None:
    store = dist.HashStore()
    t0 = time.monotonic()
    with pytest.raises(CommTimeoutError, match="rank 1 of group ranks \\[0, 1\\]"):
        cb.CupyNcclBackend(store=store, rank=1, world_size=2, timeout=0.3)
    assert time.monotonic() - t0 < 3


def test_rank_and_world_size_resolution(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert cb._resolve_rank(None, None) == (0, 1)
    with pytest.raises(ValueError, match="needs rank="):
        cb._resolve_rank(None, 2)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert cb._resolve_rank(None, None) == (3, 4)
    assert cb._resolve_rank(1, 2) == (1, 2)
    with pytest.raises(ValueError, match="0 <= rank < world_size"):
        cb._resolve_rank(2, 2)


def test_cpu_device_is_refused() -> None:
    with pytest.raises(ValueError, match="CUDA devices only"):
        cb._resolve_device("cpu", 0)


# ---- real NCCL on GPUs -----------------------------------------------------------------------


def _need_gpus(n: int) -> None:
    pytest.importorskip("cupy")
    if not torch.cuda.is_available() or torch.cuda.device_count() < n:
        pytest.skip(f"needs {n} CUDA device(s)")


def gpu_battery(be: Any) -> dict[str, Any]:
    """Real collectives in fp32/bf16/fp16 (module level: ranks started by `launch` import it)."""
    w, r, dev = be.world_size, be.rank, be.device
    got: dict[str, Any] = {}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        key = str(dtype).removeprefix("torch.")
        out = torch.empty(3 * w, dtype=dtype, device=dev)
        be.all_gather_into_tensor(out, torch.full((3,), r + 1.0, dtype=dtype, device=dev))
        got[f"ag_{key}"] = out.tolist()
        inp = torch.arange(4.0 * w, device=dev).to(dtype) + 2 * r
        for name, op in (
            ("sum", ReduceOp.SUM),
            ("avg", ReduceOp.AVG),
            ("max", ReduceOp.MAX),
            ("premul", ReduceOp.premul_sum(0.5)),
        ):
            o = torch.empty(4, dtype=dtype, device=dev)
            be.reduce_scatter_tensor(o, inp, op=op, async_op=True).wait()
            got[f"rs_{name}_{key}"] = o.tolist()
        got[f"input_kept_{key}"] = inp.tolist() == (torch.arange(4.0 * w) + 2 * r).tolist()
        t = torch.full((5,), r + 1.0, dtype=dtype, device=dev)
        work = be.all_reduce(t, async_op=True)
        work.synchronize()
        got[f"ar_{key}"] = (t.tolist(), work.is_completed())
    b = torch.full((2,), float(r), device=dev)
    be.broadcast(b, src=w - 1)
    got["bcast"] = b.tolist()
    side = torch.cuda.Stream(dev)
    outs = [torch.empty(2 * w, device=dev) for _ in range(3)]
    with be.coalesce():
        works = [
            be.all_gather_into_tensor(o, torch.full((2,), float(r + i), device=dev), async_op=True)
            for i, o in enumerate(outs)
        ]
    for wk in works:
        wk.wait_stream(side)
    with torch.cuda.stream(side):
        got["coalesced"] = torch.stack(outs).sum().item()
    be.barrier()
    return got


def _check_gpu_battery(got: dict[str, Any], w: int, r: int) -> None:
    for key in ("float32", "bfloat16", "float16"):
        assert got[f"ag_{key}"] == [float(i // 3 + 1) for i in range(3 * w)]
        full = [w * i + 2.0 * sum(range(w)) for i in range(4 * w)]
        mine = full[4 * r : 4 * r + 4]
        assert got[f"rs_sum_{key}"] == mine
        assert got[f"rs_avg_{key}"] == [v / w for v in mine]
        assert got[f"rs_premul_{key}"] == [v / 2 for v in mine]
        assert got[f"rs_max_{key}"] == [float(i + 2 * (w - 1)) for i in range(4 * r, 4 * r + 4)]
        assert got[f"input_kept_{key}"]
        assert got[f"ar_{key}"] == ([float(sum(range(1, w + 1)))] * 5, True)
    assert got["bcast"] == [float(w - 1)] * 2
    assert got["coalesced"] == sum(2 * (q + i) for i in range(3) for q in range(w))


@pytest.mark.gpu
def test_gpu_world_of_one_in_process() -> None:
    _need_gpus(1)
    with cb.CupyNcclBackend(rank=0, world_size=1, device="cuda:0", timeout=30) as be:
        _check_gpu_battery(gpu_battery(be), 1, 0)
        assert be.nccl_version >= (2, 10, 0) and be.capabilities["avg"] == "native ncclAvg"
        sub = be.new_group([0])
        assert sub is not None
        t = torch.ones(3, device="cuda:0")
        sub.all_reduce(t, op=ReduceOp.premul_sum(2.0))
        assert t.tolist() == [2.0] * 3
        sub.close()


@pytest.mark.gpu
def test_gpu_world_of_two() -> None:
    _need_gpus(2)
    results = fsdp_comm.launch(gpu_battery, 2, backend="cupy-nccl", timeout=120)
    for r, got in enumerate(results):
        _check_gpu_battery(got, 2, r)


def gpu_skip_collective(be: Any) -> str:
    if be.rank == 1:
        time.sleep(be.timeout + 1)
        return "slept"
    t0 = time.monotonic()
    be.all_reduce(torch.ones(4, device=be.device))
    try:
        be.barrier()
    except CommError as exc:
        return f"{type(exc).__name__} after {time.monotonic() - t0:.1f}s: {exc}"
    return "no error"


@pytest.mark.gpu
def test_gpu_collective_that_never_completes() -> None:
    _need_gpus(2)
    results = fsdp_comm.launch(
        gpu_skip_collective, 2, backend="cupy-nccl", timeout=60, backend_options={"timeout": 3.0}
    )
    assert results[1] == "slept"
    assert results[0].startswith("CommTimeoutError"), results[0]
    assert "all_reduce" in results[0] and "[0, 1]" in results[0]
