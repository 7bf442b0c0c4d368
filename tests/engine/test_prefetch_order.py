"""Backward prefetch follows the order in which forwards end (Note [backward prefetch order] in
fsdp_engine's ``_state.py``): the root's pre-backward hook, the first of a backward, issues the
all-gather of the last block, so it runs under the root's own backward (the head's), as in
torch's FSDP2. Parametrised over this engine's `fully_shard` and torch's, with
``reshard_after_forward`` given as True; left at None, this engine keeps the last block
gathered into backward instead (Note [last unit stays]), which the last test checks."""

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


def _rank(be: Any, impl: str, reshard: bool | None = True) -> list:
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
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=None)
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


def test_default_keeps_the_last_block_gathered_into_backward() -> None:
    """``reshard_after_forward`` left at None: the block whose forward ends last is not freed
    and re-gathered at the turn of the step (the second iteration, once the order is known);
    the block before it is prefetched under the head's backward as before."""
    from fsdp_comm import launch

    for events in launch(_rank, 2, args=("ours", None), threads_per_rank=1, timeout=120):
        done = events.index(("forward done",))
        forward_gathers = [e[1] for e in events[:done] if e[0] == "gather"]
        last_block, before_last = forward_gathers[-1], forward_gathers[-2]
        backward = events[done:]
        assert ("gather", last_block) not in backward, events
        assert backward.index(("gather", before_last)) < backward.index(("head backward",)), events


def _held_after_forward(be: Any) -> list[list[bool]]:
    """Which blocks hold gathered parameters after each forward (before its backward): with
    the default, after the first step has shown the order; after
    ``set_reshard_after_forward(True)`` on the last block; with True given to fully_shard."""
    from fsdp_engine import fully_shard

    def held(model: Net) -> list[bool]:
        return [b._fsdp_state.unit.groups[0].state.value != "sharded" for b in model.blocks]

    seen = []
    for reshard in (None, True):
        torch.manual_seed(0)
        model = Net([])
        for block in model.blocks:
            fully_shard(block, mesh=be, reshard_after_forward=reshard)
        fully_shard(model, mesh=be)
        x = torch.randn(4, WIDTH)
        for step in range(3 if reshard is None else 2):
            if step == 2:
                model.blocks[-1].set_reshard_after_forward(True)
            loss = model(x).sum()
            seen.append(held(model))
            loss.backward()
    return seen


def test_last_block_stays_only_by_default() -> None:
    from fsdp_comm import launch

    for seen in launch(_held_after_forward, 2, threads_per_rank=1, timeout=120):
        assert seen == [
            [False] * 3,  # default, first step: the order is not known yet
            [False, False, True],  # default: the last block stays
            [False] * 3,  # after set_reshard_after_forward(True) on it
            [False] * 3,
            [False] * 3,
        ], seen  # True given to fully_shard
