"""Failure behaviour: refused sizes, dead peers, collectives that never complete, debug checks.

None of these may hang: every wait below is bounded by FSDP_COMM_TIMEOUT or launch's timeout.
"""

from __future__ import annotations

import multiprocessing
import time

import pytest
import torch
from fsdp_comm import CommError, CommTimeoutError, ReduceOp, ThreadsBackend, launch

from . import ranks

PROCESS_AND_THREADS = ["torch", "threads"]


@pytest.mark.parametrize("backend", PROCESS_AND_THREADS)
def test_collective_that_never_completes_times_out(backend: str) -> None:
    results = launch(
        ranks.skip_collective, 2, backend=backend, timeout=30, backend_options={"timeout": 2.0}
    )
    assert results[1] == "slept"
    assert results[0].startswith("CommTimeoutError"), results[0]
    assert "all_reduce" in results[0] and "[0, 1]" in results[0]
    seconds = float(results[0].split(" after ")[1].split("s")[0])
    assert seconds < 10


@pytest.mark.parametrize("backend", PROCESS_AND_THREADS)
def test_async_wait_times_out(backend: str) -> None:
    results = launch(
        ranks.skip_async_collective,
        2,
        backend=backend,
        timeout=30,
        backend_options={"timeout": 2.0},
    )
    assert results[0].startswith("CommTimeoutError"), results[0]
    assert "all_gather_into_tensor" in results[0]


def test_timeout_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FSDP_COMM_TIMEOUT", "1.5")
    assert launch(ranks.read_env, 2, args=("FSDP_COMM_TIMEOUT",)) == ["1.5", "1.5"]
    results = launch(ranks.skip_collective, 2, backend="threads", timeout=30)
    assert results[0].startswith("CommTimeoutError")


def test_bad_timeout_setting_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FSDP_COMM_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="FSDP_COMM_TIMEOUT.*'soon'"):
        ThreadsBackend.create(2)


def test_peer_that_dies_mid_collective(tmp_path) -> None:
    report = tmp_path / "rank0.txt"
    t0 = time.monotonic()
    with pytest.raises(CommError, match=r"rank 1 exited \(exit code 3\)"):
        launch(
            ranks.die_mid_collective,
            2,
            args=(str(report),),
            timeout=60,
            backend_options={"timeout": 20.0},
        )
    assert time.monotonic() - t0 < 30
    # Rank 0 itself saw a CommError naming the collective (gloo reports the closed connection).
    if report.exists():
        text = report.read_text()
        assert text.startswith(("CommError", "CommTimeoutError")), text
        assert "all_reduce" in text


@pytest.mark.parametrize("backend", PROCESS_AND_THREADS)
def test_debug_mode_catches_size_mismatch(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FSDP_COMM_DEBUG", "1")
    results = launch(ranks.mismatched_sizes, 2, backend=backend, timeout=60)
    for text in results:
        assert "FSDP_COMM_DEBUG" in text and "all_gather_into_tensor" in text, text
        assert "input numel" in text and "rank 0: 4" in text and "rank 1: 5" in text


@pytest.mark.parametrize("backend", PROCESS_AND_THREADS)
def test_debug_mode_catches_dtype_mismatch(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FSDP_COMM_DEBUG", "1")
    results = launch(ranks.mismatched_dtypes, 2, backend=backend, timeout=60)
    for text in results:
        assert "dtype" in text and "torch.bfloat16" in text and "torch.float32" in text, text


@pytest.mark.parametrize("backend", PROCESS_AND_THREADS)
def test_wrong_output_size_is_refused_before_communication(backend: str) -> None:
    # One rank alone makes the bad call: if it communicated, its peer would hang or mismatch.
    def body(be):
        if be.rank == 0:
            with pytest.raises(ValueError, match="out must hold world_size"):
                be.all_gather_into_tensor(torch.empty(5), torch.ones(2))
            with pytest.raises(ValueError, match="inp must hold world_size"):
                be.reduce_scatter_tensor(torch.empty(2), torch.ones(5))
        t = torch.ones(1)
        be.all_reduce(t)
        return t.item()

    assert launch(
        body, 2, backend=backend, timeout=30, start_method="fork" if backend == "torch" else None
    ) == [2.0, 2.0]


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda be: be.all_reduce([1.0]), "tensor must be a torch.Tensor, got list"),
        (lambda be: be.all_reduce(torch.ones(4)[::2]), "must be contiguous"),
        (lambda be: be.all_reduce(torch.ones(2), op="sum"), "op must be an fsdp_comm.ReduceOp"),
        (lambda be: be.broadcast(torch.ones(2), src=2), r"src must be a rank of this group"),
        (
            lambda be: be.all_gather_into_tensor(torch.ones(2), torch.ones(1, dtype=torch.half)),
            "same dtype",
        ),
        (lambda be: be.all_reduce(torch.ones(2, device="meta")), "device cpu"),
        (lambda be: be.new_group([1, 0]), "sorted and unique"),
        (lambda be: be.new_group([]), "at least one rank"),
    ],
)
def test_bad_arguments_are_named(call, match: str) -> None:
    be = ThreadsBackend.create(2)[0]  # checks are local: no peer needed
    with pytest.raises((TypeError, ValueError), match=match):
        call(be)


def test_premul_factor_is_validated() -> None:
    with pytest.raises(ValueError, match="finite"):
        ReduceOp.premul_sum(float("nan"))
    with pytest.raises(TypeError, match="real number"):
        ReduceOp.premul_sum("2")


def test_threads_group_is_aborted_when_a_rank_fails() -> None:
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=r"\[rank 1\] bad input on purpose"):
        launch(ranks.raise_on_rank, 3, backend="threads", args=(1,), timeout=30)
    assert time.monotonic() - t0 < 5  # the blocked ranks were released, not timed out


def test_no_rank_outlives_launch() -> None:
    with pytest.raises(CommTimeoutError, match=r"ranks \[0, 1\] did not finish within 2 s"):
        launch(ranks.sleep_forever, 2, timeout=2)
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("fsdp-rank")]


def test_process_group_backend_is_checked() -> None:
    from fsdp_comm import TorchBackend

    with pytest.raises(ValueError, match="process_group_backend must be .* got 'mpi'"):
        TorchBackend(process_group_backend="mpi")


def _gloo_cuda_algorithms(be):
    """The broadcast/all-reduce algorithms of Note [gloo on CUDA], run on CPU tensors."""
    from fsdp_comm import ReduceOp

    be._gloo_cuda = True
    w, r = be.world_size, be.rank
    out = torch.empty(3 * w)
    be.all_gather_into_tensor(out, torch.arange(3.0) + 10 * r)
    rs = torch.empty(2)
    be.reduce_scatter_tensor(rs, torch.arange(2.0 * w) * (r + 1), op=ReduceOp.AVG)
    return out, rs


def test_gloo_on_cuda_algorithms() -> None:
    from fsdp_comm import launch

    w = 3
    for r, (out, rs) in enumerate(launch(_gloo_cuda_algorithms, w, timeout=120)):
        expected = torch.cat([torch.arange(3.0) + 10 * q for q in range(w)])
        torch.testing.assert_close(out, expected)
        scale = sum(q + 1 for q in range(w)) / w
        torch.testing.assert_close(rs, torch.arange(2.0 * w)[2 * r : 2 * r + 2] * scale)
