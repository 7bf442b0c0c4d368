"""Stream-ordered waits on NCCL groups (Note [stream-ordered waits] in
fsdp_comm/_torch_backend.py), without a GPU: the torch backend runs over an in-process gloo
world of one, told that its group is NCCL, with its torch collective replaced by a fake whose
work finishes when the test says (as asv_bench/benchmarks/gate.py::comm_call replaces
``_ALL_GATHER``), and the group's abort recorded instead of done. The last test runs one real
NCCL all-gather where there is a GPU."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import fsdp_comm._torch_backend as tb
import fsdp_comm._torch_work as tw
import pytest
import torch
import torch.distributed as dist
from fsdp_comm import CommError, CommTimeoutError, TorchBackend
from fsdp_comm._nccl_watchdog import Watchdog

pytestmark = pytest.mark.timeout(60)

_SUCCESS, _TIMEOUT, _COMM_ERROR = 0, 1, 2  # torch's WorkResult codes
_QUICK_S = 0.5  # a wait that does not block returns well within this
_DEADLINE_S = 10.0  # how long a test waits for the watchdog before failing


class FakeFuture:
    def __init__(self, work: FakeTorchWork) -> None:
        self._work = work

    def done(self) -> bool:
        return self._work.is_completed()

    def value(self) -> int:
        assert self._work.result is not None
        return self._work.result


class FakeTorchWork:
    """A torch work, unfinished until `finish`. ``wait(timeout)`` blocks the caller until it
    finishes, as ProcessGroupNCCL's host wait does; ``wait()`` returns at once (stream-ordered:
    on a GPU the current stream would wait)."""

    def __init__(self) -> None:
        self.waits: list[tuple[Any, ...]] = []
        self.wait_error: Exception | None = None
        self.result: int | None = None
        self._finished = threading.Event()

    def finish(self, result: int = _SUCCESS) -> None:
        self.result = result
        self._finished.set()

    def is_completed(self) -> bool:
        return self._finished.is_set()

    def wait(self, *args: Any) -> bool:
        self.waits.append(args)
        if self.wait_error is not None:
            raise self.wait_error
        if args:
            return self._finished.wait(args[0].total_seconds())
        return True

    def get_future_result(self) -> FakeFuture:
        return FakeFuture(self)

    def get_future(self) -> Any:
        raise RuntimeError("no future")


class FakeCollective:
    """Stands in for a torch.distributed collective: records its keyword arguments and returns
    a new `FakeTorchWork`."""

    def __init__(self) -> None:
        self.works: list[FakeTorchWork] = []
        self.kwargs: list[dict[str, Any]] = []

    def __call__(self, *args: Any, **kwargs: Any) -> FakeTorchWork:
        self.kwargs.append(kwargs)
        work = FakeTorchWork()
        self.works.append(work)
        return work


class World:
    """The patched module state of one test and the backends it made."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, nccl: bool) -> None:
        self.all_gather = FakeCollective()
        self.all_reduce = FakeCollective()
        self.aborted: list[Any] = []
        self.backends: list[TorchBackend] = []
        monkeypatch.setattr(tb, "stream_ordered_waits", lambda group, device: nccl)
        monkeypatch.setattr(tw, "abort_group", self.aborted.append)
        monkeypatch.setattr(tb, "_ALL_GATHER", self.all_gather)
        monkeypatch.setattr(dist, "all_reduce", self.all_reduce)

    def backend(self, timeout: float = 30.0) -> TorchBackend:
        be = TorchBackend(timeout=timeout)
        self.backends.append(be)
        return be


def _world(monkeypatch: pytest.MonkeyPatch, nccl: bool) -> Iterator[World]:
    world = World(monkeypatch, nccl=nccl)
    yield world
    for be in world.backends:
        be.close()


@pytest.fixture
def nccl_world(monkeypatch: pytest.MonkeyPatch) -> Iterator[World]:
    yield from _world(monkeypatch, True)


@pytest.fixture
def gloo_world(monkeypatch: pytest.MonkeyPatch) -> Iterator[World]:
    yield from _world(monkeypatch, False)


