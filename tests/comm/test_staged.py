"""Staged collectives (Note [staged collectives] in fsdp_comm/_backend.py): an all-gather whose
result the caller copies out in its own order, a reduce-scatter whose input the caller copies
in. Every backend gives the same results as the plain collective followed (or preceded) by the
caller's copy; the torch backend's shared-memory path does it without a buffer of its own."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from fsdp_comm import ReduceOp, launch
from fsdp_comm._shm_collectives import stores_are_ordered

_SHM = {"all_gather_shm_min_bytes": 0, "reduce_scatter_shm_min_bytes": 0}
_NUMEL = 1003  # per rank: odd, so no chunk falls on an alignment


def _reverse_ranks(src: torch.Tensor, dst: torch.Tensor, world: int) -> None:
    """A reordering the plain collective does not make: the ranks' chunks reversed."""
    dst.view(world, -1).copy_(src.view(world, -1).flip(0))


def staged_cases(be: Any) -> dict[str, Any]:
    w, seen = be.world_size, {"out": 0, "in": 0}

    def copy_out(gathered: torch.Tensor, out: torch.Tensor) -> None:
        assert gathered.data_ptr() != out.data_ptr()
        seen["out"] += 1
        _reverse_ranks(gathered, out, w)

    def copy_in(inp: torch.Tensor, staging: torch.Tensor) -> None:
        seen["in"] += 1
        _reverse_ranks(inp, staging, w)

    before = (
        (be.shared_memory_all_gathers, be.shared_memory_reduce_scatters)
        if hasattr(be, "shared_memory_all_gathers")
        else (0, 0)
    )
    mine = torch.arange(_NUMEL, dtype=torch.float32) + 1000 * be.rank
    out = torch.empty(_NUMEL * w)
    be.all_gather_copy_out(out, mine, copy_out, async_op=True).wait()
    want = torch.cat(
        [torch.arange(_NUMEL, dtype=torch.float32) + 1000 * r for r in reversed(range(w))]
    )
    gather_ok = torch.equal(out, want)

    g = torch.Generator().manual_seed(be.rank)
    inp = torch.randn(_NUMEL * w, generator=g)
    red = torch.empty(_NUMEL)
    be.reduce_scatter_copy_in(red, inp, copy_in, op=ReduceOp.premul_sum(0.5))
    reordered = torch.empty_like(inp)
    _reverse_ranks(inp, reordered, w)
    plain = torch.empty(_NUMEL)
    be.reduce_scatter_tensor(plain, reordered, op=ReduceOp.premul_sum(0.5))
    after = (
        (be.shared_memory_all_gathers, be.shared_memory_reduce_scatters)
        if hasattr(be, "shared_memory_all_gathers")
        else (0, 0)
    )
    return {
        "gather_ok": gather_ok,
        "reduce_equal": torch.equal(red, plain),
        "seen": seen,
        "stages": (
            be.stages("all_gather_into_tensor", out.numel() * 4),
            be.stages("reduce_scatter_tensor", inp.numel() * 4),
        ),
        "shm_calls": (after[0] - before[0], after[1] - before[1]),
    }


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_fallback_on_threads(world_size: int) -> None:
    for r in launch(staged_cases, world_size, backend="threads", timeout=120):
        assert r["gather_ok"] and r["reduce_equal"], r
        assert r["seen"] == {"out": 1, "in": 1}
        assert r["stages"] == (False, False)


@pytest.mark.parametrize("world_size", [2, 4])
def test_torch_without_shared_memory(world_size: int) -> None:
    """Below the shared-memory sizes: gloo's own paths, a temporary buffer, the same result."""
    for r in launch(staged_cases, world_size, threads_per_rank=1, timeout=300):
        assert r["gather_ok"] and r["reduce_equal"], r
        assert r["stages"] == (False, False) and r["shm_calls"] == (0, 0)


@pytest.mark.skipif(not stores_are_ordered(), reason="shared-memory collectives: x86-64 only")
@pytest.mark.parametrize("world_size", [2, 4])
def test_torch_shared_memory_copies_once(world_size: int) -> None:
    """Through shared memory: the caller's copies read and write the segment itself."""
    for r in launch(
        staged_cases, world_size, backend_options=_SHM, threads_per_rank=1, timeout=300
    ):
        assert r["gather_ok"] and r["reduce_equal"], r
        assert r["stages"] == (True, True)
        # the staged pair and the plain reduce-scatter all went through shared memory
        assert r["shm_calls"] == (1, 2) and r["seen"] == {"out": 1, "in": 1}


def bad_arguments(be: Any) -> list[str]:
    out, inp = torch.empty(4 * be.world_size), torch.empty(4)
    messages = []
    for call in (
        lambda: be.all_gather_copy_out(out, inp, "copy"),
        lambda: be.reduce_scatter_copy_in(inp, out, None),
        lambda: be.all_gather_copy_out(torch.empty(3), inp, lambda a, b: None),
        lambda: be.stages("all_reduce", 16),
    ):
        try:
            call()
            messages.append("accepted")
        except (TypeError, ValueError) as exc:
            messages.append(f"{type(exc).__name__}: {exc}")
    return messages


@pytest.mark.parametrize("backend", ["threads", "torch"])
def test_bad_arguments_are_named(backend: str) -> None:
    messages = launch(bad_arguments, 1, backend=backend, timeout=120)[0]
    assert messages[0].startswith(
        "TypeError: all_gather_into_tensor: copy_out must be a callable"
    ), messages[0]
    assert messages[1].startswith("TypeError: reduce_scatter_tensor: copy_in must be a callable"), (
        messages[1]
    )
    assert messages[2].startswith("ValueError: all_gather_into_tensor: out must hold"), messages
    assert messages[3].startswith("ValueError: stages: collective must be"), messages[3]
