"""torchtitan's own Llama3 parallelisation trained on CPU/gloo, with each FSDP implementation.

torchtitan's ``parallelize_llama`` (selective activation checkpointing + ``apply_fsdp_to_decoder``)
runs with the implementation under test patched in as its ``fully_shard``: torch's FSDP2
(``torch.distributed.fsdp.fully_shard``) and ours (``fsdp_engine.fully_shard``, meant to be a
drop-in). A tiny Llama3 trains 6 steps at 4 ranks, saving a torchtitan ``CheckpointManager``
checkpoint after step 3; 2 ranks resume from it and train steps 4-6. Checked against a
one-process run (no FSDP, no activation checkpointing) of the same model from the same initial
weights (gathered from the sharded model after ``init_weights``), and the resumed run against
the uninterrupted one: losses and clip norms to 1e-5 relative. The rank code and the CPU patches
torchtitan 0.3.0 needs are in ``titan_ranks.py``.

The 2-D tests run torchtitan's FSDP x tensor parallelism (``titan_tp_ranks.py``): dp 2 x tp 2
on 4 ranks with sequence parallelism and loss parallelism, through two of torchtitan's SPMD
backends (``partial_dtensor``: tp DTensors + ``fully_shard(mesh=dp_mesh)``; ``full_dtensor``:
DTensors on the whole mesh + ``fully_shard(dp_mesh_dims=...)``), checked the same way against
one process, then resumed on 2 ranks at dp 1 x tp 2 (``partial_dtensor``) or dp 2 x tp 1
(``full_dtensor``) from the 4-rank checkpoint.

Needs torchtitan and the pure-Python packages it imports on this path (tyro, spmd_types);
skipped without them. Every selected test's runs happen in one fresh interpreter (torchtitan
imported once, ~10 s on 2 cores; the ranks forked from it), each test reading its own results:
~30 s for the 1-D tests, ~30 s more for the 2-D ones on 2 cores.
"""

from __future__ import annotations

import importlib.util
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torchtitan", minversion="0.3.0")
_MISSING = [m for m in ("tyro", "spmd_types") if importlib.util.find_spec(m) is None]
if _MISSING:
    pytest.skip(
        f"torchtitan needs {', '.join(_MISSING)} (pip install --no-deps)", allow_module_level=True
    )

import torch  # noqa: E402
from torch.distributed.fsdp import DataParallelMeshDims  # noqa: E402
from torch.distributed.tensor import Replicate, Shard  # noqa: E402
from torch.distributed.tensor.placement_types import _StridedShard  # noqa: E402

from . import titan_ranks as R  # noqa: E402
from . import titan_tp_ranks as TPR  # noqa: E402

# Frameworks' own loops (their legs in .ci/run: python -m pytest -m frameworks).
pytestmark = pytest.mark.frameworks

REPO = Path(__file__).resolve().parents[2]
RTOL = 1e-5
# 2-D runs against one process. Tensor and sequence parallelism change the order of fp32 sums
# (row-parallel matmuls add the tp halves of K after an all-reduce, loss-parallel CE adds the
# vocabulary halves' exp-sums, the norm adds per-shard squares), so the runs differ from one
# process by a few ulps (fp32 eps 1.2e-7) that 6 AdamW steps carry along: measured on 2 cores,
# at most 1.6e-7 (losses) and 3.4e-7 (clip norms), both backends and implementations, fresh
# and resumed. 2e-6 leaves ~6x of that. A real error shows in the clip norms far above it:
# halving every RMSNorm weight's gradient (a tp reduction missed on the sequence-parallel
# norms) moves them by 2e-2 (AdamW's update normalisation hides it from the losses).
RTOL_TP = 2e-6

IMPLS = [
    "torch",
    "ours",
]
TP_RUNS = [(impl, backend) for backend in TPR.BACKENDS for impl in IMPLS]

_FLAT_TESTS = {"test_llama3_parallelize_train_checkpoint_resume"}
_TP_TESTS = {"test_llama3_fsdp_tp_train", "test_llama3_fsdp_tp_checkpoint_resume"}


