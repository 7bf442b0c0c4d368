"""Backward prefetch follows the order in which forwards end (Note [backward prefetch order] in
fsdp_engine's ``_state.py``): the root's pre-backward hook, the first of a backward, issues the
all-gather of the last block, so it runs under the root's own backward (the head's), as in
torch's FSDP2. Parametrised over this engine's `fully_shard` and torch's."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

IMPLS = ("ours", "torch")
WIDTH = 16


class _Mark(torch.autograd.Function):
    """Identity whose backward records that the head's backward is about to run."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, events: list) -> torch.Tensor:
        ctx.events = events
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.events.append(("head backward",))
        return grad, None


class Block(nn.Module):
    def __init__(self, i: int) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.extra = nn.Parameter(torch.zeros(64 * (i + 1)))  # a size of its own per block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x)) + self.extra.sum()


class Net(nn.Module):
    def __init__(self, events: list) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(i) for i in range(3))
        self.head = nn.Linear(WIDTH, 4)
        self.events = events

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return _Mark.apply(self.head(x), self.events)


def _record_gathers(impl: str, be: Any, events: list) -> None:
    if impl == "ours":
        for name in ("all_gather_into_tensor", "all_gather_copy_out"):
            original = getattr(be, name)

            def recording(out, *args, _original=original, **kwargs):
                events.append(("gather", out.numel()))
                return _original(out, *args, **kwargs)

            setattr(be, name, recording)
        return
    import torch.distributed as dist

    original = dist.all_gather_single

    def recording_single(out, *args, **kwargs):
        events.append(("gather", out.numel()))
        return original(out, *args, **kwargs)

    dist.all_gather_single = recording_single


def _rank(be: Any, impl: str) -> list:
    torch.manual_seed(0)
    events: list = []
    model = Net(events)
    if impl == "ours":
        from fsdp_engine import fully_shard
        mesh = be
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (be.world_size,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    _record_gathers(impl, be, events)
    x = torch.randn(4, WIDTH)
    for _ in range(2):
        events.clear()
        loss = model(x).sum()
        events.append(("forward done",))
        loss.backward()
    return events


@pytest.mark.parametrize("impl", IMPLS)
def test_root_prefetches_the_last_block_for_backward(impl: str) -> None:
    from fsdp_comm import launch

    for events in launch(_rank, 2, args=(impl,), threads_per_rank=1, timeout=120):
        done = events.index(("forward done",))
        forward_gathers = [e[1] for e in events[:done] if e[0] == "gather"]
        last_block = forward_gathers[-1]  # forward prefetch issues the blocks in order
        head = events.index(("head backward",))
        backward = events[done:]
        assert ("gather", last_block) in backward, events
        issued = done + backward.index(("gather", last_block))
        assert issued < head, f"the last block's gather came after the head's backward: {events}"
