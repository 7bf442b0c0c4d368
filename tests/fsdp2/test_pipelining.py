"""``torch.distributed.pipelining`` over FSDP stages, on torch's ``fully_shard`` and ours: every
schedule of torch 2.13 (GPipe, 1F1B, interleaved 1F1B, and the zero-bubble ones whose backward
is split into an input pass and a weight pass), 2 pipeline x 2 data-parallel ranks, uneven
shapes, gradients against one process. Before: every schedule over this engine ended in an
AttributeError at the stage's gradient reduction (Note [pipelining's reduce step]), and the
weight pass of the zero-bubble ones found no gradient (Note [split backward])."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from fsdp_comm import launch

from . import pipelining_ranks as pr
from .harness import IMPLS

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(400),
    pytest.mark.skipif(
        tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) < (2, 13),
        reason="pipelining over this engine is checked from torch 2.13 (its stage's reduce "
        "step and the split backward; Note [split backward])",
    ),
]

TOL = 1e-5


@functools.cache
def _results(impl: str) -> list[dict[str, Any]]:
    from ..forkserver_preload import warm_forkserver

    warm_forkserver()
    return launch(pr.run_all, pr.PP * pr.DP, backend="torch", args=(impl,), timeout=300)


def _case(impl: str, key: str) -> list[dict[str, Any]]:
    per_rank = [r[key] for r in _results(impl)]
    for rank, res in enumerate(per_rank):
        if "exception" in res:
            pytest.fail(f"{key} raised on rank {rank}:\n{res['exception']}")
    return per_rank


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("schedule", pr.SCHEDULES)
def test_schedule_gradients(impl: str, schedule: str) -> None:
    """Units kept gathered after forward (``reshard_after_forward=False``, which a
    zero-bubble schedule needs on FSDP2 too): every rank's gradients are the one-process
    model's, after two steps, with no warning."""
    for res in _case(impl, f"{schedule}-kept"):
        assert res.pop("warned") is False
        for name, value in res.items():
            assert isinstance(value, float), f"{name}: {value}"
            assert value <= TOL, f"{name}: differs from the reference by {value}"


@pytest.mark.parametrize("impl", IMPLS)
def test_zero_bubble_with_resharded_units_warns(impl: str) -> None:
    """ZBV with units that reshard after forward: the weight pass differentiates toward the
    registered DTensors, which no graph holds, so those micro-batches' weight gradients are
    lost on both implementations; torch's says nothing, ours warns."""
    results = _case(impl, "ScheduleZBVZeroBubble-default")
    lost = any(
        v == "gradient is None" or (isinstance(v, float) and v > TOL)
        for res in results
        for k, v in res.items()
        if k != "warned"
    )
    assert lost, "expected the resharded units' weight gradients to be lost"
    assert all(res["warned"] is (impl == "ours") for res in results)