def _gather(be: TorchBackend, *, async_op: bool = True) -> Any:
    return be.all_gather_into_tensor(torch.empty(4), torch.ones(4), async_op=async_op)


def _until(condition: Callable[[], bool], deadline_s: float = _DEADLINE_S) -> None:
    end = time.monotonic() + deadline_s
    while not condition():
        assert time.monotonic() < end, "condition not reached before the test's deadline"
        time.sleep(0.005)


# ---- deciding ------------------------------------------------------------------------------
def test_only_nccl_groups_on_cuda_are_stream_ordered(monkeypatch: pytest.MonkeyPatch) -> None:
    names = {"nccl": "nccl", "mixed": "cpu:gloo,cuda:nccl", "gloo": "gloo"}
    monkeypatch.setattr(dist, "get_backend", lambda group: names[group])
    monkeypatch.delenv("TORCH_NCCL_BLOCKING_WAIT", raising=False)
    monkeypatch.delenv("NCCL_BLOCKING_WAIT", raising=False)
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert tw.stream_ordered_waits("nccl", cuda) and tw.stream_ordered_waits("mixed", cuda)
    assert not tw.stream_ordered_waits("gloo", cuda)  # Note [gloo on CUDA]
    assert not tw.stream_ordered_waits("mixed", cpu)  # CPU tensors go over gloo
    monkeypatch.setenv("TORCH_NCCL_BLOCKING_WAIT", "1")
    assert not tw.stream_ordered_waits("nccl", cuda)  # torch blocks the host anyway
    assert tw.group_timeout(5.0, nccl=True) == datetime.timedelta(seconds=5)
    monkeypatch.setenv("TORCH_NCCL_BLOCKING_WAIT", "0")
    assert tw.stream_ordered_waits("nccl", cuda)
    assert tw.group_timeout(5.0, nccl=True) == datetime.timedelta(
        seconds=5 + tw.NCCL_GROUP_TIMEOUT_GRACE_S
    )
    assert tw.group_timeout(5.0, nccl=False) == datetime.timedelta(seconds=5)


def test_a_gloo_world_keeps_host_waits() -> None:
    with TorchBackend() as be:
        assert be._watchdog is None
        assert "waits" not in be.capabilities


# ---- (a) waits do not block the host -------------------------------------------------------
def test_nccl_wait_does_not_block_and_passes_no_timeout(nccl_world: World) -> None:
    be = nccl_world.backend()
    assert be._watchdog is not None
    work = _gather(be)
    fake = nccl_world.all_gather.works[-1]
    assert nccl_world.all_gather.kwargs[-1]["async_op"] is True
    t0 = time.monotonic()
    work.wait()
    work.wait()  # every wait orders its own current stream: torch is asked each time
    work.wait_stream(None)
    assert time.monotonic() - t0 < _QUICK_S
    assert fake.waits == [(), (), ()]  # never a timeout: that would block the host
    assert not work.is_completed()
    fake.finish()
    assert work.is_completed()


def test_nccl_synchronous_call_is_issued_async_and_waited_on_the_stream(
    nccl_world: World,
) -> None:
    be = nccl_world.backend()
    t0 = time.monotonic()
    assert _gather(be, async_op=False) is None
    assert time.monotonic() - t0 < _QUICK_S
    assert nccl_world.all_gather.kwargs[-1]["async_op"] is True  # so the watchdog sees it
    assert nccl_world.all_gather.works[-1].waits == [()]


def test_nccl_barrier_still_blocks_the_host(nccl_world: World) -> None:
    be = nccl_world.backend()
    threading.Timer(0.2, lambda: nccl_world.all_reduce.works[-1].finish()).start()
    t0 = time.monotonic()
    be.barrier()
    assert time.monotonic() - t0 >= 0.15
    assert nccl_world.all_reduce.works[-1].is_completed()


