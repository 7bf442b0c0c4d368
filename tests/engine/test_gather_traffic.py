"""What a mixed-precision step moves: Note [in-place gather] (``_unit_gather.py``), a gather
casts straight into this rank's slot of the gather output, allocating no more buffers than a
gather that needs no cast and computing the same; Note [one gradient pass]
(``_unit_reduce.py``), the bf16 flat gradient is cast by its copy into rank-major order; and
a shard group of one casts without a collective."""

from __future__ import annotations

import copy

import torch
from fsdp_comm import ThreadsBackend, launch
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
    cast = _step_allocations(
        be, MixedPrecisionPolicy(param_dtype=torch.float64, reduce_dtype=torch.float32)
    )
    return same, cast


def test_mixed_precision_gather_allocates_no_send_buffer() -> None:
    for (same_allocs, same_grads), (cast_allocs, cast_grads) in launch(
        _rank, 2, backend="threads", timeout=120
    ):
        # Before: one send buffer per cast gather, 6 more per step (3 units, forward and
        # backward's re-gather).
        assert cast_allocs == same_allocs, (cast_allocs, same_allocs)
        assert all(abs(a - b) <= 1e-6 * max(1.0, abs(b)) for a, b in zip(cast_grads, same_grads)), (
            cast_grads,
            same_grads,
        )


def _casts_in_backward(be) -> int:
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountCasts(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.casts = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._to_copy.default and args[0].numel() >= 13 * 13:
                self.casts += 1
            return func(*args, **(kwargs or {}))

    torch.set_num_threads(1)
    model = nn.Sequential(*(nn.Linear(13, 13) for _ in range(3)))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model:
        fully_shard(layer, mesh=be, mp_policy=mp)
    fully_shard(model, mesh=be, mp_policy=mp)
    x = torch.randn(4, 13)
    model(x).sum().backward()
    loss = model(x).sum()
    with CountCasts() as mode:
        loss.backward()
    return mode.casts


def test_bf16_gradients_are_cast_by_the_rank_major_copy() -> None:
    # Note [one gradient pass] (_unit_reduce.py): before, each unit's flat bf16 gradient was
    # cast to a new fp32 tensor (one `_to_copy` per unit) and then copied to rank-major order.
    assert launch(_casts_in_backward, 2, backend="threads", timeout=120) == [0, 0]


class _CountingThreads(ThreadsBackend):
    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.gathers = 0

    def _all_gather_impl(self, out, inp, async_op):
        self.gathers += 1
        return super()._all_gather_impl(out, inp, async_op)


def test_no_collective_gathers_a_cast_unit_at_world_size_one() -> None:
    # FSDP2 issues none either; before, each bf16 unit "gathered" over a group of one.
    be = _CountingThreads.create(1)[0]
    model = nn.Sequential(*(nn.Linear(13, 13) for _ in range(3)))
    ref = copy.deepcopy(model).to(torch.bfloat16)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model:
        fully_shard(layer, mesh=be, mp_policy=mp)
    fully_shard(model, mesh=be, mp_policy=mp)
    x = torch.randn(4, 13)
    out = model(x)
    out.float().sum().backward()
    ref(x.to(torch.bfloat16)).float().sum().backward()
    assert be.gathers == 0
    assert torch.equal(out, ref(x.to(torch.bfloat16)))
    for p, r in zip(model.parameters(), ref.parameters()):
        assert torch.allclose(p.grad.to_local(), r.grad.float(), rtol=0, atol=1e-2)
