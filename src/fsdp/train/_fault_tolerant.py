"""``fsdp train --strategy hybrid_shard --fault-tolerant`` (issue #31): each host is one replica
group under its own torchrun (its world is the shard group); the hosts meet through the
rendezvous store at ``FSDP_FT_STORE`` (``FSDP_FT_REPLICA`` this host's index,
``FSDP_FT_REPLICAS`` how many). The design and the rule for a failed step are Note
[fault-tolerant replicas] in fsdp_comm's ``_ft_replicate.py``; the user's page is
docs/fault-tolerance.md.

Each step: the quorum, the step (the data of replica ``r`` is the rows of data-parallel ranks
``r * S .. r * S + S - 1`` of ``FSDP_FT_REPLICAS * S``, so a step redone reads the same rows),
then the commit vote; the optimizer steps only on a commit. Checkpoints go to
``<--save>/replica<r>`` (each host its own copy of the same state).
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["fault_tolerant_problem", "ft_config", "ft_mesh", "ft_train_steps"]

_log = logging.getLogger("fsdp")
_MADE: dict[int, Any] = {}  # id(shard backend) -> its FaultTolerantReplicate
_ENV = ("FSDP_FT_STORE", "FSDP_FT_REPLICA", "FSDP_FT_REPLICAS")


def fault_tolerant_problem(strategy: str, tp: int, shard_size: int | None) -> str | None:
    """Why ``--fault-tolerant`` cannot run with these flags here, or None."""
    if strategy != "hybrid_shard":
        return f"--fault-tolerant needs --strategy hybrid_shard, got --strategy {strategy}"
    if tp != 1:
        return f"--fault-tolerant does not take --tp (got --tp {tp})"
    if shard_size is not None:
        return (
            "--fault-tolerant: the shard group is this host's torchrun world; drop --shard-size "
            f"(got {shard_size})"
        )
    missing = [name for name in _ENV if not os.environ.get(name)]
    if missing or "RANK" not in os.environ:
        return (
            "--fault-tolerant runs under one torchrun per host (its ranks are that host's shard "
            "group) with FSDP_FT_STORE=host:port (hosted by replica 0's rank 0), "
            f"FSDP_FT_REPLICA and FSDP_FT_REPLICAS set; missing: {missing or ['RANK']}"
        )
    return None


def ft_config(cfg: Any) -> Any:
    """Each replica group's checkpoints in a directory of its own."""
    r = os.environ.get("FSDP_FT_REPLICA", "0")
    save = None if cfg.save is None else os.path.join(cfg.save, f"replica{r}")
    resume = None if cfg.resume is None else os.path.join(cfg.resume, f"replica{r}")
    return replace(cfg, save=save, resume=resume)


def ft_mesh(backend: Any) -> Any:
    """The 2-D mesh: this host's world sharded, the hosts the fault-tolerant replicas."""
    from fsdp_comm import FaultTolerantReplicate

    ft = FaultTolerantReplicate(backend)
    _MADE[id(backend)] = ft
    return ft.mesh()


def ft_train_steps(
    model: Any,
    opt: Any,
    corpus: Any,
    backend: Any,
    cfg: Any,
    seq_len: int,
    summary: Any,
    reporter: Any,
) -> None:
    """`_train_steps` of ``_train.py`` with the quorum and the commit vote around each step."""
    from fsdp_comm import FaultTolerantReplicate
    from fsdp_engine import clip_grad_norm_

    ft = _MADE.pop(id(backend))
    assert isinstance(ft, FaultTolerantReplicate)

    def state() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": opt.state_dict()}

    def load_state(got: dict[str, Any]) -> None:
        model.load_state_dict(got["model"])
        opt.load_state_dict(got["optim"])

    ft.bind_state(state, load_state)
    ft.step = summary.start_step
    tokens = cfg.global_batch * cfg.grad_accum * seq_len
    shards = backend.world_size
    t0: float | None = None  # a step's time runs from its first quorum to its loss, drops included
    try:
        while ft.step < cfg.steps:
            t0 = time.perf_counter() if t0 is None else t0
            ft.start_step()
            step = ft.step
            lr = float(opt.param_groups[0]["lr"])
            total = 0.0
            for micro in range(cfg.grad_accum):
                model.set_requires_gradient_sync(micro == cfg.grad_accum - 1)
                x, y = corpus.batch(
                    step=step * cfg.grad_accum + micro,
                    seed=cfg.seed,
                    global_batch=cfg.global_batch,
                    seq_len=seq_len,
                    rank=ft.replica * shards + backend.rank,
                    world_size=ft.replicas * shards,
                )
                x, y = x.to(backend.device), y.to(backend.device)
                logits = model(x)
                logits = logits if isinstance(logits, torch.Tensor) else logits.logits
                loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten()) / cfg.grad_accum
                loss.backward()
                total += loss.item()
            norm = clip_grad_norm_(model, cfg.clip if cfg.clip is not None else math.inf)
            committed = ft.commit()
            if committed:
                opt.step()
            opt.zero_grad(set_to_none=True)
            if not committed:
                continue
            if backend.rank == 0:  # the membership per step, for a replay (and the curious)
                _log.info(
                    "fault tolerance: step %d committed with replicas %s", step, list(ft.ranks)
                )
            mean = torch.tensor([total], device=backend.device)
            backend.all_reduce(mean)
            loss_value = mean.item() / backend.world_size
            step_time, t0 = time.perf_counter() - t0, None
            summary.losses.append(loss_value)
            reporter.step(step, loss_value, lr, float(norm), step_time, tokens, None)
            if cfg.save_every and ft.step % cfg.save_every == 0 and ft.step < cfg.steps:
                from ._train import _save

                _save(cfg, model, opt, ft.step)
    finally:
        s = ft.stats
        _log.info(
            "fault tolerance: %d quorum changes, %d steps dropped, recovery %s s, rejoin %s s",
            s.quorum_changes,
            s.steps_dropped,
            [round(x, 3) for x in s.recovery_s],
            [round(x, 3) for x in s.rejoin_s],
        )
        ft.close()
