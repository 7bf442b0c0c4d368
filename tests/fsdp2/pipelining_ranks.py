"""Rank side of test_pipelining.py: ``torch.distributed.pipelining`` schedules over stages
sharded with torch's ``fully_shard`` or ours, on a 2 x 2 mesh (pipeline x data parallel), each
rank's gradients against one process running the whole model on every data-parallel rank's
batch. Module level, so the forkserver can import it."""

from __future__ import annotations

import traceback
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

PP, DP = 2, 2
MICRO = 4
# Stages per rank: one, two in a loop (interleaved), or two in a V (ZBV).
SCHEDULES = (
    "ScheduleGPipe",
    "Schedule1F1B",
    "ScheduleInterleaved1F1B",
    "ScheduleInterleavedZeroBubble",
    "ScheduleZBVZeroBubble",
)


def _stage(i: int) -> nn.Module:
    torch.manual_seed(i)
    return nn.Sequential(nn.Linear(7, 9), nn.ReLU(), nn.Linear(9, 7))  # uneven over 2


def _batch(dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(7 + dp_rank)
    return torch.randn(8, 7, generator=gen), torch.randn(8, 7, generator=gen)


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def _stage_ids(name: str, pp_rank: int) -> tuple[list[int], int]:
    if name == "ScheduleZBVZeroBubble":
        return [pp_rank, 2 * PP - 1 - pp_rank], 2 * PP
    if name.startswith("ScheduleInterleaved"):
        return [pp_rank, pp_rank + PP], 2 * PP
    return [pp_rank], PP


def _reference(n_stages: int) -> list[torch.Tensor]:
    """Every parameter's gradient: micro-batch losses averaged, data-parallel ranks averaged."""
    ref = nn.Sequential(*(_stage(i) for i in range(n_stages)))
    for r in range(DP):
        x, y = _batch(r)
        loss = sum(_loss(ref(xc), yc) for xc, yc in zip(x.chunk(MICRO), y.chunk(MICRO)))
        (loss / (MICRO * DP)).backward()
    return [p.grad for p in ref.parameters()]


def run_schedule(impl: str, name: str, reshard_after_forward: bool | None) -> dict[str, Any]:
    import torch.distributed.pipelining.schedules as schedules
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage

    if impl == "torch":
        from torch.distributed.fsdp import fully_shard
    else:
        from fsdp_engine import fully_shard
    mesh = init_device_mesh("cpu", (PP, DP), mesh_dim_names=("pp", "dp"))
    pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    ids, n_stages = _stage_ids(name, pp_rank)
    modules, stages = [], []
    for i in ids:
        m = _stage(i)
        for unit in (m[0], m[2], m):
            fully_shard(unit, mesh=mesh["dp"], reshard_after_forward=reshard_after_forward)
        modules.append(m)
        stages.append(
            PipelineStage(m, i, n_stages, torch.device("cpu"), group=mesh["pp"].get_group())
        )
    cls = getattr(schedules, name)
    schedule = cls(stages if len(stages) > 1 else stages[0], n_microbatches=MICRO, loss_fn=_loss)
    x, y = _batch(dp_rank)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(2):  # the second step starts from the first one's state
            for m in modules:
                m.zero_grad()
            args = (x,) if 0 in ids else ()
            kwargs = {"target": y} if n_stages - 1 in ids else {}
            schedule.step(*args, **kwargs)
    want = _reference(n_stages)
    out: dict[str, Any] = {"warned": any("not its parameters" in str(w.message) for w in seen)}
    for i, m in zip(ids, modules):
        for j, p in enumerate(m.parameters()):
            key = f"stage{i}.{j}"
            if p.grad is None:
                out[key] = "gradient is None"
                continue
            got = p.grad.full_tensor()
            out[key] = (got - want[4 * i + j]).abs().max().item()
    return out


def run_all(backend: Any, impl: str) -> dict[str, Any]:
    """Every schedule with units that stay gathered after forward (what zero-bubble
    schedules need, on FSDP2 too), and ZBV with the default (units reshard)."""
    out: dict[str, Any] = {}
    cases = [(name, False) for name in SCHEDULES] + [("ScheduleZBVZeroBubble", None)]
    for name, rf in cases:
        key = f"{name}-{'kept' if rf is False else 'default'}"
        try:
            out[key] = run_schedule(impl, name, rf)
        except Exception:
            out[key] = {"exception": traceback.format_exc()}
        dist.barrier()
    return out
