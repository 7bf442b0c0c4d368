"""Engine features beyond the strategy parity: wrapper and policies, deferred init, full
parameters, forward methods, activation checkpointing, the sharded layout, swapped layers."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from fsdp_comm import ThreadsBackend, launch
from fsdp_engine import (
    CallableWrapPolicy,
    FSDPModule,
    FullyShardedDataParallel,
    ModuleWrapPolicy,
    ShardingStrategy,
    SizeBasedWrapPolicy,
    full_parameters,
    fully_shard,
    register_fsdp_forward_method,
    sharded_layout,
    summon_full_params,
)
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from .models import Block, TinyGPT, make_batch
from .parity import _BUILD_LOCK, RunConfig, _train, build_model, reference_run


def _train_steps(model, rank, world, steps=3):
    """The parity harness's training loop (AdamW, lr 1e-2) on this rank's batches."""
    return _train(model, RunConfig(steps=steps), lambda i: make_batch(i, rank, world), None)


def _assert_matches_reference(results, world):
    ref_losses, ref_params = reference_run(RunConfig(), world)
    losses = [sum(r[0][s] for r in results) / world for s in range(3)]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    for name, value in ref_params.items():
        torch.testing.assert_close(results[0][1][name], value, rtol=1e-5, atol=1e-6)


def _wrapper_rank(be, strategy):
    model = FullyShardedDataParallel(
        build_model(),
        mesh=be,
        sharding_strategy=strategy,
        auto_wrap_policy=ModuleWrapPolicy({Block}),
    )
    assert isinstance(model, FullyShardedDataParallel) and isinstance(model, TinyGPT)
    assert all(isinstance(b, FSDPModule) for b in model.blocks)
    return _train_steps(model, be.rank, be.world_size), full_parameters(model)


@pytest.mark.parametrize(
    "strategy",
    [ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy.NO_SHARD],
)
def test_wrapper_with_module_policy_matches_reference(strategy) -> None:
    results = launch(_wrapper_rank, 2, backend="threads", args=(strategy,), timeout=120)
    _assert_matches_reference(results, 2)


def test_wrapper_over_processes() -> None:
    results = launch(_wrapper_rank, 2, args=(ShardingStrategy.FULL_SHARD,), timeout=120)
    _assert_matches_reference(results, 2)


def test_hybrid_wrapper_needs_a_2d_mesh() -> None:
    be = ThreadsBackend.create(1)[0]
    with pytest.raises(ValueError, match="HYBRID_SHARD needs mesh=init_mesh"):
        FullyShardedDataParallel(
            build_model(), mesh=be, sharding_strategy=ShardingStrategy.HYBRID_SHARD
        )


def test_size_and_callable_policies_pick_modules() -> None:
    be = ThreadsBackend.create(1)[0]
    model = FullyShardedDataParallel(
        build_model(), mesh=be, auto_wrap_policy=SizeBasedWrapPolicy(min_num_params=1500)
    )
    units = {n for n, m in model.named_modules() if isinstance(m, FSDPModule)}
    # Children first: mlp.0 (1541 parameters) is wrapped on its own, then attention (1936),
    # then each block with what is left of it (2 LayerNorms and mlp.2: 1584).
    assert {"", "blocks.0.mlp.0", "blocks.0.attn", "blocks.0"} <= units, units
    assert "blocks.0.ln1" not in units and "blocks.0.mlp" not in units
    model2 = FullyShardedDataParallel(
        build_model(),
        mesh=be,
        auto_wrap_policy=CallableWrapPolicy(lambda m: isinstance(m, nn.LayerNorm)),
    )
    assert sorted(n for n, m in model2.named_modules() if isinstance(m, FSDPModule)) == [
        "",
        "blocks.0.ln1",
        "blocks.0.ln2",
        "blocks.1.ln1",
        "blocks.1.ln2",
        "blocks.2.ln1",
        "blocks.2.ln2",
        "ln_f",
    ]
    with pytest.raises(TypeError, match="auto_wrap_policy must be"):
        FullyShardedDataParallel(build_model(), mesh=be, auto_wrap_policy=3)


def _meta_rank(be, sync):
    peaks = []
    calls = itertools.count()

    with torch.device("meta"):
        model = TinyGPT()

    def init(module):
        # Seeded per call under parity's lock, since thread ranks share the global RNG. With
        # sync the ranks start from different values and sync_module_states gives rank 0's
        # to all; without it every rank draws the same values, as a real program must.
        seed = 1000 * (be.rank if sync else 0) + next(calls)
        with _BUILD_LOCK, torch.random.fork_rng():
            torch.manual_seed(seed)
            if isinstance(module, TinyGPT):
                nn.init.normal_(module.pos, std=0.02)
            elif hasattr(module, "reset_parameters"):
                module.reset_parameters()
            else:
                module._reset_parameters()
        full = sum(
            p.numel()
            for p in model.parameters()  # full, real: not sharded DTensors
            if p.device.type != "meta" and not isinstance(p, DTensor)
        )
        peaks.append(full)

    for block in model.blocks:
        fully_shard(block, mesh=be, param_init_fn=init, sync_module_states=sync)
    fully_shard(model, mesh=be, param_init_fn=init, sync_module_states=sync)
    losses = _train_steps(model, be.rank, be.world_size, steps=2)
    return max(peaks), losses, full_parameters(model)


@pytest.mark.parametrize("sync", [False, True])
def test_meta_device_init_materialises_one_unit_at_a_time(sync: bool) -> None:
    results = launch(_meta_rank, 4, backend="threads", args=(sync,), timeout=120)
    biggest_unit = max(sum(p.numel() for p in b.parameters()) for b in TinyGPT().blocks)
    root_only = sum(
        p.numel() for n, p in TinyGPT().named_parameters() if not n.startswith("blocks")
    )
    for peak, losses, params in results:
        assert peak <= max(biggest_unit, root_only) + biggest_unit
        assert all(torch.isfinite(torch.tensor(losses)))
        for name, value in params.items():
            torch.testing.assert_close(value, results[0][2][name], rtol=0, atol=0)
    if sync:  # rank 0's values everywhere: the run in which every rank drew rank 0's values
        unsynced = launch(_meta_rank, 4, backend="threads", args=(False,), timeout=120)
        for name, value in unsynced[0][2].items():
            torch.testing.assert_close(results[0][2][name], value, rtol=1e-5, atol=1e-6)


def test_meta_module_without_init_is_named() -> None:
    be = ThreadsBackend.create(1)[0]
    with torch.device("meta"):
        model = TinyGPT()
    fully_shard(model, mesh=be)
    with pytest.raises(RuntimeError, match="still on meta device"):
        model(torch.zeros(1, 3, dtype=torch.long))


def _summon_rank(be):
    model = build_model()
    reference_dims = {n: p.dim() for n, p in model.named_parameters()}
    for block in model.blocks:
        fully_shard(block, mesh=be)
    fully_shard(model, mesh=be)
    expected = full_parameters(model)
    with summon_full_params(model):
        shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
        values_ok = all(torch.equal(p.detach(), expected[n]) for n, p in model.named_parameters())
        model.ln_f.weight.data.fill_(2.0)
    after = full_parameters(model)
    sharded_shapes = {
        n: (type(p), p.dim() == reference_dims[n]) for n, p in model.named_parameters()
    }
    return shapes, values_ok, after["ln_f.weight"], sharded_shapes


def test_summon_full_params_reads_and_writes_back() -> None:
    for shapes, values_ok, ln_f, dims in launch(_summon_rank, 2, backend="threads", timeout=60):
        assert shapes["blocks.0.mlp.0.weight"] == (67, 22) and values_ok
        assert torch.equal(ln_f, torch.full((22,), 2.0))
        assert set(dims.values()) == {(DTensor, True)}  # back to DTensors, original shapes


class Generator(TinyGPT):
    @torch.no_grad()
    def generate(self, idx: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Greedy tokens and the logits of each step (tied embeddings make the tokens alone a
        weak check: they repeat the last token for almost any weights)."""
        steps = []
        for _ in range(n):
            logits = self.forward(idx[:, -9:])[:, -1]
            steps.append(logits)
            idx = torch.cat([idx, logits.argmax(-1, keepdim=True)], dim=1)
        return idx, torch.stack(steps)


