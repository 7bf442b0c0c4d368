"""The one-process reference of a fault-tolerant run (issue #31): the membership that
``fsdp train --fault-tolerant`` logged per committed step, replayed in one process, and the
runs' checkpoints loaded for a bitwise comparison.

Why the replay can be bitwise equal to the 2 x 2 run: each rank's gradient is the full model's
gradient on that rank's rows (the engine gathers whole parameters for forward and backward);
the engine multiplies it by ``1 / (shards x live replicas)`` (a power of two here, so exact)
and sums it over the 2 shard ranks, then over the live replicas: sums of two terms, which
floating point adds alike in either order. AdamW is elementwise, so a shard of it is the
shard of the whole. What would not replay bit for bit is the gradient norm's sum of squares
(summed shard by shard there), so the runs train with ``--clip 0``; and BLAS kernels may
round differently with another thread count, so every process uses one thread.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

MODEL = "tiny"
SEED = 0
GLOBAL_BATCH = 8
LR = 3e-3  # fsdp train's default; the optimizer as train_rank makes it
SHARDS = 2  # ranks per host: one replica group
REPLICAS = 2

#: ``fsdp train --fault-tolerant``'s line per committed step (shard rank 0, FSDP_LOG_LEVEL=INFO).
COMMITTED = re.compile(r"fault tolerance: step (\d+) committed with replicas \[([\d, ]+)\]")
#: fsdp_comm's line per dropped step, on shard rank 0.
DROPPED = re.compile(r"\[rank 0\] [^\n]*?replica (\d+) dropped step (\d+) \(quorum round")


def memberships(text: str) -> dict[int, tuple[int, ...]]:
    """Step -> the replicas whose data it used, from a replica group's log. A step logged twice
    (a restarted group logs the steps it took part in again only after it rejoined, so never)
    must agree."""
    found: dict[int, tuple[int, ...]] = {}
    for m in COMMITTED.finditer(text):
        step, members = int(m.group(1)), tuple(int(r) for r in m.group(2).split(","))
        assert found.setdefault(step, members) == members, (step, found[step], members)
    return found


def dropped(text: str) -> list[int]:
    """The steps a replica group dropped (each redone by the next quorum), in order, as its
    shard rank 0 logged them (a step dropped twice is listed twice)."""
    return [int(m.group(2)) for m in DROPPED.finditer(text)]


def _model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from fsdp.models import GPT
    from fsdp.train._train import TRAIN_MODELS

    torch.manual_seed(SEED)  # as _build_local: the same initial weights as every rank's
    model = GPT(TRAIN_MODELS[MODEL])  # type: ignore[arg-type]
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.1)
    return model, opt


def replay(plan: dict[int, tuple[int, ...]], steps: int, data: Path) -> dict[str, Any]:
    """The state after ``steps`` committed steps, step ``s`` on the rows of the replicas
    ``plan[s]``, reduced as the engine reduces them; `state` of the result."""
    from fsdp.train._data import ByteCorpus
    from fsdp.train._train import TRAIN_MODELS

    torch.set_num_threads(1)
    model, opt = _model_and_optimizer()
    corpus = ByteCorpus.load(str(data))
    seq_len = TRAIN_MODELS[MODEL].seq_len
    params = [p for p in model.parameters() if p.requires_grad]
    for step in range(steps):
        members = plan[step]
        factor = 1.0 / (SHARDS * len(members))
        total: list[torch.Tensor] | None = None
        for replica in members:
            pair: list[torch.Tensor] | None = None
            for shard in range(SHARDS):
                x, y = corpus.batch(
                    step=step,
                    seed=SEED,
                    global_batch=GLOBAL_BATCH,
                    seq_len=seq_len,
                    rank=replica * SHARDS + shard,
                    world_size=REPLICAS * SHARDS,
                )
                model.zero_grad(set_to_none=True)
                F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten()).backward()
                grads = [p.grad.mul(factor) for p in params]  # type: ignore[union-attr]
                pair = grads if pair is None else [a + b for a, b in zip(pair, grads)]
            assert pair is not None
            total = pair if total is None else [a + b for a, b in zip(total, pair)]
        assert total is not None
        for p, g in zip(params, total):
            p.grad = g
        opt.step()
        opt.zero_grad(set_to_none=True)
    return state(model, opt)


def state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """Parameters by name, and each one's optimizer state (step, exp_avg, exp_avg_sq)."""
    names = {id(p): n for n, p in model.named_parameters()}
    optim = {names[id(p)]: dict(s) for p, s in opt.state.items()}
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()}, "optim": optim}


def load(ckpt: Path) -> dict[str, Any]:
    """A replica group's checkpoint in a plain model and optimizer; `state` of them."""
    import fsdp_ckpt

    model, opt = _model_and_optimizer()
    fsdp_ckpt.load(ckpt, model, opt)
    return state(model, opt)


def differences(a: Any, b: Any, where: str = "") -> list[str]:
    """Where ``a`` and ``b`` differ, bit for bit (tensors: dtype, shape, bytes)."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        same = a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(-1), b.view(-1))
        if same:
            return []
        if a.shape == b.shape and a.dtype.is_floating_point:
            return [f"{where}: max |diff| {float((a.double() - b.double()).abs().max()):.3g}"]
        return [f"{where}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"]
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{where}: keys {sorted(a)} vs {sorted(b)}"]
        return [d for k in a for d in differences(a[k], b[k], f"{where}/{k}")]
    return [] if a == b else [f"{where}: {a!r} vs {b!r}"]
