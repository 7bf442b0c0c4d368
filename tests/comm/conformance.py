"""The conformance battery every backend runs (see test_conformance.py).

`run_battery` executes on each rank of a launched group and returns, per case, ``None`` when
the case passed or a description of what went wrong. Inputs are small integers so sums are
exact in fp16 and bf16, and every rank can compute the expected result by itself.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable

import torch
from fsdp_comm import Backend, ReduceOp, init_mesh

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
OPS = {
    "sum": ReduceOp.SUM,
    "avg": ReduceOp.AVG,
    "max": ReduceOp.MAX,
    "premul": ReduceOp.premul_sum(0.5),
}
SIZES = (1, 7, 1000)  # odd sizes: nothing divides evenly by accident


def rank_input(rank: int, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Rank-specific small integers (exact in every dtype)."""
    base = torch.arange(numel, dtype=torch.float64) * 3 + rank * 5
    return (base % 13).to(dtype).to(device)


def expected_reduce(op: ReduceOp, inputs: list[torch.Tensor]) -> torch.Tensor:
    stacked = torch.stack([t.double().cpu() for t in inputs])
    if op is ReduceOp.MAX:
        return stacked.max(0).values
    if op is ReduceOp.AVG:
        return stacked.mean(0)
    factor = op.factor if op.factor is not None else 1.0
    return stacked.sum(0) * factor


def _exact(op: ReduceOp, dtype: torch.dtype) -> float | bool:
    """Exact for everything but averages, which round (more in 16-bit dtypes)."""
    if op is not ReduceOp.AVG:
        return True
    return 1e-6 if dtype == torch.float32 else 1e-2


def _close(actual: torch.Tensor, expected: torch.Tensor, exact: float | bool) -> str | None:
    a = actual.double().cpu()
    rel = 0.0 if exact is True else float(exact)
    tol = rel * float(expected.abs().max().clamp(min=1))
    if a.shape != expected.shape or not bool(((a - expected).abs() <= tol).all()):
        return f"got {a.flatten()[:6].tolist()}..., expected {expected.flatten()[:6].tolist()}..."
    return None


def case_all_gather(be: Backend, dtype: torch.dtype, numel: int, async_op: bool) -> str | None:
    inp = rank_input(be.rank, numel, dtype, be.device)
    out = torch.full((numel * be.world_size,), -1, dtype=dtype, device=be.device)
    work = be.all_gather_into_tensor(out, inp, async_op=async_op)
    if async_op:
        work.wait()
        if be.device.type == "cuda":  # on CUDA wait() orders the stream; it does not block
            torch.cuda.current_stream(be.device).synchronize()
        if not work.is_completed():
            return "work.is_completed() is False after wait()"
    want = torch.cat(
        [rank_input(r, numel, dtype, torch.device("cpu")).double() for r in range(be.world_size)]
    )
    return _close(out, want, exact=True)


def case_reduce_scatter(
    be: Backend, dtype: torch.dtype, numel: int, op: ReduceOp, async_op: bool
) -> str | None:
    w = be.world_size
    inp = rank_input(be.rank, numel * w, dtype, be.device)
    before = inp.clone()
    out = torch.full((numel,), -1, dtype=dtype, device=be.device)
    work = be.reduce_scatter_tensor(out, inp, op=op, async_op=async_op)
    if async_op:
        work.wait()
    full = expected_reduce(
        op, [rank_input(r, numel * w, dtype, torch.device("cpu")) for r in range(w)]
    )
    if not torch.equal(inp, before):
        return "the input tensor was modified"
    return _close(out, full[be.rank * numel : (be.rank + 1) * numel], exact=_exact(op, dtype))


def case_all_reduce(
    be: Backend, dtype: torch.dtype, numel: int, op: ReduceOp, async_op: bool
) -> str | None:
    t = rank_input(be.rank, numel, dtype, be.device)
    work = be.all_reduce(t, op=op, async_op=async_op)
    if async_op:
        work.wait()
    want = expected_reduce(
        op, [rank_input(r, numel, dtype, torch.device("cpu")) for r in range(be.world_size)]
    )
    return _close(t, want, exact=_exact(op, dtype))


def case_broadcast(be: Backend, dtype: torch.dtype, async_op: bool) -> str | None:
    for src in range(be.world_size):
        t = rank_input(be.rank, 33, dtype, be.device)
        work = be.broadcast(t, src=src, async_op=async_op)
        if async_op:
            work.wait()
        problem = _close(t, rank_input(src, 33, dtype, torch.device("cpu")).double(), exact=True)
        if problem:
            return f"src={src}: {problem}"
    return None


def case_barrier(be: Backend) -> str | None:
    be.barrier()
    be.barrier()
    return None


def case_two_dim_output(be: Backend) -> str | None:
    """Outputs may be shaped (world_size, n) as well as flat."""
    inp = rank_input(be.rank, 5, torch.float32, be.device)
    out = torch.empty(be.world_size, 5, device=be.device)
    be.all_gather_into_tensor(out, inp)
    want = torch.stack(
        [
            rank_input(r, 5, torch.float32, torch.device("cpu")).double()
            for r in range(be.world_size)
        ]
    )
    return _close(out, want, exact=True)


