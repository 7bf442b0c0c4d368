"""`clip_grad_norm_` over sharded gradients: the true global norm, computed without gathering.

Each element of every original parameter lives on exactly one rank of its unit's shard group
(padding is not part of any parameter), so the global norm is the shard group's sum of local
sums of squares (or maximum, for the inf-norm). Replicas of a hybrid mesh hold identical
gradients after the all-reduce, so only the shard group is reduced over. Tensor-parallel
parameters that tp shards are then summed over their tp group as well; those tp replicates
are counted once (Note [flat buffer on a 2-D mesh]). Parameters on different meshes are
fine: each group is reduced over its own (torch's ``clip_grad_norm_`` fails there,
pytorch#180346).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable
from typing import Any, cast

import torch
from torch import nn

__all__ = ["clip_grad_norm_"]


def _grouped_params(
    target: nn.Module | Iterable[torch.Tensor],
) -> dict[tuple[int, int], tuple[Any, Any, list[torch.Tensor]]]:
    """Parameters with gradients, grouped by the backend their shards are reduced over and,
    for tensor-parallel parameters that tp shards, the tp group (key (-1, -1): parameters
    outside any unit, replicated on every rank)."""
    params = target.parameters() if isinstance(target, nn.Module) else target
    groups: dict[tuple[int, int], tuple[Any, Any, list[torch.Tensor]]] = {}
    seen: set[int] = set()
    slots: dict[int, Any] = {}  # id(param) -> its slot, per flat met
    for p in params:
        if p.grad is None or id(p) in seen:
            continue
        seen.add(id(p))
        flat = getattr(p, "_fsdp_flat", None)
        backend = None if flat is None else flat.shard_group
        tp_group = None
        if flat is not None and flat.layout.tps is not None:
            if id(p) not in slots:
                slots.update((id(q), s) for q, s in zip(flat.params, flat.layout.slots))
            tp = slots[id(p)].tp
            tp_group = None if tp is None else tp.norm_group
        key = (-1 if backend is None else id(backend), -1 if tp_group is None else id(tp_group))
        groups.setdefault(key, (backend, tp_group, []))[2].append(p)
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
        return torch.stack(
            [
                g.detach().abs().max().double()
                if g.numel()
                else torch.zeros((), dtype=torch.float64)
                for g in grads
            ]
        ).max()
    return torch.stack([g.detach().double().abs().pow(norm_type).sum() for g in grads]).sum()


def clip_grad_norm_(
    target: nn.Module | Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0
) -> torch.Tensor:
    """Clip the gradients of ``target`` (a sharded model or its parameters) so their global
    ``norm_type`` norm is at most ``max_norm``; return that global norm (before clipping).

    Collective: every rank calls it. Supports any p > 0 and ``float("inf")``. ``max_norm``
    must be >= 0 (``inf`` measures without clipping): a negative one would flip the sign of
    every gradient, so the optimizer would climb the loss (torch's accepts it; this refuses).
    """
    from fsdp_comm import ReduceOp

    for name, value in (("max_norm", max_norm), ("norm_type", norm_type)):
        one_number = isinstance(value, torch.Tensor) and value.numel() == 1
        if isinstance(value, bool) or not (isinstance(value, numbers.Real) or one_number):
            raise TypeError(f"{name} must be a real number, got {type(value).__name__} {value!r}")
    max_norm, norm_type = float(max_norm), float(norm_type)
    if not max_norm >= 0:  # NaN fails too
        raise ValueError(
            f"max_norm must be >= 0 (a negative one flips every gradient's sign), got {max_norm}"
        )
    if not norm_type > 0:
        raise ValueError(f"norm_type must be > 0 or inf, got {norm_type}")
    is_inf = math.isinf(norm_type)
    total = torch.zeros((), dtype=torch.float64)
    grads_all: list[torch.Tensor] = []
    for backend, tp_group, params in _grouped_params(target).values():
        # `_grouped_params` kept the parameters that have a gradient.
        grads = [_local(cast(torch.Tensor, p.grad)) for p in params]
        grads_all += grads
        part = _local_norm(grads, norm_type).reshape(1)
        if backend is not None and backend.world_size > 1:
            part = part.to(backend.device)
            backend.all_reduce(part, op=ReduceOp.MAX if is_inf else ReduceOp.SUM)
        if tp_group is not None:  # Note [flat buffer on a 2-D mesh]: the tp pieces too
            import torch.distributed as dist

            part = part.to(backend.device)
            dist.all_reduce(
                part, op=dist.ReduceOp.MAX if is_inf else dist.ReduceOp.SUM, group=tp_group
            )
        part = part.cpu()[0]
        total = torch.maximum(total, part) if is_inf else total + part
    norm = total if is_inf else total.pow(1.0 / norm_type)
    coef = max_norm / (float(norm) + 1e-6)
    if coef < 1.0:
        for g in grads_all:
            g.mul_(coef)
    return norm.to(grads_all[0].dtype if grads_all else torch.float32)
