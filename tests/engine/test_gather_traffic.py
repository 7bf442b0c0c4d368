"""Note [in-place gather] (``_unit_gather.py``): a mixed-precision gather casts straight into
this rank's slot of the gather output; it allocates no more buffers than a gather that needs
no cast, and computes the same as one."""

from __future__ import annotations

import torch
from fsdp_comm import launch
from fsdp_engine import MixedPrecisionPolicy, fully_shard
from fsdp_memory import MemoryManager
from torch import nn


def _step_allocations(be, mp: MixedPrecisionPolicy) -> tuple[int, list[float]]:
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)  # thread ranks share torch's global generator
    model = nn.Sequential(*(nn.Linear(13, 13) for _ in range(3)))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    memory = MemoryManager("cpu", pooling=False, max_inflight_all_gathers=None)
    for layer in model:
        fully_shard(layer, mesh=be, mp_policy=mp, memory=memory)
    fully_shard(model, mesh=be, mp_policy=mp, memory=memory)
    x = torch.randn(4, 13, generator=gen)
    model(x).sum().backward()  # lazy init and first-step allocations
    before = memory.stats().num_allocs
    model(x).sum().backward()
    grads = [float(p.grad.to_local().double().sum()) for p in model.parameters()]
    return memory.stats().num_allocs - before, grads


def _rank(be) -> tuple[tuple[int, list[float]], tuple[int, list[float]]]:
    same = _step_allocations(be, MixedPrecisionPolicy())
    cast = _step_allocations(be, MixedPrecisionPolicy(param_dtype=torch.float64,
                                                      reduce_dtype=torch.float32))
    return same, cast


def test_mixed_precision_gather_allocates_no_send_buffer() -> None:
    for (same_allocs, same_grads), (cast_allocs, cast_grads) in launch(
            _rank, 2, backend="threads", timeout=120):
        # Before: one send buffer per cast gather, 6 more per step (3 units, forward and
        # backward's re-gather).
        assert cast_allocs == same_allocs, (cast_allocs, same_allocs)
        assert all(abs(a - b) <= 1e-6 * max(1.0, abs(b)) for a, b in zip(cast_grads, same_grads)), \
            (cast_grads, same_grads)
