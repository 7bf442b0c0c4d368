"""Parity harness: the same training run in one process and sharded over ranks.

`reference_run` trains a model on the whole global batch in one process; `sharded_rank` runs
on each rank of a launched group, each on its slice of the global batch, and returns its
losses and the gathered full parameters. Equal local batch sizes make the mean of the ranks'
losses the reference loss.
"""

from __future__ import annotations

import copy
import threading
import traceback
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from fsdp_comm import Backend, init_mesh
from fsdp_engine import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
    full_parameters,
    fully_shard,
)

from .models import TinyGPT, make_batch

_BUILD_LOCK = threading.Lock()  # the threads backend shares the global RNG between ranks


@dataclass(frozen=True)
class RunConfig:
    strategy: str = "full"  # full | grad_op | no_shard | hybrid | reshard_int
    steps: int = 3
    accum: int = 1  # micro-batches per step
    no_sync: bool = False  # accumulate micro-batches without communication
    param_dtype: str | None = None
    reduce_dtype: str | None = None
    forward_prefetch: bool = True
    clip: float | None = None
    lr: float = 1e-2
    # AdamW's update g / (|g| + eps) turns a gradient that cancels to ~1e-8 (it happens with
    # accumulation) into a full-size step whose sign is float noise; a larger eps keeps such
    # elements comparable across summation orders without changing the rest.
    eps: float = 1e-5
    dtype: str = "float32"  # of the model's parameters; float64 shows the engine is exact
    device: str = "cpu"  # "cuda": the model, batches and collectives on the GPU
    offload: bool = False  # CPUOffloadPolicy: shards, gradients and the optimizer on the host


def build_model(dtype: str = "float32", device: str = "cpu") -> TinyGPT:
    with _BUILD_LOCK:
        torch.manual_seed(0)
        return TinyGPT().to(getattr(torch, dtype)).to(device)


def _dtype(name: str | None) -> torch.dtype | None:
    return None if name is None else getattr(torch, name)


def shard_model(model: TinyGPT, be: Backend, cfg: RunConfig) -> TinyGPT:
    mesh: object = be
    reshard: bool | int = True
    if cfg.strategy == "no_shard":
        mesh = init_mesh((be.world_size, 1), backend=be)
    elif cfg.strategy == "hybrid":
        shard = 2 if be.world_size % 2 == 0 else 1
        mesh = init_mesh((be.world_size // shard, shard), backend=be)
    elif cfg.strategy == "grad_op":
        reshard = False
    elif cfg.strategy == "reshard_int":
        reshard = 2 if be.world_size % 2 == 0 else True
    mp = MixedPrecisionPolicy(
        param_dtype=_dtype(cfg.param_dtype), reduce_dtype=_dtype(cfg.reduce_dtype)
    )
    offload = CPUOffloadPolicy() if cfg.offload else OffloadPolicy()
    for block in model.blocks:
        fully_shard(
            block, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp, offload_policy=offload
        )
    fully_shard(
        model, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp, offload_policy=offload
    )
    if not cfg.forward_prefetch:
        for m in [*model.blocks, model]:
            m.set_modules_to_forward_prefetch([])
    return model


def _train(model: torch.nn.Module, cfg: RunConfig, batches, clip_fn) -> list[float]:
    opt = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=cfg.lr, eps=cfg.eps
    )
    losses = []
    for step in range(cfg.steps):
        total = 0.0
        for micro in range(cfg.accum):
            x, y = (t.to(cfg.device) for t in batches(step * cfg.accum + micro))
            sync = not cfg.no_sync or micro == cfg.accum - 1
            if hasattr(model, "set_requires_gradient_sync"):
                model.set_requires_gradient_sync(sync)
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten()) / cfg.accum
            loss.backward()
            total += loss.item()
        if cfg.clip is not None:
            clip_fn(model, cfg.clip)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses


def sharded_rank(be: Backend, cfg: RunConfig) -> tuple[list[float], dict[str, torch.Tensor]]:
    torch.set_num_threads(1)
    model = shard_model(build_model(cfg.dtype, cfg.device), be, cfg)

    def clip(m, max_norm):
        from fsdp_engine import clip_grad_norm_

        return clip_grad_norm_(m, max_norm)

    losses = _train(model, cfg, lambda i: make_batch(i, be.rank, be.world_size), clip)
    return losses, {n: t.cpu() for n, t in full_parameters(model).items()}


def sharded_rank_many(be: Backend, cfgs: tuple[RunConfig, ...]) -> list[tuple[str, object]]:
    """`sharded_rank` for each of ``cfgs`` in turn in one launched group (a rank's start-up costs
    more than a run): ``("ok", result)`` or ``("err", traceback)`` per config, so a failing
    config fails only its own test."""
    out: list[tuple[str, object]] = []
    for cfg in cfgs:
        try:
            out.append(("ok", sharded_rank(be, cfg)))
        except Exception:
            out.append(("err", traceback.format_exc()))
    return out


def reference_run(cfg: RunConfig, world: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = copy.deepcopy(build_model(cfg.dtype, cfg.device))

    def batches(i):
        xs, ys = zip(*[make_batch(i, r, world) for r in range(world)])
        return torch.cat(xs), torch.cat(ys)

    def clip(m, max_norm):
        return torch.nn.utils.clip_grad_norm_(
            [p for p in m.parameters() if p.grad is not None], max_norm
        )

    losses = _train(model, cfg, batches, clip)
    return losses, {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
