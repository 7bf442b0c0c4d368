"""`clip_grad_norm_` over sharded gradients: the true global norm, computed without gathering.

Each element of every original parameter lives on exactly one rank of its unit's shard group
(padding is not part of any parameter), so the global norm is the shard group's sum of local
sums of squares (or maximum, for the inf-norm). Replicas of a hybrid mesh hold identical
gradients after the all-reduce, so only the shard group is reduced over.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

__all__ = ["clip_grad_norm_"]


def _grouped_params(target: nn.Module | Iterable[torch.Tensor]) -> dict[int, tuple[Any, list]]:
    """Parameters with gradients, grouped by the backend their shards are reduced over
    (key -1: parameters outside any unit, replicated on every rank)."""
    params = target.parameters() if isinstance(target, nn.Module) else target
    groups: dict[int, tuple[Any, list]] = {}
    seen: set[int] = set()
    for p in params:
        if p.grad is None or id(p) in seen:
            continue
        seen.add(id(p))
        flat = getattr(p, "_fsdp_flat", None)
        backend = None if flat is None else flat.shard_group
        key = -1 if backend is None else id(backend)
        groups.setdefault(key, (backend, []))[1].append(p)
    return groups


def _local(t: torch.Tensor) -> torch.Tensor:
    """A sharded gradient's local tensor (this rank's rows), or the tensor itself."""
    local = getattr(t, "_local_tensor", None)
    return t if local is None else local


def _local_norm(grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """This rank's part: sum of |g|^p (or max |g|) in float64, so the sum over ranks loses
    nothing to the order it is added in."""
    if not grads:
        return torch.zeros((), dtype=torch.float64)
    if math.isinf(norm_type):
        return torch.stack([g.detach().abs().max().double() if g.numel()
                            else torch.zeros((), dtype=torch.float64) for g in grads]).max()
    return torch.stack([g.detach().double().abs().pow(norm_type).sum() for g in grads]).sum()


def clip_grad_norm_(target: nn.Module | Iterable[torch.Tensor], max_norm: float,
                    norm_type: float = 2.0) -> torch.Tensor:
    """Clip the gradients of ``target`` (a sharded model or its parameters) so their global
    ``norm_type`` norm is at most ``max_norm``; return that global norm (before clipping).

    Collective: every rank calls it. Supports any p > 0 and ``float("inf")``.
    """
    from fsdp_comm import ReduceOp

    max_norm, norm_type = float(max_norm), float(norm_type)
    if not norm_type > 0:
        raise ValueError(f"norm_type must be > 0 or inf, got {norm_type}")
    is_inf = math.isinf(norm_type)
    total = torch.zeros((), dtype=torch.float64)
    grads_all: list[torch.Tensor] = []
    for backend, params in _grouped_params(target).values():
        grads = [_local(p.grad) for p in params]
        grads_all += grads
        part = _local_norm(grads, norm_type).reshape(1)
        if backend is not None and backend.world_size > 1:
            part = part.to(backend.device)
            backend.all_reduce(part, op=ReduceOp.MAX if is_inf else ReduceOp.SUM)
        part = part.cpu()[0]
        total = torch.maximum(total, part) if is_inf else total + part
    norm = total if is_inf else total.pow(1.0 / norm_type)
    coef = max_norm / (float(norm) + 1e-6)
    if coef < 1.0:
        for g in grads_all:
            g.mul_(coef)
    return norm.to(grads_all[0].dtype if grads_all else torch.float32)
