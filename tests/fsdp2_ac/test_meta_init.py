"""Meta-device init does not materialise the whole model on any rank: 16 x Linear(2048, 2048)
(256 MiB fp32) at world size 4; the growth of each rank's resident high-water mark (VmHWM,
reset to the current RSS just before building) stays below 0.6 x the model through
materialisation and the user's init (the issue's bound), and below 1.25 x the model through one
forward + backward.

Why not 0.6 x through the step: at world size 4 the sharded parameters and the sharded gradients
alone are 0.5 x the model, and backward also holds an unsharded block and its unsharded
gradients (2 x 1/16 of the model); torch FSDP2 measured 0.88 x, this engine 1.15 x (its
rank-major layout copies each gathered block to parameter-major order and each flat gradient
back, and the pool keeps its buffers: about four blocks more at the peak of backward; Note
[rank-major layout] in fsdp_engine). The step bound shows that no rank ever held the whole model
plus its gradients. glibc's mmap threshold is fixed in the ranks
(`ranks._fix_mmap_threshold`) so that the high-water mark measures memory held, not glibc's
heap retention (about 1 GiB per rank for torch FSDP2 otherwise).

Flows: FSDP2's (fully_shard on meta, to_empty, the user's reset_parameters on the sharded
parameters) and the FSDP paper's (fully_shard(..., param_init_fn=...) materialising each unit
in turn; ours only, torch's fully_shard has no param_init_fn).
"""

from __future__ import annotations

import math

import pytest
from fsdp_comm import launch

from ..forkserver_preload import warm_forkserver
from .ranks import IMPLS, META_LAYERS, META_MODEL_BYTES, META_WIDTH, meta_rank

WORLD = 4
INIT_LIMIT = 0.6 * META_MODEL_BYTES
STEP_LIMIT = 1.25 * META_MODEL_BYTES
MIB = 2**20


def _report(impl: str, flow: str, results: list[dict]) -> str:
    rows = [
        f"rank {i}: RSS before {r['before'] / MIB:.1f} MiB, VmHWM growth: init "
        f"{r['init_growth'] / MIB:.1f}, +forward {r['forward_growth'] / MIB:.1f}, +backward "
        f"{r['step_growth'] / MIB:.1f} MiB; local params {r['local_bytes'] / MIB:.1f} MiB, "
        f"loss {r['loss']:.6g}, identical shards across ranks {r['identical_shards']}, "
        f"mmap threshold fixed {r['mmap_fixed']}"
        for i, r in enumerate(results)
    ]
    return (
        f"{impl} {flow}: model {META_MODEL_BYTES / MIB:.1f} MiB, limits init "
        f"{INIT_LIMIT / MIB:.1f} / step {STEP_LIMIT / MIB:.1f} MiB per rank\n  " + "\n  ".join(rows)
    )


def _check(impl: str, flow: str, record_property) -> None:
    warm_forkserver()  # fsdp_engine and FSDP2 imported once, not by each of the 4 ranks
    results = launch(meta_rank, WORLD, backend="torch", args=(impl, flow), timeout=300)
    report = _report(impl, flow, results)
    print(report)
    record_property("memory", report)
    for rank, r in enumerate(results):
        assert r["not_real"] == [], (rank, r["not_real"])
        assert r["num_params"] == 2 * META_LAYERS and r["grads_ok"], (rank, r)
        assert math.isfinite(r["loss"]), (rank, r["loss"])
        # DTensors of the original global shapes, each rank holding about a quarter.
        assert r["dtensor"], rank
        assert r["global_shapes"] == [(META_WIDTH,), (META_WIDTH, META_WIDTH)], r["global_shapes"]
        assert r["local_bytes"] <= META_MODEL_BYTES / WORLD + 4 * META_LAYERS * 4, r["local_bytes"]
        assert r["init_growth"] < INIT_LIMIT, f"rank {rank}\n{report}"
        assert r["step_growth"] < STEP_LIMIT, f"rank {rank}\n{report}"


@pytest.mark.slow
@pytest.mark.parametrize("impl", IMPLS)
def test_meta_init_fsdp2_flow_memory(impl: str, record_property) -> None:
    _check(impl, "fsdp2", record_property)


@pytest.mark.slow
@pytest.mark.parametrize("impl", IMPLS)
def test_meta_init_param_init_fn_flow_memory(impl: str, record_property) -> None:
    if impl == "torch":
        pytest.skip(
            "torch's fully_shard has no param_init_fn (FSDP2 materialises with "
            "to_empty after sharding)"
        )
    _check(impl, "param_init_fn", record_property)
