"""A parameter used by modules of two units (Note [shared parameters] in fsdp_engine): Hugging
Face GPT-2 sharded as its blocks, then ``transformer``, then the root puts the input embedding
in ``transformer`` and the tied ``lm_head`` in the root. The engine gives the weight to the
root (their lowest common ancestor unit); training matches one process, the tie survives, and
the weights load into the plain model through a full state dict, DCP and fsdp-ckpt. (Torch's
fully_shard refuses this sharding; issue #26.)"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from fsdp_comm import launch  # noqa: E402

from . import hf_tied_ranks  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

TOL = 2e-5


def test_gpt2_tied_embedding_across_units(tmp_path) -> None:
    from ..forkserver_preload import warm_forkserver

    warm_forkserver()
    results = launch(
        hf_tied_ranks.tied_rank, 2, backend="torch", args=(str(tmp_path),), timeout=240
    )
    for rank, res in enumerate(results):
        assert res["tied"], rank
        mean = [
            sum(r["losses"][i] for r in results) / len(results) for i in range(len(res["losses"]))
        ]
        assert mean == pytest.approx(res["ref_losses"], abs=TOL), (mean, res["ref_losses"])
        for key in ("params", "full_sd", "dcp", "fsdp_ckpt"):
            assert res[key] <= TOL, (rank, key, res[key])
        assert res["full_sd_tied"] and res["fsdp_ckpt_tied"], res
