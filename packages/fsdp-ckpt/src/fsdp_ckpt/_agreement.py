"""The collectives of a save or load: small agreements, never tensor data.

A save is a two-phase commit. Before it, rank 0 takes the path's lock and names the version
and staging directory (`from_rank0`). Phase one (`all_succeeded`): every rank has written and
fsynced its files and votes; one failure anywhere and nobody commits. Phase two (`rank0_code`):
rank 0 commits and tells the others how far it got, so every rank returns the same answer and
no rank starts the next save before the commit is on disk. A load has rank 0 resolve the
pointer and send every rank the same index (`from_rank0`), so all ranks load one version.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from fsdp_comm import ReduceOp

from ._errors import CheckpointError

__all__ = ["all_succeeded", "first_failure", "rank0_code", "from_rank0"]


def _flag(backend: Any, value: int) -> torch.Tensor:
    return torch.tensor([value], dtype=torch.int32, device=backend.device)


def _alone(backend: Any) -> bool:
    return backend is None or backend.world_size == 1


def all_succeeded(backend: Any, ok: bool) -> bool:
    """True when every rank's ``ok`` is True (an all-reduce of failure flags)."""
    if _alone(backend):
        return ok
    failed = _flag(backend, 0 if ok else 1)
    backend.all_reduce(failed, op=ReduceOp.MAX)
    return int(failed.item()) == 0


def first_failure(backend: Any, error: BaseException | None) -> str | None:
    """None when no rank failed; else, on every rank, "rank R: <its error>" of the lowest
    failing rank (an all-reduce, then a broadcast from that rank), so a rank that did not
    fail can name the cause instead of pointing elsewhere."""
    if _alone(backend):
        return None if error is None else f"rank 0: {_describe(error)}"
    world = backend.world_size
    code = _flag(backend, world - backend.rank if error is not None else 0)
    backend.all_reduce(code, op=ReduceOp.MAX)
    if int(code.item()) == 0:
        return None
    src = world - int(code.item())
    text = _describe(error).encode()[:4096] if error is not None else b""
    _, data = _broadcast_bytes(backend, 1, text, src=src)
    return f"rank {src}: {data.decode(errors='replace')}"


def rank0_code(backend: Any, code: int) -> int:
    """Rank 0's ``code`` (a small int), on every rank (a broadcast)."""
    if _alone(backend):
        return code
    flag = _flag(backend, code)
    backend.broadcast(flag, src=0)
    return int(flag.item())


def _broadcast_bytes(backend: Any, status: int, data: bytes, src: int = 0) -> tuple[int, bytes]:
    head = torch.tensor([status, len(data)], dtype=torch.int64, device=backend.device)
    backend.broadcast(head, src=src)
    status, size = (int(v) for v in head.tolist())
    if size == 0:
        return status, b""
    if backend.rank == src:
        body = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(backend.device)
    else:
        body = torch.empty(size, dtype=torch.uint8, device=backend.device)
    backend.broadcast(body, src=src)
    return status, body.cpu().numpy().tobytes()


def from_rank0(backend: Any, produce: Callable[[], bytes], what: str) -> bytes:
    """Rank 0 runs ``produce``; every rank gets its bytes (two broadcasts).

    When ``produce`` raises, rank 0 re-raises it and every other rank raises a
    `CheckpointError` quoting it, prefixed with ``what`` ("save to ckpt/run").
    """
    if _alone(backend):
        return produce()
    data, error = b"", None
    if backend.rank == 0:
        try:
            data = produce()
        except Exception as exc:  # sent to the other ranks, then re-raised here
            error = exc
            data = _describe(exc).encode()
    failed, data = _broadcast_bytes(backend, int(error is not None), data)
    if error is not None:
        raise error
    if failed:
        raise CheckpointError(
            f"{what}: rank 0 failed (its error is raised there): {data.decode(errors='replace')}"
        )
    return data


def _describe(exc: BaseException) -> str:
    notes = getattr(exc, "__notes__", [])
    return " ".join([f"{type(exc).__name__}: {exc}.", *notes])