@pytest.fixture(scope="module")
def scenarios(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[int, str, dict | None]:
    """Every implementation's runs of the selected tests' parts (``flat``: the 1-D tests,
    ``tp``: the 2-D ones) in one fresh interpreter (``titan_tp_ranks.main``: it imports
    torchtitan once and forks the ranks from there): (exit code, stderr tail, results by
    part)."""
    selected = {
        getattr(item, "originalname", item.name)
        for item in request.session.items
        if item.module is request.module
    }
    parts = [
        part for part, names in (("flat", _FLAT_TESTS), ("tp", _TP_TESTS)) if selected & names
    ] or ["flat", "tp"]
    workdir = tmp_path_factory.mktemp("titan")
    out = workdir / "result.pkl"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.integration.titan_tp_ranks",
            ",".join(parts),
            ",".join(IMPLS),
            str(workdir),
            str(out),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return (
        proc.returncode,
        proc.stderr[-6000:],
        pickle.loads(out.read_bytes()) if proc.returncode == 0 else None,
    )


def _scenario(key: str, scenarios: tuple[int, str, dict | None], part: str = "flat") -> dict:
    returncode, stderr, results = scenarios
    assert returncode == 0, (
        f"torchtitan scenarios ({', '.join(IMPLS)}) failed (exit {returncode}):\n{stderr}"
    )
    result = results[part][key]
    assert "error" not in result, (
        f"torchtitan scenario {key!r} (the implementation's fully_shard) failed:\n"
        f"{result['error'][-6000:]}"
    )
    return result


def _close(got: list[float], want: list[float], what: str, rtol: float = RTOL) -> None:
    torch.testing.assert_close(
        torch.tensor(got, dtype=torch.float64),
        torch.tensor(want, dtype=torch.float64),
        rtol=rtol,
        atol=0.0,
        msg=lambda m: f"{what}: {got} vs {want}\n{m}",
    )


@pytest.mark.slow
@pytest.mark.parametrize("impl", IMPLS)
def test_llama3_parallelize_train_checkpoint_resume(impl: str, scenarios) -> None:
    result = _scenario(impl, scenarios, "flat")
    fresh, resumed, ref = result["fresh"], result["resumed"], result["reference"]
    assert len(fresh) == 4 and len(resumed) == 2

    # torchtitan's parallelisation took effect: DTensor parameters on the 4-rank mesh, every
    # transformer block checkpoint-wrapped, and FSDP units where torchtitan's isinstance checks
    # look for them (the root, embeddings, each block, and the [norm, lm_head] group).
    facts = fresh[0]["facts"]
    # torchtitan called the implementation under test: embeddings, each block, [norm, lm_head],
    # the root; only with the arguments an FSDP2 drop-in must take
    assert facts["fully_shard_calls"] == R.N_LAYERS + 3, facts
    assert facts["fully_shard_kwargs"] == ["mesh", "mp_policy", "reshard_after_forward"], facts
    assert facts["all_dtensor"] and facts["meshes_ok"], facts
    assert facts["ac_on_every_layer"], facts
    layers = [f"layers.{i}" for i in range(R.N_LAYERS)]
    assert facts["fsdp_modules"] == sorted(["", "tok_embeddings", "norm", "lm_head", *layers])

    # Every rank reports the same (all-reduced) losses and norms.
    for run in (fresh, resumed):
        for other in run[1:]:
            assert other["losses"] == run[0]["losses"] and other["norms"] == run[0]["norms"]

    # 4 ranks match one process on the same global batches from the same initial weights.
    assert fresh[0]["start"] == 0 and len(fresh[0]["losses"]) == R.TOTAL_STEPS
    _close(fresh[0]["losses"], ref["losses"], "losses, 4 ranks vs one process")
    _close(fresh[0]["norms"], ref["norms"], "clip norms, 4 ranks vs one process")
    assert min(ref["norms"]) > R.MAX_NORM  # clipping scaled the gradients on every step

    # Resumed at 2 ranks from the 4-rank checkpoint: continues the uninterrupted run.
    assert resumed[0]["start"] == R.SAVE_AT
    _close(resumed[0]["losses"], fresh[0]["losses"][R.SAVE_AT :], "losses, resumed vs whole run")
    _close(resumed[0]["norms"], fresh[0]["norms"][R.SAVE_AT :], "clip norms, resumed vs whole run")
    _close(resumed[0]["losses"], ref["losses"][R.SAVE_AT :], "losses, resumed vs one process")


# ---- FSDP x TP (titan_tp_ranks.py) -------------------------------------------------------------
def _tp_placements(name: str) -> tuple[object, object]:
    """FSDP2's (dp, tp) placements of a parameter of torchtitan's Llama3 sharding plan: rows
    cut by tp (column-parallel projections, vocabulary-parallel embeddings and lm_head) are
    cut again by dp inside each tp piece (``_StridedShard``); row-parallel ``wo``/``w2`` are
    cut by tp on dim 1; the sequence-parallel norms are replicated over tp."""
    if name.endswith(("wo.weight", "w2.weight")):
        return Shard(0), Shard(1)
    if name.endswith("norm.weight"):
        return Shard(0), Replicate()
    assert name.endswith(
        ("tok_embeddings.weight", "wqkv.weight", "w1.weight", "w3.weight", "lm_head.weight")
    ), name
    return _StridedShard(0, split_factor=TPR.TP), Shard(0)


def _activation(facts: dict, key: str, backend: str, tp: tuple, shape: tuple, local: tuple) -> None:
    """The first ``key`` activation's layout: tp placements ``tp`` (after a ``Shard(0)`` over
    ``dp_shard`` under ``full_dtensor``, whose activations are DTensors on the whole mesh)."""
    got = facts[key]
    dp_names, dp_placements = (
        (("dp_shard",), (Shard(0),)) if backend == "full_dtensor" else ((), ())
    )
    batch = R.GLOBAL_BATCH if dp_names else R.GLOBAL_BATCH // TPR.DP
    want = {
        "dtensor": True,
        "mesh": (*dp_names, "tp"),
        "placements": tuple(map(repr, (*dp_placements, *tp))),
        "shape": (batch, *shape),
        "local_shape": (R.GLOBAL_BATCH // TPR.DP, *local),
    }
    assert got == want, (key, got, want)


@pytest.mark.slow
@pytest.mark.parametrize(("impl", "backend"), TP_RUNS)
def test_llama3_fsdp_tp_train(impl: str, backend: str, scenarios) -> None:
    """dp 2 x tp 2 (sequence and loss parallel) through torchtitan's parallelize_llama: the
    implementation shards torchtitan's tp DTensors as FSDP2 does, and 4 ranks train as one
    process does."""
    result = _scenario(f"{impl}/{backend}", scenarios, "tp")
    fresh, ref = result["fresh"], result["reference"]
    assert len(fresh) == TPR.DP * TPR.TP
    facts = fresh[0]["facts"]
    dp_name = "fsdp" if backend == "partial_dtensor" else "dp_shard"

    # torchtitan called the implementation under test for embeddings, each block, [norm,
    # lm_head] and the root: with the dp mesh (partial_dtensor), or with the whole SPMD mesh
    # and its data-parallel dims (full_dtensor, FSDP2's dp_mesh_dims form).
    calls = facts["fully_shard_calls"]
    assert len(calls) == R.N_LAYERS + 3, calls
    kwargs = ["mesh", "mp_policy", "reshard_after_forward"]  # the root's call has no reshard_...
    if backend == "full_dtensor":
        kwargs.insert(0, "dp_mesh_dims")
    assert sorted({k for call in calls for k in call["kwargs"]}) == kwargs, calls
    for call in calls:
        if backend == "partial_dtensor":
            assert call["mesh"] == ("fsdp",), call
        else:
            assert call["mesh"] == ("dp_shard", "tp"), call
            assert call["dp_mesh_dims"] == repr(DataParallelMeshDims(shard="dp_shard")), call
    assert facts["ac_on_every_layer"], facts
    layers = [f"layers.{i}" for i in range(R.N_LAYERS)]
    assert facts["fsdp_modules"] == sorted(["", "tok_embeddings", "norm", "lm_head", *layers])

    # Every parameter: a DTensor on the (dp, tp) mesh with FSDP2's placements, this rank
    # holding a 1/dp chunk of its tp piece (the tiny dims divide evenly).
    assert facts["all_dtensor"], facts
    assert len(facts["params"]) == 3 + 7 * R.N_LAYERS  # wqkv, wo, w1, w2, w3, 2 norms
    for name, got in facts["params"].items():
        placements = _tp_placements(name)
        assert got["mesh"] == (dp_name, "tp"), (name, got)
        assert got["placements"] == tuple(map(repr, placements)), (name, got)
        pieces = TPR.DP * (1 if placements[1] == Replicate() else TPR.TP)
        assert (
            pieces * torch.Size(got["local_shape"]).numel() == torch.Size(got["shape"]).numel()
        ), (name, got)

    # Tensor parallelism ran: sequence-parallel block inputs (the sequence cut over tp), the
    # hidden states gathered over tp into lm_head (one ChunkedLossWrapper chunk), and
    # vocabulary-sharded logits, which torchtitan's cross-entropy reduces loss-parallel.
    seq, chunk = R.SEQ, R.SEQ // R.NUM_CHUNKS
    _activation(facts, "block_input", backend, (Shard(1),), (seq, R.DIM), (seq // TPR.TP, R.DIM))
    _activation(facts, "lm_head_input", backend, (Replicate(),), (chunk, R.DIM), (chunk, R.DIM))
    _activation(facts, "logits", backend, (Shard(2),), (chunk, R.VOCAB), (chunk, R.VOCAB // TPR.TP))

    # Every rank reports the same (all-reduced) losses and norms.
    for other in fresh[1:]:
        assert other["losses"] == fresh[0]["losses"] and other["norms"] == fresh[0]["norms"]

    # 4 ranks match one process on the same global batches from the same initial weights.
    assert fresh[0]["start"] == 0 and len(fresh[0]["losses"]) == R.TOTAL_STEPS
    _close(fresh[0]["losses"], ref["losses"], "losses, dp 2 x tp 2 vs one process", RTOL_TP)
    _close(fresh[0]["norms"], ref["norms"], "clip norms, dp 2 x tp 2 vs one process", RTOL_TP)
    assert min(ref["norms"]) > R.MAX_NORM  # clipping scaled the gradients on every step


@pytest.mark.slow
@pytest.mark.parametrize(("impl", "backend"), TP_RUNS)
def test_llama3_fsdp_tp_checkpoint_resume(impl: str, backend: str, scenarios) -> None:
    """torchtitan's CheckpointManager checkpoint of the dp 2 x tp 2 run, resumed on 2 ranks
    at another layout, continues the uninterrupted run."""
    result = _scenario(f"{impl}/{backend}", scenarios, "tp")
    assert "resume_error" not in result, (
        f"resume of {impl}/{backend} at dp x tp = {TPR.RESUME_AT[backend]} failed:\n"
        f"{result['resume_error'][-6000:]}"
    )
    fresh, resumed, ref = result["fresh"], result["resumed"], result["reference"]
    dp, tp = TPR.RESUME_AT[backend]
    assert len(resumed) == dp * tp == 2
    assert all(r["layout"] == (dp, tp) for r in resumed)
    # The resumed model is sharded at its own layout: tp on the parameters' mesh iff tp > 1.
    for name, got in resumed[0]["facts"]["params"].items():
        assert got["dtensor"] and (("tp" in got["mesh"]) == (tp > 1)), (name, got)

    for other in resumed[1:]:
        assert other["losses"] == resumed[0]["losses"] and other["norms"] == resumed[0]["norms"]
    assert resumed[0]["start"] == R.SAVE_AT
    assert len(resumed[0]["losses"]) == R.TOTAL_STEPS - R.SAVE_AT
    what = f"resumed at dp {dp} x tp {tp}"
    _close(
        resumed[0]["losses"],
        fresh[0]["losses"][R.SAVE_AT :],
        f"losses, {what} vs whole run",
        RTOL_TP,
    )
    _close(
        resumed[0]["norms"],
        fresh[0]["norms"][R.SAVE_AT :],
        f"clip norms, {what} vs whole run",
        RTOL_TP,
    )
    _close(
        resumed[0]["losses"], ref["losses"][R.SAVE_AT :], f"losses, {what} vs one process", RTOL_TP
    )
    _close(
        resumed[0]["norms"],
        ref["norms"][R.SAVE_AT :],
        f"clip norms, {what} vs one process",
        RTOL_TP,
    )
