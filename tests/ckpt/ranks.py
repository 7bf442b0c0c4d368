"""Rank functions and helpers for the checkpoint tests (module level: the ``torch`` backend's
forkserver must import them)."""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

import fsdp_ckpt as ck
import torch
import torch.nn.functional as F
from fsdp_comm import Backend, init_mesh
from fsdp_engine import full_parameters, fully_shard, sharded_layout
from torch import nn
from torch.distributed.tensor import DTensor

from ..engine.models import TinyGPT, make_batch

_BUILD_LOCK = threading.Lock()  # the threads backend shares the global RNG between ranks
STEPS_BEFORE_SAVE = 2
GLOBAL_BATCH = 8  # sequences per step, whatever the world size (1, 2, 4 and 8 divide it)


# ---- models ------------------------------------------------------------------------------------
def build(seed: int = 0) -> TinyGPT:
    with _BUILD_LOCK:
        torch.manual_seed(seed)
        return TinyGPT()


def shard(model: nn.Module, be: Backend, strategy: str = "full") -> nn.Module:
    mesh: Any = be
    if strategy == "hybrid":
        mesh = init_mesh((be.world_size // 2, 2), backend=be)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, eps=1e-5)


def train(
    model: nn.Module, opt: torch.optim.Optimizer, rank: int, world: int, steps: range
) -> list[float]:
    """Train on this rank's slice of each step's global batch; the global mean loss per step
    (the mean over ranks of equal local batches, computed by the caller)."""
    return [
        _step(model, opt, *make_batch(step, rank, world, batch=GLOBAL_BATCH // world))
        for step in steps
    ]


def plain_train(
    model: nn.Module, opt: torch.optim.Optimizer, world: int, steps: range
) -> list[float]:
    """The same global batches on one process, in the order ``world`` ranks hold them."""
    losses = []
    for step in steps:
        batches = [make_batch(step, r, world, batch=GLOBAL_BATCH // world) for r in range(world)]
        x = torch.cat([b[0] for b in batches])
        y = torch.cat([b[1] for b in batches])
        losses.append(_step(model, opt, x, y))
    return losses


def _step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> float:
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


# ---- state snapshots ---------------------------------------------------------------------------
def _local(t: torch.Tensor) -> torch.Tensor:
    """A sharded (DTensor) state tensor's own rows."""
    return t.to_local() if isinstance(t, DTensor) else t


def optimizer_pieces(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """This rank's optimizer state by FQN: (flat_start, {name: 1-D clone or scalar})."""
    names = {id(p): n for n, p in model.named_parameters()}
    starts = {}
    if any(hasattr(m, "_fsdp_state") for m in model.modules()):
        starts = {s.fqn: s.flat_start for s in sharded_layout(model)}
    out = {}
    for p, state in opt.state.items():
        fqn = names[id(p)]
        out[fqn] = (
            starts.get(fqn, 0),
            {
                k: _local(v).detach().clone().reshape(-1) if v.dim() else v.detach().clone()
                for k, v in state.items()
            },
        )
    return out


def assemble_optimizer(
    per_rank: list[dict[str, Any]], shapes: dict[str, torch.Size]
) -> dict[str, dict[str, torch.Tensor]]:
    """Whole optimizer state tensors from every rank's pieces."""
    full: dict[str, dict[str, torch.Tensor]] = {}
    for pieces in per_rank:
        for fqn, (start, state) in pieces.items():
            slot = full.setdefault(fqn, {})
            for name, value in state.items():
                if value.dim() == 0:
                    slot[name] = value
                    continue
                whole = slot.setdefault(
                    name, torch.full((shapes[fqn].numel(),), float("nan"), dtype=value.dtype)
                )
                whole[start : start + value.numel()] = value
    return {
        f: {n: (v.view(shapes[f]) if v.dim() else v) for n, v in s.items()} for f, s in full.items()
    }


def snapshot(be: Backend, model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {"params": full_parameters(model), "optim": optimizer_pieces(model, opt)}


# ---- rank functions ----------------------------------------------------------------------------
def train_and_save(be: Backend, path: str, strategy: str = "full") -> dict[str, Any]:
    model = shard(build(0), be, strategy)
    opt = optimizer(model)
    train(model, opt, be.rank, be.world_size, range(STEPS_BEFORE_SAVE))
    ck.save(path, model, opt, extra={"step": STEPS_BEFORE_SAVE, "world": be.world_size})
    return snapshot(be, model, opt)


def load_sharded(be: Backend, path: str, strategy: str = "full") -> dict[str, Any]:
    model = shard(build(1), be, strategy)
    opt = optimizer(model)
    extra = ck.load(path, model, opt)
    return {**snapshot(be, model, opt), "extra": extra}


class KillingStorage(ck.LocalStorage):
    """Local storage that SIGKILLs its own process at a chosen point of a save.

    ``point``: "data" (after ``after_bytes`` bytes of a tensor file), "manifest" (when the
    rank's part of the index is written: its last write before the vote), "index" (half-way
    through writing index.json), "version-rename" (before the staging directory is renamed),
    "pointer" (before CURRENT is replaced), "after-pointer" (just after).
    """

    def __init__(self, point: str, *, after_bytes: int = 100) -> None:
        super().__init__()
        self.point = point
        self.after_bytes = after_bytes

    def open_write(self, path: str, *, durable: bool = True) -> Any:
        f = super().open_write(path, durable=durable)
        name = os.path.basename(path)
        if self.point == "data" and name.endswith(".safetensors"):
            return _DieAfter(f, self.after_bytes)
        if self.point == "index" and name == "index.json":
            return _DieAfter(f, 50)
        if self.point == "manifest" and name.startswith("rank-"):
            return _DieAfter(f, 0)
        return f

    def rename(self, src: str, dst: str) -> None:
        if self.point == "version-rename" and ".staging-" in src:
            _die()
        if self.point == "pointer" and dst.endswith("CURRENT"):
            _die()
        super().rename(src, dst)
        if self.point == "after-pointer" and dst.endswith("CURRENT"):
            _die()


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class _DieAfter:
    """A file that writes ``limit`` bytes, flushes them to disk, then kills the process."""

    def __init__(self, f: Any, limit: int) -> None:
        self._f = f
        self._left = limit

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        if view.nbytes >= self._left:
            self._f.write(view[: self._left])
            self._f.flush()
            os.fsync(self._f.fileno())
            _die()
        self._left -= view.nbytes
        return self._f.write(view)

    def __enter__(self) -> _DieAfter:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._f.close()

    def close(self) -> None:
        self._f.close()


def save_twice_and_die(be: Backend, path: str, point: str, die_rank: int) -> None:
    """Save step 1's state; change it; save again and have rank ``die_rank`` die at ``point``.

    One rank: a plain model whose parameters are ``build(0)`` plus the step (exact to check,
    and no optimizer: making one imports torch._dynamo, 1.5 s in every fresh rank process).
    Several ranks: a sharded model trained one step between the saves, with AdamW.
    """
    if be.world_size == 1:
        model: nn.Module = build(0)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        ck.save(path, model, extra={"step": 1}, backend=be)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        storage = KillingStorage(point)
        ck.save(path, model, extra={"step": 2}, backend=be, storage=storage)
        return
    model = shard(build(0), be)
    opt = optimizer(model)
    train(model, opt, be.rank, be.world_size, range(1))
    ck.save(path, model, opt, extra={"step": 1})
    train(model, opt, be.rank, be.world_size, range(1, 2))
    storage = KillingStorage(point) if be.rank == die_rank else None
    ck.save(path, model, opt, extra={"step": 2}, storage=storage)


def resume_run(
    be: Backend, path: str | None, save_at: int, total: int, save_world: int | None = None
) -> dict[str, Any]:
    """Train ``total`` steps; with ``path``: the first ``save_at`` steps (at ``save_world``
    ranks, in a launch of their own run by the test) were saved there, resume from it."""
    model = shard(build(0 if path is None else 1), be)
    opt = optimizer(model)
    start = 0
    if path is not None:
        extra = ck.load(path, model, opt)
        torch.set_rng_state(extra["rng"])
        start = extra["step"]
    losses = train(model, opt, be.rank, be.world_size, range(start, total))
    return {"losses": losses, "params": full_parameters(model)}


def train_then_save(be: Backend, path: str, steps: int) -> list[float]:
    model = shard(build(0), be)
    opt = optimizer(model)
    losses = train(model, opt, be.rank, be.world_size, range(steps))
    ck.save(path, model, opt, extra={"step": steps, "rng": torch.get_rng_state()})
    return losses


class FailingStorage(ck.LocalStorage):
    """Local storage whose tensor-file writes fail (a full disk, say)."""

    def open_write(self, path: str, *, durable: bool = True) -> Any:
        if path.endswith(".safetensors"):
            raise OSError(28, "No space left on device (test)", path)
        return super().open_write(path, durable=durable)


def sync_and_async(be: Backend, sync_path: str, async_path: str) -> dict[str, Any]:
    """Save the same state synchronously and asynchronously; keep training while the async
    save writes; wait on it only after two more steps changed every parameter."""
    model = shard(build(0), be)
    opt = optimizer(model)
    train(model, opt, be.rank, be.world_size, range(2))
    ck.save(sync_path, model, opt, extra={"step": 2})
    handle = ck.save(async_path, model, opt, extra={"step": 2}, async_save=True)
    train(model, opt, be.rank, be.world_size, range(2, 4))
    committed = handle.wait()
    assert handle.done() and handle.path == committed
    return {"committed": committed}


def async_failure(be: Backend, path: str) -> str:
    model = shard(build(0), be)
    ck.save(path, model, extra={"step": 1})
    storage = FailingStorage() if be.rank == 1 else None
    handle = ck.save(path, model, extra={"step": 2}, async_save=True, storage=storage)
    try:
        handle.wait()
    except Exception as exc:  # every rank fails; rank 1 with the disk's own error
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def load_expecting_error(be: Backend, path: str) -> dict[str, Any]:
    """Load into a sharded model; report the error and whether the model stayed unchanged."""
    model = shard(build(1), be)
    sharded_layout(model)  # lazy initialisation: parameters become their local pieces
    before = {n: _local(p.detach()).clone() for n, p in model.named_parameters()}
    try:
        ck.load(path, model)
        error = "no error"
    except ck.CheckpointError as exc:
        error = f"{type(exc).__name__}: {exc}"
    unchanged = all(torch.equal(_local(p.detach()), before[n]) for n, p in model.named_parameters())
    return {"error": error, "unchanged": unchanged}


def full_state(be: Backend, rank0_only: bool, strategy: str = "full") -> dict[str, Any]:
    model = shard(build(0), be, strategy)
    opt = optimizer(model)
    train(model, opt, be.rank, be.world_size, range(1))
    return {
        "full": ck.full_state_dict(model, rank0_only=rank0_only),
        "reference": full_parameters(model),
    }