# ---- (b) the watchdog turns an overdue collective into CommTimeoutError --------------------
def test_watchdog_times_out_an_overdue_collective_and_aborts_once(nccl_world: World) -> None:
    be = nccl_world.backend(timeout=0.3)
    done = _gather(be)
    nccl_world.all_gather.works[-1].finish()
    done.wait()
    stuck = _gather(be)
    t0 = time.monotonic()
    stuck.wait()  # returns: the host is not blocked while the collective runs
    assert time.monotonic() - t0 < _QUICK_S
    watchdog = be._watchdog
    assert watchdog is not None
    _until(lambda: watchdog.error is not None)
    assert nccl_world.aborted == [be.group]
    assert stuck.is_completed()  # pollers move on to wait(), which raises
    with pytest.raises(
        CommTimeoutError,
        match=r"all_gather_into_tensor on rank 0 of group "
        r"ranks \[0\] did not complete within 0.3 s \(FSDP_COMM_TIMEOUT\)",
    ):
        stuck.wait()
    with pytest.raises(CommTimeoutError, match="NCCL process group was aborted"):
        done.wait()  # every wait of the backend fails from now on
    calls_before = len(nccl_world.all_gather.works)
    with pytest.raises(CommTimeoutError, match=r"all_gather_into_tensor on rank 0 .* refused"):
        _gather(be)
    with pytest.raises(CommTimeoutError, match="all_reduce on rank 0 .* refused"):
        be.all_reduce(torch.ones(2))
    with pytest.raises(CommTimeoutError, match="barrier on rank 0 .* refused"):
        be.barrier()
    with pytest.raises(CommTimeoutError, match="new_group on rank 0 .* refused"):
        be.new_group([0])
    assert len(nccl_world.all_gather.works) == calls_before  # refused before torch is called
    time.sleep(0.05)  # more polls
    assert nccl_world.aborted == [be.group]


def test_barrier_on_a_hung_group_raises_within_the_timeout(nccl_world: World) -> None:
    be = nccl_world.backend(timeout=0.3)
    t0 = time.monotonic()
    with pytest.raises(CommTimeoutError, match="barrier on rank 0 of group ranks"):
        be.barrier()
    assert time.monotonic() - t0 < 5
    assert len(nccl_world.aborted) == 1


# ---- (c) a collective that completed with an error -----------------------------------------
def test_work_completed_with_an_error_surfaces_as_comm_error(nccl_world: World) -> None:
    be = nccl_world.backend()
    work = _gather(be)
    nccl_world.all_gather.works[-1].finish(_COMM_ERROR)
    watchdog = be._watchdog
    assert watchdog is not None
    _until(lambda: watchdog.error is not None)
    assert type(watchdog.error) is CommError
    assert "all_gather_into_tensor on rank 0 of group ranks [0] failed" in str(watchdog.error)
    assert "COMM_ERROR" in str(watchdog.error)
    assert len(nccl_world.aborted) == 1
    with pytest.raises(CommError, match="COMM_ERROR"):
        work.wait()
    with pytest.raises(CommError, match="refused"):
        be.all_reduce(torch.ones(2))


def test_work_timed_out_by_torch_is_a_timeout(nccl_world: World) -> None:
    be = nccl_world.backend()
    _gather(be)
    nccl_world.all_gather.works[-1].finish(_TIMEOUT)
    watchdog = be._watchdog
    assert watchdog is not None
    _until(lambda: watchdog.error is not None)
    assert isinstance(watchdog.error, CommTimeoutError) and "TIMEOUT" in str(watchdog.error)


def test_torch_wait_raising_fails_the_backend(nccl_world: World) -> None:
    be = nccl_world.backend()
    work = _gather(be)
    fake = nccl_world.all_gather.works[-1]
    fake.wait_error = RuntimeError("NCCL error: remote process exited or there was a network error")
    with pytest.raises(
        CommError,
        match=r"all_gather_into_tensor on rank 0 of group ranks "
        r"\[0\] failed: NCCL error: remote process exited",
    ) as info:
        work.wait()
    assert type(info.value) is CommError
    assert len(nccl_world.aborted) == 1
    with pytest.raises(CommError, match="refused"):
        _gather(be)
    with pytest.raises(CommError, match="remote process exited"):
        work.wait()
    assert len(nccl_world.aborted) == 1


