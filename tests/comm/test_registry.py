"""The backend registry, entry points, and swapping in a user's own backend."""

from __future__ import annotations

from importlib import metadata

import fsdp_comm
import pytest
import torch
from fsdp_comm import (
    Backend,
    BackendUnavailableError,
    FakeBackend,
    ThreadsBackend,
    _registry,
    available_backends,
    get_backend,
    init_mesh,
    register_backend,
)


class CountingBackend(ThreadsBackend):
    """A user's backend: the threads backend plus a count of all-gathers."""

    name = "counting"
    calls = 0

    def _all_gather_impl(self, out, inp, async_op):
        CountingBackend.calls += 1
        return super()._all_gather_impl(out, inp, async_op)


@pytest.fixture
def clean_registry():
    saved = dict(_registry._registered)
    yield
    _registry._registered.clear()
    _registry._registered.update(saved)


def test_builtins_are_known() -> None:
    assert {"torch", "threads", "fake", "cupy-nccl"} <= set(available_backends())


def test_register_and_use_a_custom_backend(clean_registry) -> None:
    register_backend("counting", CountingBackend.from_options)
    assert "counting" in available_backends()
    be = get_backend("counting")
    assert isinstance(be, CountingBackend)
    before = CountingBackend.calls
    be.all_gather_into_tensor(torch.empty(2), torch.ones(2))
    assert CountingBackend.calls == before + 1
    with pytest.raises(ValueError, match="already registered"):
        register_backend("counting", CountingBackend.from_options)
    register_backend("counting", CountingBackend.from_options, override=True)


def test_unknown_backend_lists_the_known_ones() -> None:
    with pytest.raises(BackendUnavailableError, match="no backend named 'nope'.*threads"):
        get_backend("nope")


def test_factory_must_return_a_backend(clean_registry) -> None:
    register_backend("broken", lambda **kw: object())
    with pytest.raises(TypeError, match="returned object, not a Backend"):
        get_backend("broken")


def test_entry_point_backends_are_found(monkeypatch: pytest.MonkeyPatch) -> None:
    ep = metadata.EntryPoint(
        name="from-plugin", value="fsdp_comm:FakeBackend", group=_registry.ENTRY_POINT_GROUP
    )
    monkeypatch.setattr(_registry, "_entry_points", lambda: [ep])
    assert "from-plugin" in available_backends()
    be = get_backend("from-plugin", rank=1, world_size=8)
    assert isinstance(be, FakeBackend) and be.rank == 1


def test_fake_backend_simulates_shapes_and_counts_traffic() -> None:
    be = FakeBackend(rank=3, world_size=64, device="meta")
    out = torch.empty(64 * 1024, device="meta")
    be.all_gather_into_tensor(out, torch.empty(1024, device="meta"))
    be.reduce_scatter_tensor(torch.empty(1024, device="meta"), out)
    mesh = init_mesh((8, 8), backend=be)
    assert mesh.coordinate == (0, 3)
    assert mesh.shard.ranks == tuple(range(8)) and mesh.replicate.ranks == tuple(range(3, 64, 8))
    assert be.traffic.calls["all_gather_into_tensor"] == 1
    assert be.traffic.bytes["reduce_scatter_tensor"] == 64 * 1024 * 4


def test_fake_backend_keeps_own_chunk() -> None:
    be = FakeBackend(rank=1, world_size=4)
    out = torch.zeros(8)
    be.all_gather_into_tensor(out, torch.ones(2))
    assert out.tolist() == [0, 0, 1, 1, 0, 0, 0, 0]
    rs = torch.empty(2)
    be.reduce_scatter_tensor(rs, torch.arange(8.0), op=fsdp_comm.ReduceOp.premul_sum(0.5))
    assert rs.tolist() == [1.0, 1.5]


@pytest.mark.parametrize(
    "shape, match",
    [
        ((3, 1), "replicate \\* shard == world size 2"),
        ((0, 2), "positive ints"),
        ((1, 1, 2), "positive"),
    ],
)
def test_mesh_shape_is_validated(shape, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        init_mesh(shape, backend=FakeBackend(world_size=2))


def test_backend_is_abstract() -> None:
    with pytest.raises(TypeError):
        Backend()  # type: ignore[abstract]
