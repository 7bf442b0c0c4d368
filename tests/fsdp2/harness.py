"""Shared set-up for the FSDP2 drop-in tests: the implementations, the launched runs, the
one-process reference.

Every test is parametrised over ``IMPLS``: "torch" is ``torch.distributed.fsdp.fully_shard``,
"ours" is ``fsdp_engine.fully_shard``, called the same way. The checks of one implementation at
one world size run in one launched group (`RUNS`; see ranks.run_sections) whose result is cached
for the session, failures included, so each test reads its own section and a broken
implementation costs one launch, not one per test.
"""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from typing import Any

import pytest
import torch
from fsdp_comm import launch

from . import ranks
from .models import build, loss_fn, make_optimizer

# Remove the mark when fsdp_engine.fully_shard is the FSDP2 drop-in: the one line to change.
OURS_MARKS: list = []
IMPLS = [pytest.param("torch", id="torch"), pytest.param("ours", marks=OURS_MARKS, id="ours")]

TIMEOUT = 300  # seconds for one launched group
CLIP = 0.5  # below every step's gradient norm here, so clipping always acts
DCP_STEPS = 2  # steps before the checkpoint of the world-size-4 run

# The sections each launched group runs: (name, mesh kind, *args); see ranks.SECTIONS.
_OPTIM_W2 = ("adamw_foreach", "adamw_forloop", "adamw_fused", "sgd_momentum")
RUNS: dict[int, tuple[tuple[Any, ...], ...]] = {
    2: (
        ("structure", "1d"),
        ("state_dict", "1d"),
        *(("optim", "1d", kind) for kind in _OPTIM_W2),
        ("optim", "1d", "adamw_foreach", False),  # reshard_after_forward=False
        ("clip", "1d", CLIP),
        ("hooks", "1d"),
        ("unshard", "1d", False),  # before the first forward
        ("unshard", "1d", True),  # after a training step
        ("dcp_api", "1d", "sharded"),
        ("dcp_api", "1d", "full"),
        ("dcp_api", "1d", "full_cpu_offload"),
        ("forward_method", "1d"),
    ),
    4: (
        ("structure", "1d"),
        ("structure", "hsdp"),
        ("state_dict", "1d"),
        ("state_dict", "hsdp"),
        ("optim", "1d", "adamw_foreach"),
        ("optim", "hsdp", "adamw_foreach"),
        ("clip", "1d", CLIP),
        ("clip", "hsdp", CLIP),
        ("hooks", "1d"),
        ("unshard", "1d", False),
        ("dcp_save", "1d", DCP_STEPS),  # the checkpoint path is added per implementation
    ),
}


def cases(name: str) -> list[Any]:
    """pytest params ``(impl, world, key)`` for every planned section called ``name``."""
    out = []
    for world, keys in RUNS.items():
        for key in keys:
            if key[0] == name:
                out.append((world, key))
    return [
        pytest.param(
            impl.values[0],
            world,
            key,
            marks=impl.marks,
            id=f"{impl.id}-w{world}-" + "-".join(str(k) for k in key[1:]),
        )
        for impl in IMPLS
        for world, key in out
    ]


# ---- launched runs ---------------------------------------------------------------------------
_CACHE: dict[Any, Any] = {}


def _cached(key: Any, fn: Any) -> Any:
    """``fn()`` once per session; an exception is cached too and raised again."""
    if key not in _CACHE:
        try:
            _CACHE[key] = ("ok", fn())
        except BaseException as exc:  # a pytest-timeout failure included
            if isinstance(exc, KeyboardInterrupt):
                raise
            _CACHE[key] = ("err", exc)
    kind, value = _CACHE[key]
    if kind == "err":
        raise value
    return value


@functools.cache
def checkpoint_dir(impl: str) -> str:
    path = tempfile.mkdtemp(prefix=f"fsdp2-dcp-{impl}-")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def _with_path(impl: str, key: tuple[Any, ...]) -> tuple[Any, ...]:
    if key[0] in ("dcp_save", "dcp_load"):
        return (key[0], key[1], checkpoint_dir(impl), *key[2:])
    return key


def _warm_forkserver() -> None:
    """Ranks forked from a server with the FSDP2/DTensor/DCP modules and fsdp_engine imported
    (see tests/forkserver_preload.py): ~3 s of CPU per rank of every launch saved."""
    from ..forkserver_preload import warm_forkserver

    warm_forkserver()


def _launch(impl: str, world: int, keys: tuple[tuple[Any, ...], ...]) -> list[dict[Any, Any]]:
    _warm_forkserver()
    return launch(ranks.run_sections, world, backend="torch", args=(impl, keys), timeout=TIMEOUT)


def run(impl: str, world: int) -> list[dict[Any, Any]]:
    """Every rank's results of the planned sections of ``RUNS[world]``."""
    keys = tuple(_with_path(impl, k) for k in RUNS[world])
    return _cached(("run", impl, world), lambda: _launch(impl, world, keys))


def section(impl: str, world: int, key: tuple[Any, ...]) -> list[dict[str, Any]]:
    """One section's result on every rank; its error (from any rank) as a test failure."""
    results = run(impl, world)
    full_key = _with_path(impl, key)
    per_rank = [r[full_key] for r in results]
    for rank, res in enumerate(per_rank):
        if "error" in res:
            pytest.fail(f"section {key} failed on rank {rank}:\n{res['error']}")
    return per_rank