def test_watchdog_drops_a_completed_work_at_the_next_call() -> None:
    """What a finished collective holds (a torch work holds its tensors) is released by the
    next call, without waiting for the watchdog's poll (this watchdog never polls)."""

    class Comm:
        def check_async_error(self) -> None:
            return None

        def abort(self) -> None:
            raise AssertionError("nothing failed")

    watchdog = Watchdog(Comm(), timeout=60, rank=0, ranks=(0,))
    fake = FakeTorchWork()
    gone = weakref.ref(fake)
    watchdog.attach(watchdog.begin("all_gather_into_tensor"), tw.WorkEvent(fake))
    fake.finish()
    del fake
    assert gone() is not None  # still watched
    watchdog.begin("reduce_scatter_tensor")
    assert gone() is None


# ---- (d) gloo keeps its host waits ---------------------------------------------------------
def test_gloo_mode_still_waits_on_the_host_with_the_timeout(gloo_world: World) -> None:
    be = gloo_world.backend(timeout=7.0)
    assert be._watchdog is None
    work = _gather(be)
    fake = gloo_world.all_gather.works[-1]
    fake.finish()
    work.wait()
    assert fake.waits == [(datetime.timedelta(seconds=7.0),)]
    work.wait()  # waited for once
    assert len(fake.waits) == 1


def test_gloo_mode_times_out_on_the_host(gloo_world: World) -> None:
    be = gloo_world.backend(timeout=7.0)
    work = _gather(be)
    t0 = time.monotonic()
    with pytest.raises(CommTimeoutError, match="timed out after 0.2 s"):
        work.wait(timeout=0.2)
    assert 0.15 <= time.monotonic() - t0 < 5
    assert gloo_world.all_gather.works[-1].waits == [(datetime.timedelta(seconds=0.2),)]
    assert gloo_world.aborted == []


# ---- one real NCCL all-gather --------------------------------------------------------------
_NCCL_SCRIPT = r"""
import time
import torch
import torch.distributed as dist
from fsdp_comm import TorchBackend

torch.cuda.set_device(0)
dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
be = TorchBackend(device="cuda:0", timeout=60)
assert be._watchdog is not None, be.capabilities
inp = torch.arange(1 << 20, dtype=torch.float32, device="cuda")
out = torch.empty_like(inp)
be.all_gather_into_tensor(out, inp)  # NCCL connects lazily, at the first collective
torch.cuda.synchronize()
torch.cuda._sleep(2_000_000_000)  # about a second of GPU time queued before the collective
src = inp + 1
work = be.all_gather_into_tensor(out, src, async_op=True)
t0 = time.monotonic()
work.wait()
waited = time.monotonic() - t0
completed_at_wait = work.is_completed()
torch.cuda.synchronize()
assert waited < 0.25, f"wait() blocked the host for {waited:.3f} s"
assert not completed_at_wait, "the collective finished before the queued sleep did"
assert work.is_completed() and torch.equal(out, src)
be.close()
dist.destroy_process_group()
print(f"OK waited {waited * 1e3:.2f} ms")
"""


@pytest.mark.gpu
@pytest.mark.skipif(
    not (torch.cuda.is_available() and dist.is_nccl_available()), reason="needs CUDA and NCCL"
)
def test_real_nccl_wait_returns_before_the_collective_finished() -> None:
    env = {
        k: v
        for k, v in os.environ.items()
        if k
        not in (
            "RANK",
            "WORLD_SIZE",
            "LOCAL_RANK",
            "MASTER_ADDR",
            "MASTER_PORT",
            "TORCH_NCCL_BLOCKING_WAIT",
            "NCCL_BLOCKING_WAIT",
        )
    }
    done = subprocess.run(
        [sys.executable, "-c", _NCCL_SCRIPT], env=env, capture_output=True, text=True, timeout=50
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "OK waited" in done.stdout
