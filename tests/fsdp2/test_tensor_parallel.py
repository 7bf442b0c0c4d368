"""FSDP composed with tensor parallelism (Note [flat buffer on a 2-D mesh] in fsdp_engine):
torchtitan's Llama plan with sequence parallelism, then ``fully_shard`` on the data-parallel
mesh, trained against one process on the global batch, for torch's FSDP2 and ours.

Layouts: (dp 2, tp 2) and (replicate 2, shard 1, tp 2) on 4 ranks, (dp 1, tp 2) on 2; each in
fp32, bf16 parameters with fp32 reduction, activation checkpointing, two micro-batches of
gradient accumulation, a loss-parallel cross-entropy, and without sequence parallelism
(plain norms: parameters on two meshes, which only our clip_grad_norm_ handles). Shapes are
uneven after the tp split (tp_ranks.py). Then ``dp_mesh_dims`` (FSDP2's SPMD mesh): FSDP,
hybrid, several shard dims, replication only, FSDP x TP and hybrid x TP, against one process.
"""

from __future__ import annotations

import functools

import pytest
import torch
from fsdp_comm import launch

from . import tp_ranks
from .harness import IMPLS

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(600),
    # torch 2.11's DTensor cannot run this sequence-parallel plan, torch's FSDP2 or not
    # (a linear's view of a sequence-sharded activation: "Attempted to flatten multiple
    # dimensions, with dimension 1 being sharded"), and has no DataParallelMeshDims.
    pytest.mark.skipif(
        tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) < (2, 13),
        reason="needs torch >= 2.13 (DTensor, DataParallelMeshDims)",
    ),
]

LAYOUTS = {4: ("dp2tp2", "hsdp"), 2: ("dp1tp2",)}
_RESULTS: dict[tuple[str, int], object] = {}


def _results(impl: str, world: int) -> list[dict]:
    key = (impl, world)
    if key not in _RESULTS:
        from ..forkserver_preload import warm_forkserver

        try:
            warm_forkserver()
            _RESULTS[key] = launch(
                tp_ranks.run, world, backend="torch", args=(impl, LAYOUTS[world]), timeout=500
            )
        except Exception as exc:  # noqa: BLE001 - raised for every reader
            _RESULTS[key] = exc
    value = _RESULTS[key]
    if isinstance(value, Exception):
        raise value
    return value  # type: ignore[return-value]


@functools.cache
def _reference(config: str) -> dict:
    steps = dict(tp_ranks.SECTIONS)[config]
    return tp_ranks.reference(config, steps)


# fp32: summation orders differ (tp splits the contractions) -> 1e-5 relative on losses,
# 2e-5 absolute on parameters after AdamW. bf16 compute against bf16 compute in one process.
TOL = {
    "fp32": (1e-5, 2e-5),
    "ac": (1e-5, 2e-5),
    "accum": (1e-5, 2e-5),
    "loss_parallel": (1e-5, 2e-5),
    "mixed_meshes": (1e-5, 2e-5),
    "bf16": (2e-2, 5e-2),
}


def _cases() -> list:
    return [
        pytest.param(
            impl.values[0],
            world,
            layout,
            config,
            marks=impl.marks,
            id=f"{impl.id}-{layout}-{config}",
        )
        for impl in IMPLS
        for world, layouts in LAYOUTS.items()
        for layout in layouts
        for config, _ in tp_ranks.SECTIONS
    ]


@pytest.mark.parametrize(("impl", "world", "layout", "config"), _cases())
def test_trains_like_one_process(impl: str, world: int, layout: str, config: str) -> None:
    per_rank = [r[(layout, config)] for r in _results(impl, world)]
    for rank, res in enumerate(per_rank):
        if "error" in res:
            pytest.fail(f"rank {rank}:\n{res['error']}")
    ref = _reference(config)
    rtol, atol = TOL[config]
    dp = 2 if layout != "dp1tp2" else 1
    # Every tp rank of a dp group computes the same loss; the dp groups' mean is the global.
    losses = [
        sum(per_rank[r]["losses"][s] for r in range(0, world, 2)) / dp
        for s in range(len(ref["losses"]))
    ]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref["losses"]), rtol=rtol, atol=0)
    if config == "mixed_meshes" and impl == "torch":
        # Norms on a (dp, tp) mesh and plain ones on dp: torch's clip_grad_norm_ cannot
        # combine them (pytorch#180346), so this run did not clip. fsdp_engine's does (the
        # "ours" case checks its norm and the training it clipped).
        assert per_rank[0]["torch_clip_fails"], "torch's clip_grad_norm_ now handles two meshes"
        return
    torch.testing.assert_close(
        torch.tensor(per_rank[0]["norms"]), torch.tensor(ref["norms"]), rtol=max(rtol, 1e-5), atol=0
    )
    if per_rank[0]["ours_norms"]:  # fsdp_engine.clip_grad_norm_: the same norm
        torch.testing.assert_close(
            torch.tensor(per_rank[0]["ours_norms"]),
            torch.tensor(per_rank[0]["norms"]),
            rtol=1e-6,
            atol=0,
        )
    for rank, res in enumerate(per_rank):
        for name, value in ref["final"].items():
            torch.testing.assert_close(
                res["final"][name],
                value,
                rtol=rtol,
                atol=atol,
                msg=lambda m, n=name, r=rank: f"rank {r} {n}: {m}",
            )