def case_subgroup(be: Backend) -> str | None:
    """Even ranks form a group; odd ranks (if any) another; each all-reduces its rank ids."""
    w = be.world_size
    groups = [tuple(range(0, w, 2)), tuple(range(1, w, 2))]
    mine = None
    for ranks in groups:
        if ranks:
            sub = be.new_group(ranks)
            mine = sub if sub is not None else mine
    assert mine is not None
    t = torch.tensor([float(be.rank)], device=be.device)
    mine.all_reduce(t)
    members = groups[be.rank % 2]
    if mine.world_size != len(members) or mine.rank != members.index(be.rank):
        return f"sub-group rank {mine.rank} / size {mine.world_size}, expected members {members}"
    return _close(t, torch.tensor([float(sum(members))], dtype=torch.float64), exact=True)


def case_mesh(be: Backend) -> str | None:
    """Every (replicate, shard) factorisation of the world size."""
    w = be.world_size
    for shard in [d for d in range(1, w + 1) if w % d == 0]:
        mesh = init_mesh((w // shard, shard), backend=be)
        rep_i, shard_i = mesh.coordinate
        out = torch.empty(shard, device=be.device)
        mesh.shard.all_gather_into_tensor(out, torch.tensor([float(be.rank)], device=be.device))
        want_shard = [float(rep_i * shard + j) for j in range(shard)]
        if out.cpu().tolist() != want_shard:
            return f"shape {(w // shard, shard)}: shard group gathered {out.tolist()}"
        t = torch.tensor([float(be.rank)], device=be.device)
        mesh.replicate.all_reduce(t)
        want_rep = float(sum(i * shard + shard_i for i in range(w // shard)))
        if t.item() != want_rep:
            return f"shape {(w // shard, shard)}: replicate all-reduce gave {t.item()}"
    return None


def case_wrong_size_refused(be: Backend) -> str | None:
    """A wrong output size raises ValueError locally; the group then still works."""
    inp = torch.zeros(3, device=be.device)
    for call in (
        lambda: be.all_gather_into_tensor(
            torch.zeros(3 * be.world_size + 1, device=be.device), inp
        ),
        lambda: be.reduce_scatter_tensor(torch.zeros(2, device=be.device), inp),
    ):
        try:
            call()
        except ValueError:
            continue
        return "a wrong size was accepted"
    t = torch.ones(1, device=be.device)
    be.all_reduce(t)
    return _close(t, torch.tensor([float(be.world_size)], dtype=torch.float64), exact=True)


def case_all_gather_in_place(be: Backend, numel: int, async_op: bool) -> str | None:
    """The input is this rank's own slot of the output (what fsdp-engine's mixed-precision
    gather passes: Note [in-place gather])."""
    out = torch.full((numel * be.world_size,), -1, dtype=torch.float32, device=be.device)
    inp = out[be.rank * numel : (be.rank + 1) * numel]
    inp.copy_(rank_input(be.rank, numel, torch.float32, be.device))
    work = be.all_gather_into_tensor(out, inp, async_op=async_op)
    if async_op:
        work.wait()
        if be.device.type == "cuda":
            torch.cuda.current_stream(be.device).synchronize()
    want = torch.cat(
        [
            rank_input(r, numel, torch.float32, torch.device("cpu")).double()
            for r in range(be.world_size)
        ]
    )
    return _close(out, want, exact=True)


def build_cases() -> dict[str, Callable[[Backend], str | None]]:
    cases: dict[str, Callable[[Backend], str | None]] = {}
    for dname, dtype in DTYPES.items():
        for numel in SIZES:
            for async_op in (False, True):
                mode = "async" if async_op else "sync"
                cases[f"all_gather-{dname}-{numel}-{mode}"] = (
                    lambda be, d=dtype, n=numel, a=async_op: case_all_gather(be, d, n, a)
                )
        for oname, op in OPS.items():
            for async_op in (False, True):
                mode = "async" if async_op else "sync"
                cases[f"reduce_scatter-{dname}-{oname}-{mode}"] = (
                    lambda be, d=dtype, o=op, a=async_op: case_reduce_scatter(be, d, 129, o, a)
                )
                key = f"all_reduce-{dname}-{oname}-{mode}"
                cases[key] = lambda be, d=dtype, o=op, a=async_op: case_all_reduce(be, d, 257, o, a)
        cases[f"broadcast-{dname}"] = lambda be, d=dtype: case_broadcast(be, d, False)
    cases["broadcast-async"] = lambda be: case_broadcast(be, torch.float32, True)
    cases["large-all_gather"] = lambda be: case_all_gather(be, torch.float32, 300_001, False)
    cases["large-reduce_scatter"] = lambda be: case_reduce_scatter(
        be, torch.float32, 300_001, ReduceOp.premul_sum(0.25), True
    )
    for numel in (7, 300_001):  # gloo's native path, then the pairwise/shared-memory ones
        for async_op in (False, True):
            mode = "async" if async_op else "sync"
            cases[f"all_gather-in-place-{numel}-{mode}"] = lambda be, n=numel, a=async_op: (
                case_all_gather_in_place(be, n, a)
            )
    cases["barrier"] = case_barrier
    cases["two-dim-output"] = case_two_dim_output
    cases["subgroup"] = case_subgroup
    cases["mesh"] = case_mesh
    cases["wrong-size-refused"] = case_wrong_size_refused
    return cases


CASE_NAMES = list(build_cases())


def run_battery(be: Backend) -> dict[str, str | None]:
    """Run every case on this rank; a raised exception is reported, not propagated."""
    report: dict[str, str | None] = {}
    for name, case in build_cases().items():
        try:
            report[name] = case(be)
        except Exception:  # report per case; a broken group still fails the later cases
            report[name] = traceback.format_exc(limit=4)
    return report
