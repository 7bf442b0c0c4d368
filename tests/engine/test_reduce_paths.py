"""Gradient reduction shortcuts (Note [reducing into the gradient] in fsdp_engine's
``_unit_reduce.py``; Note [shared-memory collectives without gloo] in fsdp_comm): the
reduce-scatter's output becomes the sharded gradient without a copy, and training over the
shared-memory reduce-scatter gives bitwise the results of the pairwise exchange."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from fsdp_comm import ThreadsBackend, launch
from fsdp_comm._shm_collectives import stores_are_ordered

from .models import make_batch
from .parity import RunConfig, _train
from .test_hot_path import _sharded, _states

_LOCK = threading.Lock()


def _owned_rank(be: Any, outs: list[torch.Tensor]) -> bool:
    model = _sharded(be)
    _train(model, RunConfig(steps=2), lambda i: make_batch(i, be.rank, be.world_size), None)
    model.zero_grad(set_to_none=True)
    x, y = make_batch(5, be.rank, be.world_size)
    torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    flats = [g.flat for s in _states(model) for g in s.unit.groups if g.flat.requires_grad]
    with _LOCK:
        return all(any(f.sharded_grad is o for o in outs) for f in flats)


def test_reduce_scatter_output_becomes_the_gradient(monkeypatch) -> None:
    outs: list[torch.Tensor] = []
    original = ThreadsBackend.reduce_scatter_tensor

    def recording(self, out, inp, **kwargs):
        with _LOCK:
            outs.append(out)
        return original(self, out, inp, **kwargs)

    monkeypatch.setattr(ThreadsBackend, "reduce_scatter_tensor", recording)
    assert all(launch(_owned_rank, 2, args=(outs,), backend="threads", timeout=120))


def _train_rank(be: Any) -> dict[str, Any]:
    model = _sharded(be)
    losses = _train(
        model, RunConfig(steps=3), lambda i: make_batch(i, be.rank, be.world_size), None
    )
    params = [p.to_local().clone() for p in model.parameters()]
    return {"losses": losses, "params": params, "scatters": be.shared_memory_reduce_scatters}


@pytest.mark.skipif(not stores_are_ordered(), reason="the shared-memory path needs ordered stores")
@pytest.mark.parametrize("world_size", [2, 4])
def test_shared_memory_reduce_scatter_trains_like_pairwise(world_size: int) -> None:
    shm = {"reduce_scatter_shm_min_bytes": 0, "reduce_scatter_pairwise_min_bytes": 0}
    pairwise = {"reduce_scatter_shm_min_bytes": None, "reduce_scatter_pairwise_min_bytes": 0}
    got = launch(_train_rank, world_size, backend_options=shm, threads_per_rank=1, timeout=300)
    want = launch(
        _train_rank, world_size, backend_options=pairwise, threads_per_rank=1, timeout=300
    )
    for g, w in zip(got, want):
        assert g["scatters"] > 0 and w["scatters"] == 0
        assert g["losses"] == w["losses"]
        assert all(torch.equal(a, b) for a, b in zip(g["params"], w["params"]))


def _staged_rank(be: Any) -> dict[str, Any]:
    """`_train_rank`, counting the staged calls (Note [staged collectives] in fsdp_comm) and
    the plain ones the engine made."""
    calls = {
        "all_gather_copy_out": 0,
        "reduce_scatter_copy_in": 0,
        "all_gather_into_tensor": 0,
        "reduce_scatter_tensor": 0,
    }
    for name in calls:
        original = getattr(be, name)

        def counting(
            *args: Any, _name: str = name, _original: Any = original, **kwargs: Any
        ) -> Any:
            calls[_name] += 1
            return _original(*args, **kwargs)

        setattr(be, name, counting)
    result = _train_rank(be)
    result["gathers"] = be.shared_memory_all_gathers
    return {**result, "calls": calls}


@pytest.mark.skipif(not stores_are_ordered(), reason="the shared-memory path needs ordered stores")
@pytest.mark.parametrize("world_size", [2, 4])
def test_staged_collectives_train_like_unstaged(world_size: int) -> None:
    """Every all-gather and reduce-scatter staged through shared memory (the layout copies
    read and write the segment): bitwise the training of the pairwise exchange."""
    pairwise = {"all_gather_pairwise_min_bytes": 0, "reduce_scatter_pairwise_min_bytes": 0}
    staged = {**pairwise, "all_gather_shm_min_bytes": 0, "reduce_scatter_shm_min_bytes": 0}
    plain = {**pairwise, "all_gather_shm_min_bytes": None, "reduce_scatter_shm_min_bytes": None}
    got = launch(_staged_rank, world_size, backend_options=staged, threads_per_rank=1, timeout=300)
    want = launch(_staged_rank, world_size, backend_options=plain, threads_per_rank=1, timeout=300)
    for g, w in zip(got, want):
        assert g["gathers"] > 0 and g["scatters"] > 0, g["calls"]
        assert g["calls"]["all_gather_copy_out"] > 0 and g["calls"]["reduce_scatter_copy_in"] > 0
        assert w["calls"]["all_gather_copy_out"] == w["calls"]["reduce_scatter_copy_in"] == 0
        assert g["losses"] == w["losses"]
        assert all(torch.equal(a, b) for a, b in zip(g["params"], w["params"]))
