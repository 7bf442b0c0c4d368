"""`launch`: results in rank order, errors with the rank named, every start method, the root
cause raised when several ranks fail, and a rank's sys.exit reported as a failure."""

from __future__ import annotations

import errno
import itertools
import sys
import threading
import time

import pytest
import torch
from fsdp_comm import Backend, CommError, ReduceOp, TorchBackend, launch
from fsdp_comm._failures import DEATH, ECHO, OWN, RankFailure, pick_root, standing

from . import ranks


@pytest.mark.parametrize("backend", ["torch", "threads", "fake"])
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_results_come_back_in_rank_order(backend: str, world_size: int) -> None:
    results = launch(ranks.return_tensor, world_size, backend=backend, args=(3,), timeout=60)
    assert [r["rank"] for r in results] == list(range(world_size))
    for rank, r in enumerate(results):
        assert torch.equal(r["t"], torch.full((3,), float(rank)))


@pytest.mark.parametrize("start_method", ["spawn", "fork"])
def test_other_start_methods(start_method: str) -> None:
    results = launch(ranks.return_tensor, 2, args=(1,), timeout=120, start_method=start_method)
    assert [r["ranks"] for r in results] == [(0, 1), (0, 1)]


def test_large_tensor_result() -> None:
    results = launch(ranks.return_tensor, 2, args=(1 << 22,), timeout=60)  # 16 MiB per rank
    assert results[1]["t"].sum().item() == float(1 << 22)


@pytest.mark.parametrize("backend", ["torch", "threads", "fake"])
def test_exception_keeps_its_type_and_names_the_rank(backend: str) -> None:
    with pytest.raises(ValueError, match=r"^\[rank 1\] bad input on purpose") as info:
        launch(ranks.raise_on_rank, 2, backend=backend, args=(1,), timeout=60)
    notes = "".join(getattr(info.value, "__notes__", []))
    assert "raised on rank 1" in notes and "raise_on_rank" in notes


def test_unpicklable_function_is_refused_for_forkserver() -> None:
    with pytest.raises(TypeError, match="picklable.*start_method='fork'"):
        launch(lambda be: 1, 2)


def test_closure_runs_with_fork() -> None:
    offset = 10
    assert launch(lambda be: be.rank + offset, 2, start_method="fork", timeout=60) == [10, 11]


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_world_size_is_validated(bad) -> None:
    with pytest.raises(ValueError, match="world_size must be an int >= 1"):
        launch(ranks.return_tensor, bad, args=(1,))


def test_torch_backend_uses_new_collective_names_without_warnings() -> None:
    for warnings_seen in launch(ranks.collect_warnings, 2, timeout=60):
        assert not [w for w in warnings_seen if "FutureWarning" in w], warnings_seen


def test_torch_backend_reports_gloo_algorithms() -> None:
    caps = launch(ranks.capabilities, 2, timeout=60)[0]
    assert "pairwise exchange" in caps["all_gather_into_tensor"]
    assert "pairwise exchange" in caps["reduce_scatter_tensor"]
    assert "gloo lacks it" in caps["premul_sum"]


def test_torch_backend_starts_alone_without_torchrun_environment(monkeypatch) -> None:
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)

    def body(be):
        alone = TorchBackend()
        try:
            t = torch.ones(3)
            alone.all_reduce(t)
            return alone.world_size, t.tolist()
        finally:
            alone.close()

    assert launch(body, 1, backend="fake", timeout=60) == [(1, [1.0, 1.0, 1.0])]


# ---- several ranks fail: the root cause is raised ----------------------------------------------
# Rank functions live at module level so that forkserver ranks can import them.
def disk_full_then_peer_fails(be: Backend) -> int:
    """Rank 1 fails; rank 0 then fails with the CommError of the ended group, wrapped."""
    if be.rank == 1:
        raise ValueError("disk full")
    try:
        be.all_reduce(torch.ones(1))
    except CommError as exc:
        raise RuntimeError("training step failed") from exc
    return be.rank


def echo_reported_first(be: Backend, echo: str) -> int:
    """Rank 1's disk is full; rank 0 learns it through an agreement all-reduce (as fsdp-ckpt
    does) and raises its echo at once, while rank 1 is still busy for 0.5 s: the echo always
    reaches `launch` first."""
    failed = torch.tensor([1.0 if be.rank == 1 else 0.0])
    be.all_reduce(failed, op=ReduceOp.MAX)
    if be.rank == 1:
        time.sleep(0.5)
        raise OSError(errno.ENOSPC, "No space left on device", "/ckpt/rank1.bin")
    if echo == "text":
        raise ValueError(
            "save abandoned: another rank failed to write its files (its error is raised there)"
        )
    try:
        raise CommError("all_reduce: the group was ended")
    except CommError as exc:
        raise RuntimeError("save abandoned") from exc


