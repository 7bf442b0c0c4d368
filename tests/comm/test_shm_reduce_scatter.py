"""Reduce-scatter and asynchronous all-gather through shared memory (Note [shared-memory
collectives without gloo] in fsdp_comm/_shm_collectives.py): results against torch.distributed's
own collectives, the path actually taken, several calls in flight, growth, and timeouts."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from fsdp_comm import CommTimeoutError, ReduceOp, launch
from fsdp_comm._shm_collectives import stores_are_ordered

pytestmark = pytest.mark.skipif(
    not stores_are_ordered(), reason="the flag protocol runs only where stores are ordered"
)

_SHM = {"all_gather_shm_min_bytes": 0, "reduce_scatter_shm_min_bytes": 0}
_OUT_NUMEL = 1003  # odd: chunks do not fall on any alignment


def _inputs(be: Any, dtype: torch.dtype, call: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * be.rank + call)
    return torch.randn(_OUT_NUMEL * be.world_size, generator=g).to(dtype)


def _reference(be: Any, inp: torch.Tensor, op: ReduceOp) -> torch.Tensor:
    """torch.distributed's reduce-scatter of ``inp`` (a pre-multiplied sum as the sum of the
    scaled input, an average as the sum divided: what gloo offers), in float32."""
    src = inp.float()
    if op.kind.name == "PREMUL_SUM":
        src = src * op.factor
    want = torch.empty(_OUT_NUMEL)
    dist.reduce_scatter_tensor(want, src, group=be.group)
    return want / be.world_size if op.kind.name == "AVG" else want


def reduce_scatter_cases(be: Any) -> dict[str, Any]:
    errors: dict[str, float] = {}
    call = 0
    for dtype in (torch.float32, torch.bfloat16):
        for op in (ReduceOp.premul_sum(0.37), ReduceOp.AVG, ReduceOp.SUM, ReduceOp.MAX):
            call += 1
            inp = _inputs(be, dtype, call)
            before = inp.clone()
            out = torch.empty(_OUT_NUMEL, dtype=dtype)
            work = be.reduce_scatter_tensor(out, inp, op=op, async_op=True)
            work.wait()
            assert torch.equal(inp, before), "the input was changed"
            if op.kind.name == "MAX":
                parts = [torch.empty_like(inp) for _ in range(be.world_size)]
                dist.all_gather(parts, inp, group=be.group)
                want = torch.stack([p.view(be.world_size, -1)[be.rank] for p in parts]).amax(0)
                errors[f"{dtype}-{op}"] = (out.float() - want.float()).abs().max().item()
            else:
                want = _reference(be, inp, op)
                errors[f"{dtype}-{op}"] = (out.float() - want).abs().max().item()
    return {"errors": errors, "calls": be.shared_memory_reduce_scatters}


@pytest.mark.parametrize("world_size", [2, 4])
def test_reduce_scatter_matches_torch(world_size: int) -> None:
    results = launch(
        reduce_scatter_cases, world_size, backend_options=_SHM, threads_per_rank=1, timeout=300
    )
    for r in results:
        assert r["calls"] == 8  # every call took the shared-memory path
        for case, err in r["errors"].items():
            tol = 0.05 if "bfloat16" in case else 1e-5
            assert err <= tol, (case, err)


def in_flight(be: Any) -> dict[str, Any]:
    """Three gathers and three reduce-scatters in flight at once, interleaved, waited in
    reverse order, growing the segments on the way: every result must be right."""
    works, checks = [], []
    for call, numel in enumerate((100, 5000, 300000)):  # 300000: both segments grow
        inp = torch.full((numel,), float(be.rank * 10 + call))
        out = torch.empty(numel * be.world_size)
        works.append(be.all_gather_into_tensor(out, inp, async_op=True))
        want = torch.cat([torch.full((numel,), float(r * 10 + call)) for r in range(be.world_size)])
        checks.append((out, want))
        rs_in = torch.arange(numel * be.world_size, dtype=torch.float32) + be.rank
        rs_out = torch.empty(numel)
        works.append(be.reduce_scatter_tensor(rs_out, rs_in, op=ReduceOp.SUM, async_op=True))
        full = sum(
            torch.arange(numel * be.world_size, dtype=torch.float32) + r
            for r in range(be.world_size)
        )
        checks.append((rs_out, full.view(be.world_size, -1)[be.rank]))
    for work in reversed(works):
        work.wait()
    ok = [torch.equal(got, want) for got, want in checks]
    return {
        "ok": ok,
        "gathers": be.shared_memory_all_gathers,
        "scatters": be.shared_memory_reduce_scatters,
    }


@pytest.mark.parametrize("world_size", [2, 4])
def test_calls_in_flight_and_growth(world_size: int) -> None:
    for r in launch(in_flight, world_size, backend_options=_SHM, threads_per_rank=1, timeout=300):
        assert all(r["ok"]), r["ok"]
        assert r["gathers"] == 3 and r["scatters"] == 3


def default_sizes(be: Any) -> dict[str, int]:
    """By default reduce-scatters from 4 MiB to 32 MiB of input go through shared memory: of
    1 MiB, 8 MiB and 64 MiB, only the 8 MiB one does."""
    for numel in (1 << 18, 1 << 21, 1 << 24):
        inp = torch.ones(numel)
        out = torch.empty(numel // be.world_size)
        be.reduce_scatter_tensor(out, inp, op=ReduceOp.AVG)
        assert torch.equal(out, torch.ones_like(out))
    return {"scatters": be.shared_memory_reduce_scatters}


def test_default_threshold() -> None:
    for r in launch(default_sizes, 2, threads_per_rank=1, timeout=300):
        assert r["scatters"] == 1


def late_peer(be: Any) -> str:
    """Rank 1 skips the second reduce-scatter: rank 0's wait must time out, naming it."""
    inp, out = torch.ones(2 * 64), torch.empty(64)
    be.reduce_scatter_tensor(out, inp)
    if be.rank == 1:
        time.sleep(4)
        return "skipped"
    t0 = time.monotonic()
    work = be.reduce_scatter_tensor(out, inp, async_op=True)
    try:
        work.wait()
    except CommTimeoutError as exc:
        return f"{time.monotonic() - t0:.1f} {exc}"
    return "no error"


def test_wait_times_out_naming_the_late_rank() -> None:
    outcome = launch(
        late_peer, 2, backend_options={**_SHM, "timeout": 2.0}, threads_per_rank=1, timeout=120
    )[0]
    seconds, _, message = outcome.partition(" ")
    assert message.startswith("reduce_scatter_tensor through shared memory"), outcome
    assert "ranks [1]" in message
    assert float(seconds) < 10


def bad_threshold(be: Any) -> str:
    from fsdp_comm._torch_backend import TorchBackend

    try:
        TorchBackend(be.group, reduce_scatter_shm_min_bytes=-1)
    except ValueError as exc:
        return str(exc)
    return "accepted"


def test_threshold_is_validated() -> None:
    message = launch(bad_threshold, 1, timeout=120)[0]
    assert message.startswith("reduce_scatter_shm_min_bytes must be an int >= 0"), message
