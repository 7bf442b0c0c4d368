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

Needs torchtitan and the pure-Python packages it imports on this path (tyro, spmd_types);
skipped without them. Both implementations run in one fresh interpreter (torchtitan imported
once, ~10 s on 2 cores), each test reading its own results.
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
    pytest.skip(f"torchtitan needs {', '.join(_MISSING)} (pip install --no-deps)",
                allow_module_level=True)

import torch  # noqa: E402

from . import titan_ranks as R  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
RTOL = 1e-5

IMPLS = [
    "torch",
    "ours",
]


@pytest.fixture(scope="module")
def scenarios(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, str, dict | None]:
    """``titan_ranks.scenarios`` of every implementation in one fresh interpreter (it imports
    torchtitan once and forks the ranks from there): (exit code, stderr tail, results)."""
    workdir = tmp_path_factory.mktemp("titan")
    out = workdir / "result.pkl"
    proc = subprocess.run(
        [sys.executable, "-m", "tests.integration.titan_ranks", ",".join(IMPLS), str(workdir),
         str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    return (proc.returncode, proc.stderr[-6000:],
            pickle.loads(out.read_bytes()) if proc.returncode == 0 else None)


def _scenario(impl: str, scenarios: tuple[int, str, dict | None]) -> dict:
    returncode, stderr, results = scenarios
    assert returncode == 0, (
        f"torchtitan scenarios ({', '.join(IMPLS)}) failed (exit {returncode}):\n{stderr}")
    result = results[impl]
    assert "error" not in result, (
        f"torchtitan scenario with {impl!r} fully_shard failed:\n{result['error'][-6000:]}")
    return result


def _close(got: list[float], want: list[float], what: str) -> None:
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float64),
                               torch.tensor(want, dtype=torch.float64), rtol=RTOL, atol=0.0,
                               msg=lambda m: f"{what}: {got} vs {want}\n{m}")


@pytest.mark.slow
@pytest.mark.parametrize("impl", IMPLS)
def test_llama3_parallelize_train_checkpoint_resume(impl: str, scenarios) -> None:
    result = _scenario(impl, scenarios)
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
    _close(resumed[0]["losses"], fresh[0]["losses"][R.SAVE_AT:], "losses, resumed vs whole run")
    _close(resumed[0]["norms"], fresh[0]["norms"][R.SAVE_AT:], "clip norms, resumed vs whole run")
    _close(resumed[0]["losses"], ref["losses"][R.SAVE_AT:], "losses, resumed vs one process")
