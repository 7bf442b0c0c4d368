"""fsdp_engine's root lazy initialisation agrees on the shard layout through `fsdp_comm.agree`
(Note [layout agreement] in fsdp_engine/_layout_agreement.py): one small all-reduce per root,
none per step, and ranks that wrapped the model differently are told what differs."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from fsdp_comm import AgreementError, CommError, ReduceOp, ThreadsBackend, launch
from fsdp_engine import _lazy_init, fully_shard
from torch import nn


class _Counting(ThreadsBackend):
    """Records every collective the engine sends through it: (name, elements)."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.calls: list[tuple[str, int]] = []

    def _all_gather_impl(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool) -> Any:
        self.calls.append(("all_gather", out.numel()))
        return super()._all_gather_impl(out, inp, async_op)

    def _reduce_scatter_impl(
        self, out: torch.Tensor, inp: torch.Tensor, op: ReduceOp, async_op: bool
    ) -> Any:
        self.calls.append(("reduce_scatter", inp.numel()))
        return super()._reduce_scatter_impl(out, inp, op, async_op)

    def _all_reduce_impl(self, tensor: torch.Tensor, op: ReduceOp, async_op: bool) -> Any:
        self.calls.append(("all_reduce", tensor.numel()))
        return super()._all_reduce_impl(tensor, op, async_op)

    def _broadcast_impl(self, tensor: torch.Tensor, src: int, async_op: bool) -> Any:
        self.calls.append(("broadcast", tensor.numel()))
        return super()._broadcast_impl(tensor, src, async_op)


def _model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*(nn.Linear(12, 12) for _ in range(3)))


def _step(model: nn.Module, step: int) -> None:
    x = torch.randn(4, 12, generator=torch.Generator().manual_seed(step))
    model(x).sum().backward()


def _clean_rank(be: ThreadsBackend) -> list[list[tuple[str, int]]]:
    mine = _Counting(be.world, be.rank)
    model = _model()
    for layer in model:
        fully_shard(layer, mesh=mine)
    fully_shard(model, mesh=mine)
    steps = []
    for step in range(3):
        before = len(mine.calls)
        _step(model, step)
        steps.append(mine.calls[before:])
    return steps


def test_a_clean_run_pays_one_small_all_reduce_at_lazy_init_and_none_per_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with_check = launch(_clean_rank, 2, backend="threads", timeout=120)
    monkeypatch.setattr(_lazy_init, "agree_on_layout", lambda *args: None)
    without = launch(_clean_rank, 2, backend="threads", timeout=120)
    for (first, *later), (first_without, *later_without) in zip(with_check, without):
        assert later == later_without  # no collective added per step
        extra = list(first)
        for call in first_without:
            extra.remove(call)
        assert extra == [("all_reduce", 10)], extra  # the layout's digest, once per root


def _mismatched_rank(be: ThreadsBackend, case: str) -> str:
    model = _model()
    for i, layer in enumerate(model):
        if case == "units" and be.rank == 1 and i == 2:
            continue  # rank 1 leaves its last layer to the root's unit
        rf = not (case == "reshard" and be.rank == 1 and i == 0)
        fully_shard(layer, mesh=be, reshard_after_forward=rf)
    fully_shard(model, mesh=be)
    try:
        _step(model, 0)
    except CommError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def test_ranks_that_wrapped_differently_are_told_what_differs() -> None:
    # Before: the units case ended in a CommTimeoutError of a collective after the backend's
    # timeout, and the reshard case in none at all.
    results = launch(
        _mismatched_rank,
        2,
        backend="threads",
        args=("units",),
        timeout=60,
        backend_options={"timeout": 5.0},
    )
    for text in results:
        assert text.startswith(f"{AgreementError.__name__}: fully_shard layout: ranks disagree:")
        assert "rank 0 says number of units 4, rank 1 says 3" in text, text
        assert 'rank 0 says unit 2: flat sizes [[160, "float32"]], rank 1 says nothing' in text
    results = launch(
        _mismatched_rank,
        2,
        backend="threads",
        args=("reshard",),
        timeout=60,
        backend_options={"timeout": 5.0},
    )
    want = (
        "AgreementError: fully_shard layout: ranks disagree: "
        "rank 0 says unit 0: reshard_after_forward true, rank 1 says false"
    )
    assert results == [want, want]