def own_errors_on_two_ranks(be: Backend) -> int:
    """Rank 1 fails at once, rank 0 for its own reason 0.5 s later."""
    if be.rank == 0:
        time.sleep(0.5)
    raise KeyError(f"rank {be.rank} broke")


def exit_on_rank(be: Backend, code: object) -> int:
    if be.rank == 1:
        sys.exit(code)
    return be.rank


def _notes(exc: BaseException) -> str:
    return "\n".join(getattr(exc, "__notes__", []))


@pytest.mark.parametrize("backend", ["torch", "threads"])
def test_root_cause_beats_the_error_a_peer_raised_because_of_it(backend: str) -> None:
    for _ in range(3):  # the same answer every run
        with pytest.raises(ValueError) as info:
            launch(disk_full_then_peer_fails, 2, backend=backend, timeout=60)
        assert str(info.value) == "[rank 1] disk full"
        assert "rank 0" in _notes(info.value)  # the echo is kept, or the rank named as ended


@pytest.mark.parametrize("echo", ["text", "chained"])
@pytest.mark.parametrize("backend", ["torch", "threads"])
def test_an_echo_that_reports_first_does_not_hide_the_cause(backend: str, echo: str) -> None:
    with pytest.raises(OSError) as info:
        launch(echo_reported_first, 2, backend=backend, args=(echo,), timeout=60)
    assert info.value.errno == errno.ENOSPC
    assert str(info.value) == (
        f"[Errno {errno.ENOSPC}] [rank 1] No space left on device: '/ckpt/rank1.bin'"
    )
    assert "rank 0 also failed, as a consequence" in _notes(info.value)
    assert "save abandoned" in _notes(info.value)


@pytest.mark.parametrize("backend", ["torch", "threads"])
def test_own_errors_on_several_ranks_raise_the_lowest_rank(backend: str) -> None:
    with pytest.raises(KeyError, match=r"\[rank 0\] rank 0 broke") as info:
        launch(own_errors_on_two_ranks, 2, backend=backend, timeout=60)
    assert "rank 1 also failed: KeyError: 'rank 1 broke'" in _notes(info.value)


def _failure(rank: int, standing: int) -> RankFailure:
    return RankFailure(rank, standing, f"Error: rank {rank}", "")


def test_root_choice_does_not_depend_on_report_order() -> None:
    failures = [
        _failure(0, ECHO),
        _failure(1, DEATH),
        _failure(3, OWN),
        _failure(2, OWN),
        _failure(4, ECHO),
    ]
    for order in itertools.permutations(failures):
        root, others = pick_root(order)
        assert root.rank == 2
        assert [f.rank for f in others] == [3, 1, 0, 4]


def test_echoes_are_told_from_causes() -> None:
    def chained() -> BaseException:
        try:
            raise CommError("all_gather_into_tensor: connection closed")
        except CommError:
            try:
                raise RuntimeError("forward failed")
            except RuntimeError as exc:
                return exc

    for exc in [
        CommError("peer died"),
        chained(),
        ValueError("load abandoned: another rank could not read or verify its files"),
        RuntimeError("Connection closed by peer [127.0.0.1]:4242"),
    ]:
        assert standing(exc) == ECHO, exc
    for exc in [
        ValueError("disk full"),
        OSError(errno.ENOSPC, "No space left on device"),
        ValueError("file /ckpt/0.bin is corrupt: checksum mismatch"),
        RuntimeError("[rank 1] called sys.exit(0)"),
    ]:
        assert standing(exc) == OWN, exc


# ---- a rank's sys.exit -------------------------------------------------------------------------
@pytest.mark.parametrize("code", [0, 3])
@pytest.mark.parametrize("backend", ["torch", "threads", "fake"])
def test_sys_exit_in_a_rank_is_an_error_naming_the_rank(backend: str, code: int) -> None:
    with pytest.raises(RuntimeError, match=rf"^\[rank 1\] called sys.exit\({code}\)") as info:
        launch(exit_on_rank, 2, backend=backend, args=(code,), timeout=60)
    assert "exit_on_rank" in _notes(info.value)  # the rank's traceback shows where it exited


def _async_reduce_scatter(be: Backend) -> None:
    out = torch.empty(4)
    be.reduce_scatter_tensor(out, torch.ones(4 * be.world_size), async_op=True).wait()


def test_a_threads_launch_leaves_no_worker_thread_behind() -> None:
    # A daemon worker still in a torch call at interpreter exit aborts the process
    # ("terminate called without an active exception"; fsdp_comm's _serial_worker.py).
    before = set(threading.enumerate())  # other tests' backends may still hold theirs
    launch(_async_reduce_scatter, 2, backend="threads")
    left = [t.name for t in set(threading.enumerate()) - before if t.name.startswith("fsdp-")]
    assert not left, left
