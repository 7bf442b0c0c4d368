"""The per-unit hot path stays lean: a unit's autograd leaf outlives a gather, and
a unit whose parameters never leave its shard (a shard group of one) keeps its views and needs
no pre-backward hook. Correctness of these shortcuts is the parity tests' job; these tests
show the shortcuts are taken."""

from __future__ import annotations

import threading

import torch
from fsdp_comm import ThreadsBackend, launch
from fsdp_engine import fully_shard

from .models import Block, make_batch
from .parity import RunConfig, _train, build_model

_COUNT_LOCK = threading.Lock()


def _sharded(be):
    model = build_model()
    for block in model.blocks:
        fully_shard(block, mesh=be)
    fully_shard(model, mesh=be)
    return model


def _count_calls(monkeypatch, owner, name):
    calls = [0]
    original = getattr(owner, name)

    def counting(*args, **kwargs):
        with _COUNT_LOCK:
            calls[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, counting)
    return calls


def _steps_rank(be, steps):
    model = _sharded(be)
    _train(model, RunConfig(steps=steps), lambda i: make_batch(i, be.rank, be.world_size), None)
    return sum(g.flat.requires_grad for s in _states(model) for g in s.unit.groups)


def _states(model):
    return [m._fsdp_state for m in model.modules() if hasattr(m, "_fsdp_state")]


def test_leaf_is_made_once_per_group(monkeypatch) -> None:
    from fsdp_engine._unit_views import ViewsPart

    calls = [0]
    original = ViewsPart._point_leaf_at

    def counting(self, g, full):
        before = g.leaf
        original(self, g, full)
        with _COUNT_LOCK:
            calls[0] += g.leaf is not before

    monkeypatch.setattr(ViewsPart, "_point_leaf_at", counting)
    hooks = _count_calls(monkeypatch, torch.Tensor, "register_post_accumulate_grad_hook")
    groups = launch(_steps_rank, 2, args=(4,), backend="threads", timeout=120)
    # Four steps, every unit resharded after forward: still one leaf per trainable group, and
    # no hook on it (its application's node hands the gradients over: Note [one node per
    # application]).
    assert calls[0] == sum(groups)
    assert hooks[0] == 0


def test_resident_unit_keeps_views_and_skips_pre_backward(monkeypatch) -> None:
    be = ThreadsBackend.create(1)[0]
    model = _sharded(be)
    seen = []
    model.blocks[1].register_forward_pre_hook(lambda m, a: seen.append(m.ln2.weight))
    prehooks = _count_calls(monkeypatch, torch.autograd.graph.Node, "register_prehook")
    for step in range(3):
        x, y = make_batch(step, 0, 1)
        model(x).sum().backward()
    assert isinstance(model.blocks[1], Block)
    assert seen[0] is seen[1] is seen[2]  # the same view, cut once
    assert not isinstance(seen[0], torch.nn.Parameter)
    assert model.blocks[1].ln2.weight is not seen[0]  # the parameter is back after forward
    assert all(s.unit.resident for s in _states(model))
    # Only the root hooks its outputs for the pre-backward (once per step).
    assert prehooks[0] <= 3