@pytest.mark.parametrize("impl", [p.values[0] for p in IMPLS])
def test_parameters_are_dtensors_on_the_2d_mesh(impl: str) -> None:
    res = _results(impl, 4)[0][("dp2tp2", "fp32")]
    if "error" in res:
        pytest.fail(res["error"])
    assert set(res["meshes"].values()) == {("dp", "tp")}
    placements = res["placements"]
    strided = "_StridedShard(dim=0, sf=2)"
    assert placements["blocks.0.wq.weight"] == (strided, "Shard(dim=0)")
    assert placements["blocks.0.wo.weight"] == ("Shard(dim=0)", "Shard(dim=1)")
    assert placements["blocks.0.wo.bias"] == ("Shard(dim=0)", "Replicate()")
    assert placements["blocks.0.attention_norm.weight"] == ("Shard(dim=0)", "Replicate()")
    assert placements["tok.weight"] == (strided, "Shard(dim=0)")
    hsdp = _results(impl, 4)[0][("hsdp", "fp32")]
    assert hsdp["placements"]["blocks.0.w1.weight"] == ("Replicate()", strided, "Shard(dim=0)")
    assert set(hsdp["meshes"].values()) == {("replicate", "shard", "tp")}


# ---- dp_mesh_dims (FSDP2's SPMD mesh: parameters already DTensors on the whole mesh) -------
_SPMD: dict[str, object] = {}


def _spmd_results(impl: str) -> list[dict]:
    if impl not in _SPMD:
        try:
            _SPMD[impl] = launch(
                tp_ranks.spmd_run,
                4,
                backend="torch",
                args=(impl, tuple(tp_ranks.SPMD_CASES)),
                timeout=400,
            )
        except Exception as exc:  # noqa: BLE001
            _SPMD[impl] = exc
    value = _SPMD[impl]
    if isinstance(value, Exception):
        raise value
    return value  # type: ignore[return-value]


@pytest.mark.parametrize("case", list(tp_ranks.SPMD_CASES))
@pytest.mark.parametrize("impl", [p.values[0] for p in IMPLS])
def test_dp_mesh_dims_trains_like_one_process(impl: str, case: str) -> None:
    per_rank = [r[case] for r in _spmd_results(impl)]
    for rank, res in enumerate(per_rank):
        if "error" in res:
            pytest.fail(f"rank {rank}:\n{res['error']}")
    ref = tp_ranks.spmd_reference(per_rank[0]["dp"])
    for rank, res in enumerate(per_rank):
        for name, value in ref.items():
            torch.testing.assert_close(
                res["final"][name],
                value,
                rtol=1e-5,
                atol=2e-6,
                msg=lambda m, n=name, r=rank: f"rank {r} {n}: {m}",
            )
    if case == "fsdp_tp":
        placements = per_rank[0]["placements"]
        assert placements["in_proj.weight"] == ("Shard(dim=1)", "Shard(dim=0)")
        assert placements["out_proj.weight"] == ("Shard(dim=0)", "Shard(dim=1)")
        assert placements["in_proj.bias"] == ("Shard(dim=0)", "Replicate()")


def test_param_init_fn_on_a_meta_tp_model() -> None:
    """Deferred init (the paper's, unit by unit) of a model cut by tp on meta: each rank
    initialises its pieces with DTensor's random ops, so every rank assembles the same full
    parameters; a step runs. Ours only (FSDP2 has no param_init_fn: it uses to_empty)."""
    results = launch(tp_ranks.meta_init_run, 4, backend="torch", timeout=300)
    for res in results:
        assert not res["meta"], res["meta"]
        assert torch.isfinite(torch.tensor(res["loss"]))
    first = results[0]["full"]
    assert first["blocks.0.wq.weight"].abs().sum() > 0
    for res in results[1:]:
        for name, value in first.items():
            torch.testing.assert_close(res["full"][name], value, rtol=0, atol=0)
