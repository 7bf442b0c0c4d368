"""The only collectives of a save or load: every rank says whether its part succeeded.

A save is a two-phase commit. Phase one (`all_succeeded`): every rank has written and fsynced
its files and votes; one failure anywhere and nobody commits. Phase two (`commit_outcome`):
rank 0 commits and tells the others whether that worked, so every rank returns the same
answer and no rank starts the next save before the commit is on disk (the next save's version
number is read from the pointer the commit writes). Both are one-element collectives.
"""

from __future__ import annotations

from typing import Any

import torch
from fsdp_comm import ReduceOp

__all__ = ["all_succeeded", "commit_outcome"]


def _flag(backend: Any, value: int) -> torch.Tensor:
    return torch.tensor([value], dtype=torch.int32, device=backend.device)


def all_succeeded(backend: Any, ok: bool) -> bool:
    """True when every rank's ``ok`` is True (an all-reduce of failure flags)."""
    if backend is None or backend.world_size == 1:
        return ok
    failed = _flag(backend, 0 if ok else 1)
    backend.all_reduce(failed, op=ReduceOp.MAX)
    return int(failed.item()) == 0


def commit_outcome(backend: Any, ok: bool) -> bool:
    """Rank 0's ``ok``, on every rank (a broadcast)."""
    if backend is None or backend.world_size == 1:
        return ok
    flag = _flag(backend, 1 if ok else 0)
    backend.broadcast(flag, src=0)
    return int(flag.item()) == 1
