"""Activation checkpointing in every usual form on FSDP2-style sharded blocks matches one-process
training of the same model on the whole global batch (losses within 1e-5 relative, final
parameters too).

Forms (see `ranks.ac_rank`): (a) torch's checkpoint_wrapper on each block before fully_shard
(torchtitan's order), (b) apply_activation_checkpointing after fully_shard, (c) checkpoint() of
LayerNorm + MLP inside a block's forward, (d) checkpoint(block, x) around each sharded block in
the model's forward. The model has LayerNorms: a LayerNorm recomputed while its unit is
resharded fails with "Expected weight to be of same shape as normalized_shape, but got weight
of shape [0]".
"""

from __future__ import annotations

import functools

import pytest
import torch

from .ranks import AC_FORMS, IMPLS, LAYERS, STEPS, launched_many, reference_run, results_of

CASES = [(form, 2) for form in AC_FORMS] + [("wrapper_before", 1)]
# One launched group per implementation and world size runs all of its forms in turn (each
# builds and shards its own model): rank start-up dominated the old one-launch-per-case runs.
_FORMS_AT = {w: tuple(f for f, ww in CASES if ww == w) for w in sorted({w for _, w in CASES})}
_LAUNCHED: dict = {}


@functools.cache
def _reference(world: int):
    return reference_run(world)


def assert_matches_reference(results: list[dict], world: int) -> None:
    ref_losses, ref_params = _reference(world)
    losses = [sum(r["losses"][s] for r in results) / world for s in range(STEPS)]
    torch.testing.assert_close(
        torch.tensor(losses, dtype=torch.float64),
        torch.tensor(ref_losses, dtype=torch.float64),
        rtol=1e-5,
        atol=0,
    )
    params = results[0]["params"]
    assert set(params) == set(ref_params), set(params) ^ set(ref_params)
    for name, value in ref_params.items():
        torch.testing.assert_close(
            params[name], value, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}"
        )


@pytest.mark.slow
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(("form", "world"), CASES, ids=[f"{f}-w{w}" for f, w in CASES])
def test_activation_checkpointing_matches_reference(impl: str, form: str, world: int) -> None:
    group = launched_many("ac_rank", impl, world, _FORMS_AT[world], _LAUNCHED)
    results = results_of(group[form], f"{impl} {form} at world size {world}")
    assert_matches_reference(results, world)
    # Checkpointing really ran: LayerNorm + MLP computed twice per block and step.
    for rank, r in enumerate(results):
        assert r["mlp_calls"] == 2 * LAYERS * STEPS, (rank, r["mlp_calls"], r["block_types"])