def _seeded(cls: type[TinyGPT], seed: int = 0) -> TinyGPT:
    """``cls()`` initialised from ``seed``, the same on every rank.

    Thread ranks share the global RNG: unlocked, one rank's seeding lands in the middle of
    another's initialisation and the ranks build different models (parity.py's lock).
    """
    with _BUILD_LOCK, torch.random.fork_rng():
        torch.manual_seed(seed)
        return cls()


def _generate_rank(be):
    model = _seeded(Generator)
    reference = copy.deepcopy(model)
    for block in model.blocks:
        fully_shard(block, mesh=be)
    fully_shard(model, mesh=be)
    register_fsdp_forward_method(model, "generate")
    start = torch.tensor([[1, 2, 3]])
    return model.generate(start, 5), reference.generate(start, 5)


def test_forward_method_gathers_parameters() -> None:
    for (tokens, logits), (ref_tokens, ref_logits) in launch(
        _generate_rank, 2, backend="threads", timeout=60
    ):
        assert torch.equal(tokens, ref_tokens)
        torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)


class CheckpointedGPT(TinyGPT):
    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        x = x + 0.1 * self.frozen(x)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        return self.head(self.ln_f(x))


def _checkpoint_rank(be):
    model = build_model()
    model.__class__ = CheckpointedGPT
    for block in model.blocks:
        fully_shard(block, mesh=be)
    fully_shard(model, mesh=be)
    return _train_steps(model, be.rank, be.world_size), full_parameters(model)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_activation_checkpointing_inside_units(world: int) -> None:
    _assert_matches_reference(
        launch(_checkpoint_rank, world, backend="threads", timeout=120), world
    )


def _layout_rank(be, early_unshard=False):
    model = build_model()
    for block in model.blocks:
        fully_shard(block, mesh=be)
    fully_shard(model, mesh=be)
    if early_unshard:  # FSDP2 allows unshard() before any forward: one provisional unit
        model.unshard()
        model.reshard()
    return [
        (s.fqn, tuple(s.global_shape), s.flat_start, s.length, s.local.clone())
        for s in sharded_layout(model)
    ]


@pytest.mark.parametrize("early_unshard", [False, True])
def test_sharded_layout_covers_every_parameter_once(early_unshard: bool) -> None:
    # early_unshard: the layout (and so fsdp_ckpt.save) after the root's unshard() before
    # any forward failed with "'NoneType' object has no attribute 'groups'".
    reference = dict(build_model().named_parameters())
    results = launch(_layout_rank, 3, backend="threads", args=(early_unshard,), timeout=60)
    for fqn, param in reference.items():
        covered = torch.full((param.numel(),), float("nan"))
        for rows in results:
            for name, shape, start, length, local in rows:
                if name == fqn:
                    assert shape == tuple(param.shape)
                    assert torch.isnan(covered[start : start + length]).all()  # disjoint
                    covered[start : start + length] = local
        torch.testing.assert_close(covered, param.detach().reshape(-1), rtol=0, atol=0)
