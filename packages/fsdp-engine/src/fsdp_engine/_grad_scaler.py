"""`ShardedGradScaler`: fp16 loss scaling when each rank holds only part of the gradients.

A plain `torch.amp.GradScaler` checks this rank's gradients for inf/NaN; with sharded
gradients another rank may hold the overflow, and ranks that disagree would step differently.
This scaler all-reduces the "found inf" flags (MAX) over the whole world before deciding.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["ShardedGradScaler"]


class ShardedGradScaler(torch.amp.GradScaler):
    """`torch.amp.GradScaler` whose inf checks agree across ranks.

    ``backend``: the fsdp_comm backend spanning every rank (the model's world); without one,
    the default ``torch`` group is used. Works on CPU and CUDA.
    """

    def __init__(
        self,
        device: str = "cuda",
        *,
        backend: Any = None,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
    ) -> None:
        super().__init__(
            device,
            init_scale=init_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            enabled=enabled,
        )
        self._backend = backend

    def _unscale_grads_(
        self, optimizer: Any, inv_scale: torch.Tensor, found_inf: torch.Tensor, allow_fp16: bool
    ) -> dict[torch.device, torch.Tensor]:
        per_device = _unscale_locals(optimizer, inv_scale, found_inf)
        backend = self._world()
        if backend.world_size > 1:
            from fsdp_comm import ReduceOp

            for flag in per_device.values():
                shared = flag.to(backend.device, torch.float32)
                backend.all_reduce(shared, op=ReduceOp.MAX)
                flag.copy_(shared.to(flag.device, flag.dtype))
        return per_device

    def _world(self) -> Any:
        if self._backend is None:
            from fsdp_comm import get_backend

            self._backend = get_backend("torch")
        return self._backend


def _unscale_locals(
    optimizer: Any, inv_scale: torch.Tensor, found_inf: torch.Tensor
) -> dict[torch.device, torch.Tensor]:
    """Unscale every gradient's local tensor (a DTensor's own rows: DTensor's handler for
    this op would gather the flags through the mesh, which the all-reduce below does for all
    backends) and note infs per device. Sharded gradients may be fp16 when parameters are."""
    grouped: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is None:
                continue
            grad = getattr(p.grad, "_local_tensor", p.grad)
            if grad.is_sparse:
                grad = grad.coalesce()._values()
            grouped.setdefault((grad.device, grad.dtype), []).append(grad)
    per_device: dict[torch.device, torch.Tensor] = {}
    for (device, _), grads in grouped.items():
        flag = per_device.setdefault(device, found_inf.to(device))
        torch._amp_foreach_non_finite_check_and_unscale_(grads, flag, inv_scale.to(device))
    return per_device
