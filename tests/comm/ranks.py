"""Rank functions for the launch and failure tests (module level, so every start method can
import them in the ranks)."""

from __future__ import annotations

import os
import time
import warnings
from pathlib import Path

import torch
from fsdp_comm import Backend, CommError, ReduceOp


def return_tensor(be: Backend, numel: int) -> dict[str, object]:
    return {"rank": be.rank, "t": torch.full((numel,), float(be.rank)), "ranks": be.ranks}


def raise_on_rank(be: Backend, bad_rank: int) -> int:
    if be.rank == bad_rank:
        raise ValueError("bad input on purpose")
    t = torch.ones(1)
    be.all_reduce(t)  # the healthy ranks block here until the group is ended
    return be.rank


def sleep_forever(be: Backend) -> None:
    time.sleep(3600)


def die_mid_collective(be: Backend, report: str) -> str:
    """Rank 1 dies without a word; rank 0's all-reduce must end in a CommError, not a hang."""
    be.barrier()
    if be.rank == 1:
        os._exit(3)
    t0 = time.monotonic()
    try:
        be.all_reduce(torch.ones(1 << 16))
        outcome = "no error"
    except CommError as exc:
        outcome = f"{type(exc).__name__} after {time.monotonic() - t0:.1f}s: {exc}"
    Path(report).write_text(outcome)
    return outcome


def skip_collective(be: Backend) -> str:
    """Rank 1 never joins; rank 0's collective must time out with CommTimeoutError."""
    if be.rank == 1:
        time.sleep(be.timeout + 1)
        return "slept"
    t0 = time.monotonic()
    try:
        be.all_reduce(torch.ones(4))
    except CommError as exc:
        return f"{type(exc).__name__} after {time.monotonic() - t0:.1f}s: {exc}"
    return "no error"


def skip_async_collective(be: Backend) -> str:
    if be.rank == 1:
        time.sleep(be.timeout + 1)
        return "slept"
    work = be.all_gather_into_tensor(torch.empty(8), torch.ones(4), async_op=True)
    try:
        work.wait(timeout=1.0)
    except CommError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def mismatched_sizes(be: Backend) -> str:
    """With FSDP_COMM_DEBUG=1 a size that differs across ranks is caught before sending."""
    numel = 4 + be.rank
    try:
        be.all_gather_into_tensor(torch.empty(numel * be.world_size), torch.ones(numel))
    except CommError as exc:
        return str(exc)
    return "no error"


def mismatched_dtypes(be: Backend) -> str:
    dtype = torch.float32 if be.rank == 0 else torch.bfloat16
    try:
        be.all_reduce(torch.ones(4, dtype=dtype), op=ReduceOp.SUM)
    except CommError as exc:
        return str(exc)
    return "no error"


def collect_warnings(be: Backend) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        be.all_gather_into_tensor(torch.empty(4 * be.world_size), torch.ones(4))
        be.reduce_scatter_tensor(torch.empty(4), torch.ones(4 * be.world_size))
    return [f"{w.category.__name__}: {w.message}" for w in caught]


def capabilities(be: Backend) -> dict[str, str]:
    return dict(be.capabilities)


def read_env(be: Backend, name: str) -> str | None:
    return os.environ.get(name)
