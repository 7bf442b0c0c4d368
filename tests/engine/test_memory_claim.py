"""The paper's memory claim (Section 3.2.1): per rank, parameters, gradients and optimizer
state cost sum(psi_i)/F for the shards plus, transiently, about max(psi_i) for the unit being
computed (here at most two units, the current one and the one prefetched, plus the root, which
like FSDP2's stays gathered from forward to backward)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from fsdp_comm import launch
from fsdp_engine import fully_shard, sharded_layout
from fsdp_memory import MemoryManager
from torch.distributed.tensor import DTensor

from .models import TinyGPT, make_batch

WORLD = 4


def _model() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(layers=8)


def _memory_rank(be):
    memory = MemoryManager("cpu", max_inflight_all_gathers=2)
    model = _model()
    for block in model.blocks:
        fully_shard(block, mesh=be, memory=memory)
    fully_shard(model, mesh=be, memory=memory)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    for step in range(2):
        x, y = make_batch(step, be.rank, be.world_size)
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        opt.step()
    units = [m._fsdp_state.unit for m in [*model.blocks, model]]
    root_padded = sum(g.flat.layout.padded_numel for g in units[-1].groups)
    padded = [g.flat.layout.padded_numel for u in units for g in u.groups]
    trainable = [
        g.flat.layout.padded_numel for u in units for g in u.groups if g.flat.requires_grad
    ]
    shard_bytes = sum(s.local.numel() * 4 for s in sharded_layout(model))
    grad_bytes = sum(_local(p.grad).numel() * 4 for p in model.parameters() if p.grad is not None)
    state_bytes = sum(
        _local(t).numel() * t.element_size()
        for st in opt.state.values()
        for t in st.values()
        if t.dim() > 0
    )
    return dict(
        padded=padded,
        trainable=trainable,
        shard=shard_bytes,
        grad=grad_bytes,
        state=state_bytes,
        peak=memory.stats().peak_bytes,
        root=root_padded,
        local=sum(g.flat.local_shard.numel() for u in units for g in u.groups),
    )


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def test_per_rank_bytes_follow_the_bound() -> None:
    results = launch(_memory_rank, WORLD, backend="threads", timeout=120)
    total_params = sum(p.numel() for p in _model().parameters())
    for r in results:
        padded, trainable = r["padded"], r["trainable"]
        # The shards: every unit's padded buffer split in F equal parts.
        assert r["local"] * WORLD == sum(padded)
        # Padding only: up to WORLD-1 rows per parameter (dim-0 chunks) plus alignment.
        rows = sum((WORLD - 1) * (p.numel() // p.shape[0]) for p in _model().parameters())
        assert sum(padded) - total_params < rows + 16 * len(padded) * WORLD
        # Parameters held (without padding) plus their gradients and two AdamW moments.
        assert r["shard"] <= 4 * sum(padded) / WORLD
        assert r["grad"] <= 4 * sum(trainable) / WORLD
        assert r["state"] == 2 * r["grad"]
        # Transient (pooled buffers): the root stays gathered through the step (as in FSDP2),
        # plus at most two gathered blocks in flight (the limiter's count), one more while a
        # gathered block is copied to parameter-major order, the rank-major gradients of the
        # two reductions that may be in flight (Note [rank-major layout]) and their outputs
        # (up to three blocks' shards); the pool's size classes round up by < 6.25%.
        block = max(padded)
        bound = 4 * (r["root"] + 3 * block + 2 * block + 3 * block / WORLD) * 1.0625
        assert r["peak"] <= bound, (r["peak"], bound)
        # Well below every parameter and every gradient unsharded at once (2 x padded).
        assert r["peak"] < 4 * 2 * sum(padded) / 3


class _CountingMemory(MemoryManager):
    def __init__(self) -> None:
        super().__init__("cpu", host_trim_bytes=None)
        self.reported: list[int] = []

    def release_host_heap(self, freed_bytes: int) -> bool:
        self.reported.append(freed_bytes)
        return False


def _report_rank(be):
    memory = _CountingMemory()
    model = _model()
    for block in model.blocks:
        fully_shard(block, mesh=be, memory=memory)
    fully_shard(model, mesh=be, memory=memory)
    x, y = make_batch(0, be.rank, be.world_size)
    F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    units = [m._fsdp_state.unit for m in model.modules() if hasattr(m, "_fsdp_state")]
    expected = [
        sum(g.flat.layout.padded_numel * 4 for g in u.groups if g.flat.requires_grad) for u in units
    ]
    return sorted(memory.reported), sorted(b for b in expected if b)


def test_each_unit_reports_its_freed_gradients_for_host_trimming() -> None:
    """After a unit's backward its per-parameter gradients are gone: the engine tells the
    memory layer, which trims the host heap at a bounded rate (Note [host heap])."""
    for reported, expected in launch(_report_rank, 2, backend="threads", timeout=60):
        assert reported == expected