def dcp_load(impl: str) -> list[dict[str, Any]]:
    """World size 2 resumes from the checkpoint the world-size-4 run saved."""
    section(impl, 4, ("dcp_save", "1d", DCP_STEPS))  # the checkpoint exists
    key = _with_path(impl, ("dcp_load", "1d", DCP_STEPS))
    results = _cached(("dcp_load", impl), lambda: _launch(impl, 2, (key,)))
    per_rank = [r[key] for r in results]
    for rank, res in enumerate(per_rank):
        if "error" in res:
            pytest.fail(f"dcp_load failed on rank {rank}:\n{res['error']}")
    return per_rank


def mean_losses(per_rank: list[dict[str, Any]], field: str = "losses") -> list[float]:
    """The global-batch loss of each step: the mean of the ranks' equal-slice losses."""
    n = len(per_rank[0][field])
    return [sum(r[field][i] for r in per_rank) / len(per_rank) for i in range(n)]


# ---- the one-process reference ---------------------------------------------------------------
@functools.cache
def reference_init() -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in build().named_parameters()}


@functools.cache
def reference_shapes() -> dict[str, tuple[tuple[int, ...], int]]:
    return {n: (tuple(p.shape), p.ndim) for n, p in build().named_parameters()}


@functools.cache
def reference_grads() -> dict[str, torch.Tensor]:
    """The gradients of the first global-batch backward from the initial weights."""
    model = build()
    loss_fn(model, 0).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@functools.cache
def reference_train(kind: str, steps: int, clip: float | None = None) -> dict[str, Any]:
    """Losses, returned norms, the first step's clipped gradients and the final parameters (and
    the parameters after every step) of one-process training on the global batch."""
    model = build()
    opt = make_optimizer(kind, model.parameters())
    losses, norms, params_after = [], [], []
    first_clipped = None
    for step in range(steps):
        loss = loss_fn(model, step)
        loss.backward()
        if clip is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
            if first_clipped is None:
                first_clipped = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        params_after.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return {
        "losses": losses,
        "norms": norms,
        "first_clipped": first_clipped,
        "final": params_after[-1],
        "params_after": params_after,
    }


# ---- comparisons -----------------------------------------------------------------------------
LOSS_TOL = {"rtol": 1e-5, "atol": 1e-6}
PARAM_TOL = {"rtol": 1e-4, "atol": 1e-5}


def assert_losses(got: list[float], want: list[float], what: str = "losses") -> None:
    torch.testing.assert_close(
        torch.tensor(got, dtype=torch.float64),
        torch.tensor(want, dtype=torch.float64),
        **LOSS_TOL,
        msg=lambda m: f"{what}: {got} vs reference {want}\n{m}",
    )


def assert_tensors(
    got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str, exact: bool = False
) -> None:
    assert set(got) == set(want), f"{what}: names differ: {sorted(set(got) ^ set(want))}"
    for name, value in want.items():
        tol = {"rtol": 0, "atol": 0} if exact else PARAM_TOL
        torch.testing.assert_close(
            got[name], value, **tol, msg=lambda m, n=name: f"{what} {n}: {m}"
        )


def shard_local_shape(global_shape: tuple[int, ...], index: int, shards: int) -> tuple[int, ...]:
    """The local shape of ``Shard(0)`` on shard ``index`` of ``shards`` (torch.chunk's split:
    ceil-sized pieces, the last ones short or empty)."""
    if not global_shape:
        return global_shape
    rows = global_shape[0]
    size = -(-rows // shards)
    mine = max(0, min(rows, (index + 1) * size) - index * size)
    return (mine, *global_shape[1:])


def layout(mesh_kind: str, world: int, rank: int) -> dict[str, Any]:
    """What fully_shard on this mesh must give every parameter: placements, mesh shape, and the
    shard index of ``rank``."""
    if mesh_kind == "1d":
        return {
            "placements": ("Shard(dim=0)",),
            "mesh_shape": (world,),
            "index": rank,
            "shards": world,
        }
    assert mesh_kind == "hsdp" and world == 4
    return {
        "placements": ("Replicate()", "Shard(dim=0)"),
        "mesh_shape": (2, 2),
        "index": rank % 2,
        "shards": 2,
    }


def assert_sharded(desc: dict[str, Any], name: str, mesh_kind: str, world: int, rank: int) -> None:
    """``desc`` (ranks._describe of a tensor) is the DTensor fully_shard must give ``name``."""
    shape, ndim = reference_shapes()[name]
    want = layout(mesh_kind, world, rank)
    assert desc["is_dtensor"], f"{name} on rank {rank} is a {desc['type']}, not a DTensor"
    assert desc["placements"] == want["placements"], (name, rank, desc["placements"])
    assert desc["mesh_shape"] == want["mesh_shape"], (name, rank, desc["mesh_shape"])
    assert desc["shape"] == shape and desc["ndim"] == ndim, (name, rank, desc["shape"])
    local = shard_local_shape(shape, want["index"], want["shards"])
    assert desc["local_shape"] == local, (name, rank, desc["local_shape"], local)
