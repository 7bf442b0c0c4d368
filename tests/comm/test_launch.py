"""`launch`: results in rank order, errors with the rank named, every start method."""

from __future__ import annotations

import pytest
import torch
from fsdp_comm import TorchBackend, launch

from . import ranks


@pytest.mark.parametrize("backend", ["torch", "threads", "fake"])
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_results_come_back_in_rank_order(backend: str, world_size: int) -> None:
    results = launch(ranks.return_tensor, world_size, backend=backend, args=(3,), timeout=60)
    assert [r["rank"] for r in results] == list(range(world_size))
    for rank, r in enumerate(results):
        assert torch.equal(r["t"], torch.full((3,), float(rank)))


@pytest.mark.parametrize("start_method", ["spawn", "fork"])
def test_other_start_methods(start_method: str) -> None:
    results = launch(ranks.return_tensor, 2, args=(1,), timeout=120, start_method=start_method)
    assert [r["ranks"] for r in results] == [(0, 1), (0, 1)]


def test_large_tensor_result() -> None:
    results = launch(ranks.return_tensor, 2, args=(1 << 22,), timeout=60)  # 16 MiB per rank
    assert results[1]["t"].sum().item() == float(1 << 22)


@pytest.mark.parametrize("backend", ["torch", "threads", "fake"])
def test_exception_keeps_its_type_and_names_the_rank(backend: str) -> None:
    with pytest.raises(ValueError, match=r"^\[rank 1\] bad input on purpose") as info:
        launch(ranks.raise_on_rank, 2, backend=backend, args=(1,), timeout=60)
    notes = "".join(getattr(info.value, "__notes__", []))
    assert "raised on rank 1" in notes and "raise_on_rank" in notes


def test_unpicklable_function_is_refused_for_forkserver() -> None:
    with pytest.raises(TypeError, match="picklable.*start_method='fork'"):
        launch(lambda be: 1, 2)


def test_closure_runs_with_fork() -> None:
    offset = 10
    assert launch(lambda be: be.rank + offset, 2, start_method="fork", timeout=60) == [10, 11]


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_world_size_is_validated(bad) -> None:
    with pytest.raises(ValueError, match="world_size must be an int >= 1"):
        launch(ranks.return_tensor, bad, args=(1,))


def test_torch_backend_uses_new_collective_names_without_warnings() -> None:
    for warnings_seen in launch(ranks.collect_warnings, 2, timeout=60):
        assert not [w for w in warnings_seen if "FutureWarning" in w], warnings_seen


def test_torch_backend_reports_gloo_algorithms() -> None:
    caps = launch(ranks.capabilities, 2, timeout=60)[0]
    assert "pairwise exchange" in caps["all_gather_into_tensor"]
    assert "pairwise exchange" in caps["reduce_scatter_tensor"]
    assert "gloo lacks it" in caps["premul_sum"]


def test_torch_backend_starts_alone_without_torchrun_environment(monkeypatch) -> None:
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)

    def body(be):
        alone = TorchBackend()
        try:
            t = torch.ones(3)
            alone.all_reduce(t)
            return alone.world_size, t.tolist()
        finally:
            alone.close()

    assert launch(body, 1, backend="fake", timeout=60) == [(1, [1.0, 1.0, 1.0])]
