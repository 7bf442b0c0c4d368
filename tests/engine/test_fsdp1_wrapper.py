"""`FullyShardedDataParallel` with torch FSDP1's arguments: an FSDP1 training script trains to
the one-process reference; each argument maps onto `fully_shard` or raises naming itself."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
import torch.distributed as dist
from fsdp_comm import ThreadsBackend, init_mesh, launch
from fsdp_engine import (
    CPUOffloadPolicy,
    FSDPModule,
    FullyShardedDataParallel,
    OffloadPolicy,
    full_parameters,
)
from fsdp_engine import ShardingStrategy as OurStrategy
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import BackwardPrefetch, CPUOffload, MixedPrecision
from torch.distributed.fsdp import ShardingStrategy as TorchStrategy
from torch.distributed.fsdp.wrap import (
    CustomPolicy,
    ModuleWrapPolicy,
    _recursive_wrap,
    always_wrap_policy,
    lambda_auto_wrap_policy,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
)

from ..forkserver_preload import warm_forkserver
from .models import Block, TinyGPT, make_batch
from .parity import RunConfig, _train, build_model, reference_run

FSDP = FullyShardedDataParallel
BLOCK_POLICY = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})


def _units(model: nn.Module) -> list[str]:
    return sorted(n for n, m in model.named_modules() if isinstance(m, FSDPModule))


def _be():
    return ThreadsBackend.create(1)[0]


@functools.cache
def _reference():
    return reference_run(RunConfig(), 2)


def _assert_matches_reference(results, what: str) -> None:
    ref_losses, ref_params = _reference()
    losses = [sum(r[0][s] for r in results) / 2 for s in range(3)]
    torch.testing.assert_close(
        torch.tensor(losses),
        torch.tensor(ref_losses),
        rtol=1e-5,
        atol=0,
        msg=lambda m: f"{what}: losses: {m}",
    )
    for rank, (_, params) in enumerate(results):
        assert set(params) == set(ref_params), (what, set(params) ^ set(ref_params))
        for name, value in ref_params.items():
            torch.testing.assert_close(
                params[name],
                value,
                rtol=1e-5,
                atol=1e-6,
                msg=lambda m, n=name, r=rank: f"{what} rank {r} {n}: {m}",
            )


def _train_rank(model, rank):
    return _train(model, RunConfig(), lambda i: make_batch(i, rank, 2), None), full_parameters(
        model
    )


# ---- parity: an FSDP1 script, unchanged but for the import -------------------------------


def _fsdp1_script_rank(be):
    torch.set_num_threads(1)
    model = FSDP(
        build_model(),
        auto_wrap_policy=BLOCK_POLICY,
        process_group=dist.group.WORLD,
        sharding_strategy=TorchStrategy.FULL_SHARD,
        mixed_precision=None,
        device_id=torch.device("cpu"),
        use_orig_params=True,
    )
    assert _units(model) == ["", "blocks.0", "blocks.1", "blocks.2"], _units(model)
    return _train_rank(model, dist.get_rank())


def test_fsdp1_script_trains_to_the_reference() -> None:
    warm_forkserver()  # the ranks start with fsdp_engine and FSDP imported
    results = launch(_fsdp1_script_rank, 2, timeout=120)
    _assert_matches_reference(results, "FSDP1 script")


# ---- process groups, device meshes, strategies, sync and meta init over gloo ---------------


def _errors(model_fn, cases):
    out = {}
    for name, kwargs in cases.items():
        try:
            FSDP(model_fn(), **kwargs)
        except (ValueError, TypeError) as exc:
            out[name] = f"{type(exc).__name__}: {exc}"
        else:
            out[name] = "no error"
    return out


def _process_group_rank(be):
    torch.set_num_threads(1)
    rank, runs = dist.get_rank(), {}
    everyone = dist.new_group([0, 1])
    singles = [dist.new_group([0]), dist.new_group([1])]  # every rank creates every group

    # A new group of every rank, SHARD_GRAD_OP, torch's ModuleWrapPolicy, CPUOffload; rank 1
    # starts from other values and sync_module_states gives it rank 0's.
    model = build_model()
    if rank == 1:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    model = FSDP(
        model,
        everyone,
        TorchStrategy.SHARD_GRAD_OP,
        CPUOffload(offload_params=True),
        ModuleWrapPolicy({Block}),
        sync_module_states=True,
        backward_prefetch=None,
        device_id=None,
    )
    assert _units(model) == ["", "blocks.0", "blocks.1", "blocks.2"]
    assert isinstance(model._fsdp_state.config.offload, CPUOffloadPolicy)
    assert not model.blocks[0]._fsdp_state.settings.reshard_after_forward
    runs["grad_op_new_group_sync"] = _train_rank(model, rank)

    # NO_SHARD over a 1-D DeviceMesh, FSDP1's size-based policy.
    mesh = init_device_mesh("cpu", (2,))
    model = FSDP(
        build_model(),
        device_mesh=mesh,
        sharding_strategy=TorchStrategy.NO_SHARD,
        auto_wrap_policy=functools.partial(size_based_auto_wrap_policy, min_num_params=1500),
    )
    assert model._fsdp_state.config.backends.shard.world_size == 1
    runs["no_shard_device_mesh"] = _train_rank(model, rank)

    # HYBRID_SHARD from FSDP1's (shard group, replicate group) tuple: (2 replicas, shard 1).
    model = FSDP(
        build_model(),
        process_group=(singles[rank], everyone),
        sharding_strategy=TorchStrategy.HYBRID_SHARD,
        auto_wrap_policy=BLOCK_POLICY,
    )
    backends = model.blocks[0]._fsdp_state.config.backends
    assert (backends.shard.world_size, backends.replicate.world_size) == (1, 2)
    runs["hybrid_group_tuple"] = _train_rank(model, rank)

    # _HYBRID_SHARD_ZERO2 over a 2-D DeviceMesh (1 replica, shard 2): no reshard after forward.
    model = FSDP(
        build_model(),
        device_mesh=init_device_mesh("cpu", (1, 2)),
        sharding_strategy=TorchStrategy._HYBRID_SHARD_ZERO2,
        auto_wrap_policy=BLOCK_POLICY,
    )
    assert not model.blocks[0]._fsdp_state.settings.reshard_after_forward
    runs["hybrid_zero2_device_mesh"] = _train_rank(model, rank)

    # FSDP1's meta-device recipe: rank 0 loads real weights, the others build on meta and
    # param_init_fn gives each module storage; sync_module_states copies rank 0's values.
    if rank == 0:
        model = build_model()
    else:
        with torch.device("meta"):
            model = TinyGPT()
    model = FSDP(
        model,
        dist.group.WORLD,
        auto_wrap_policy=BLOCK_POLICY,
        sync_module_states=True,
        param_init_fn=lambda m: m.to_empty(device=torch.device("cpu"), recurse=False),
    )
    runs["meta_param_init_fn_sync"] = _train_rank(model, rank)

    errors = _errors(
        build_model,
        {
            "tuple_for_full_shard": dict(process_group=(singles[rank], everyone)),
            "one_group_for_hybrid": dict(
                process_group=everyone, sharding_strategy=TorchStrategy.HYBRID_SHARD
            ),
            "tuple_bad_layout": dict(
                process_group=(singles[rank], singles[rank]),
                sharding_strategy=TorchStrategy.HYBRID_SHARD,
            ),
            "int_device_id": dict(process_group=dist.group.WORLD, device_id=0),
            "2d_mesh_for_full_shard": dict(device_mesh=init_device_mesh("cpu", (1, 2))),
            "group_and_mesh": dict(process_group=everyone, device_mesh=mesh),
        },
    )
    return runs, errors


def test_process_groups_device_meshes_and_strategies_train_to_the_reference() -> None:
    warm_forkserver()
    results = launch(_process_group_rank, 2, timeout=180)
    for what in results[0][0]:
        _assert_matches_reference([r[0][what] for r in results], what)
    errors = results[0][1]
    expected = {
        "tuple_for_full_shard": "ValueError: process_group=(shard_group, replicate_group) is "
        "for HYBRID_SHARD and _HYBRID_SHARD_ZERO2, not FULL_SHARD",
        "one_group_for_hybrid": "ValueError: HYBRID_SHARD with process_group needs a tuple",
        "tuple_bad_layout": "ValueError: process_group=(shard_group, replicate_group) must lay",
        "int_device_id": "ValueError: device_id=0 does not match the device the process group "
        "communicates on, cpu",
        "2d_mesh_for_full_shard": "ValueError: device_mesh: a 2-D DeviceMesh (replicate, shard) "
        "is hybrid sharding; pass sharding_strategy=HYBRID_SHARD",
        "group_and_mesh": "ValueError: pass one of mesh, comm, process_group and device_mesh, "
        "got ['device_mesh', 'process_group']",
    }
    for name, start in expected.items():
        assert errors[name].startswith(start), (name, errors[name])


# ---- auto_wrap_policy -------------------------------------------------------------------


def _fsdp1_decisions(policy, make):
    """What torch's FSDP1 wraps with ``policy`` and how it calls it (its own _recursive_wrap)."""
    model, calls, wrapped = make(), [], []
    names = {id(m): n for n, m in model.named_modules()}

    def spy(module, recurse, nonwrapped_numel):
        calls.append((names[id(module)], recurse, nonwrapped_numel))
        return policy(module=module, recurse=recurse, nonwrapped_numel=nonwrapped_numel)

    def record(module, **kwargs):
        wrapped.append(names[id(module)])
        return module

    _recursive_wrap(
        model, spy, record, ignored_modules=set(), ignored_params=set(), only_wrap_children=True
    )
    return calls, sorted(["", *wrapped])


@pytest.mark.parametrize(
    "policy, make",
    [
        (BLOCK_POLICY, build_model),
        (functools.partial(size_based_auto_wrap_policy, min_num_params=1500), build_model),
        (
            functools.partial(
                lambda_auto_wrap_policy, lambda_fn=lambda m: isinstance(m, nn.LayerNorm)
            ),
            build_model,
        ),
        (always_wrap_policy, lambda: Block(8, 2)),  # TinyGPT's tied embedding needs one unit
    ],
    ids=["transformer", "size_based", "lambda", "always"],
)
def test_fsdp1_policy_callables_are_called_as_fsdp1_calls_them(policy, make) -> None:
    want_calls, want_units = _fsdp1_decisions(policy, make)
    model, calls = make(), []
    names = {id(m): n for n, m in model.named_modules()}

    def spy(module, recurse, nonwrapped_numel):
        calls.append((names[id(module)], recurse, nonwrapped_numel))
        return policy(module=module, recurse=recurse, nonwrapped_numel=nonwrapped_numel)

    FSDP(model, mesh=_be(), auto_wrap_policy=spy)
    assert calls == want_calls
    assert _units(model) == want_units
    assert len(want_units) > 1


def test_plain_callables_sets_and_our_policies_still_work() -> None:
    model = FSDP(build_model(), mesh=_be(), auto_wrap_policy=lambda m: isinstance(m, nn.LayerNorm))
    assert _units(model) == [
        "",
        "blocks.0.ln1",
        "blocks.0.ln2",
        "blocks.1.ln1",
        "blocks.1.ln2",
        "blocks.2.ln1",
        "blocks.2.ln2",
        "ln_f",
    ]
    model = FSDP(build_model(), mesh=_be(), auto_wrap_policy={Block})
    assert _units(model) == ["", "blocks.0", "blocks.1", "blocks.2"]


def test_torch_policy_objects() -> None:
    model = FSDP(build_model(), mesh=_be(), auto_wrap_policy=ModuleWrapPolicy({Block}))
    assert _units(model) == ["", "blocks.0", "blocks.1", "blocks.2"]

    model = build_model()

    def pick(m):  # FSDP1's CustomPolicy: True, False or a dict overriding that unit's arguments
        if m is model.blocks[1]:
            return {"sharding_strategy": TorchStrategy.SHARD_GRAD_OP, "forward_prefetch": False}
        return isinstance(m, Block)

    FSDP(model, mesh=_be(), auto_wrap_policy=CustomPolicy(pick))
    assert _units(model) == ["", "blocks.0", "blocks.1", "blocks.2"]
    settings = [b._fsdp_state.settings for b in model.blocks]
    assert [s.reshard_after_forward for s in settings] == [True, False, True]
    assert [s.forward_prefetch for s in settings] == [True, False, True]
    loss = model(make_batch(0, 0, 1)[0]).sum()  # the mixed units run together
    loss.backward()

    with pytest.raises(TypeError, match="auto_wrap_policy gave Block the arguments \\['bogus'\\]"):
        FSDP(
            build_model(),
            mesh=_be(),
            auto_wrap_policy=CustomPolicy(
                lambda m: {"bogus": 1} if isinstance(m, Block) else False
            ),
        )
    with pytest.raises(TypeError, match="auto_wrap_policy must be .* got int"):
        FSDP(build_model(), mesh=_be(), auto_wrap_policy=3)


# ---- sharding_strategy ----------------------------------------------------------------


def _strategy_rank(be):
    out = {}
    for enum in (TorchStrategy, OurStrategy):
        for name in (
            "FULL_SHARD",
            "SHARD_GRAD_OP",
            "NO_SHARD",
            "HYBRID_SHARD",
            "_HYBRID_SHARD_ZERO2",
        ):
            if not hasattr(enum, name):
                continue
            mesh = init_mesh((1, 2), backend=be) if "HYBRID" in name else be
            model = FSDP(build_model(), mesh=mesh, sharding_strategy=getattr(enum, name))
            state = model._fsdp_state
            rep = state.config.backends.replicate
            out[enum.__module__, name] = (
                state.config.backends.shard.world_size,
                None if rep is None else rep.world_size,
                state.settings.reshard_after_forward,
            )
    return out


def test_sharding_strategies_of_both_enums_map_to_meshes_and_resharding() -> None:
    got = launch(_strategy_rank, 2, backend="threads", timeout=60)[0]
    want = {
        "FULL_SHARD": (2, None, True),
        "SHARD_GRAD_OP": (2, None, False),
        "NO_SHARD": (1, 2, True),
        "HYBRID_SHARD": (2, None, True),
        "_HYBRID_SHARD_ZERO2": (2, None, False),
    }
    assert {name: v for (_, name), v in got.items()} == want
    assert len(got) == 9  # torch's five, our four
    with pytest.raises(
        TypeError, match="sharding_strategy must be a ShardingStrategy .* got 'full_shard'"
    ):
        FSDP(build_model(), mesh=_be(), sharding_strategy="full_shard")


# ---- the other arguments ----------------------------------------------------------------


def test_mixed_precision_and_cpu_offload_take_fsdp1_classes() -> None:
    mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = FSDP(
        build_model(),
        mesh=_be(),
        mixed_precision=mp,
        cpu_offload=CPUOffload(True),
        auto_wrap_policy={Block},
    )
    for m in (model, model.blocks[0]):
        config = m._fsdp_state.config
        assert (config.mp.param_dtype, config.mp.reduce_dtype) == (torch.bfloat16, torch.float32)
        assert isinstance(config.offload, CPUOffloadPolicy)
    model(make_batch(0, 0, 1)[0]).float().sum().backward()
    model = FSDP(build_model(), mesh=_be(), cpu_offload=CPUOffload(offload_params=False))
    assert type(model._fsdp_state.config.offload) is OffloadPolicy
    with pytest.raises(TypeError, match="mixed_precision: mp_policy must be .* got str"):
        FSDP(build_model(), mesh=_be(), mixed_precision="bf16")
    with pytest.raises(TypeError, match="cpu_offload: offload_policy must be .* got bool"):
        FSDP(build_model(), mesh=_be(), cpu_offload=True)
    with pytest.warns(UserWarning, match="keep_low_precision_grads=True is ignored"):
        FSDP(
            build_model(),
            mesh=_be(),
            mixed_precision=MixedPrecision(
                param_dtype=torch.bfloat16, keep_low_precision_grads=True
            ),
        )


def test_device_id_must_be_the_backends_device() -> None:
    for ok in (None, torch.device("cpu"), "cpu"):
        FSDP(build_model(), mesh=_be(), device_id=ok)
    with pytest.raises(ValueError, match="device_id=0 does not match .* communicates on, cpu"):
        FSDP(build_model(), mesh=_be(), device_id=0)
    with pytest.raises(ValueError, match="device_id=device\\(type='cuda', index=1\\) does not"):
        FSDP(build_model(), mesh=_be(), device_id=torch.device("cuda", 1))
    with pytest.raises(
        TypeError, match="device_id must be an int, a torch.device or None, got float"
    ):
        FSDP(build_model(), mesh=_be(), device_id=0.0)


def test_use_orig_params_true_accepted_false_warned() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = FSDP(build_model(), mesh=_be(), use_orig_params=True, auto_wrap_policy={Block})
    assert "blocks.0.attn.in_proj_weight" in dict(model.named_parameters())
    with pytest.warns(
        UserWarning,
        match="use_orig_params=False is ignored: parameters always keep their original names",
    ):
        FSDP(build_model(), mesh=_be(), use_orig_params=False)
    with pytest.raises(TypeError, match="use_orig_params must be a bool, got 'yes'"):
        FSDP(build_model(), mesh=_be(), use_orig_params="yes")


def test_prefetch_and_limit_all_gathers() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = FSDP(
            build_model(),
            mesh=_be(),
            auto_wrap_policy={Block},
            backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
            forward_prefetch=True,
            limit_all_gathers=False,
        )
    assert all(b._fsdp_state.backward_prefetch is None for b in model.blocks)
    model = FSDP(
        build_model(),
        mesh=_be(),
        auto_wrap_policy={Block},
        backward_prefetch=None,
        forward_prefetch=False,
        limit_all_gathers=True,
    )
    states = [m._fsdp_state for m in (model, *model.blocks)]
    assert all(s.backward_prefetch == [] and not s.settings.forward_prefetch for s in states)
    losses = _train(model, RunConfig(steps=2), lambda i: make_batch(i, 0, 1), None)
    assert all(torch.isfinite(torch.tensor(losses)))
    with pytest.warns(UserWarning, match="backward_prefetch=BACKWARD_POST is ignored"):
        FSDP(build_model(), mesh=_be(), backward_prefetch=BackwardPrefetch.BACKWARD_POST)
    with pytest.raises(TypeError, match="backward_prefetch must be .* got 'pre'"):
        FSDP(build_model(), mesh=_be(), backward_prefetch="pre")
    with pytest.raises(TypeError, match="limit_all_gathers must be a bool, got 2"):
        FSDP(build_model(), mesh=_be(), limit_all_gathers=2)


def test_ignored_modules_and_states_only_when_empty() -> None:
    FSDP(build_model(), mesh=_be(), ignored_modules=[], ignored_states=())
    model = build_model()
    with pytest.raises(
        ValueError,
        match="ignored_modules is not supported by fsdp_engine \\(got 1 entry: Linear\\)",
    ):
        FSDP(model, mesh=_be(), ignored_modules=[model.frozen])
    with pytest.raises(
        ValueError, match="ignored_states is not supported .*got 1 entry: Parameter"
    ):
        FSDP(model, mesh=_be(), ignored_states=[model.pos])
    assert not isinstance(model, FSDPModule)


def test_mesh_arguments_are_checked() -> None:
    be = _be()
    with pytest.raises(
        TypeError,
        match="process_group must be a torch.distributed ProcessGroup .* got ThreadsBackend",
    ):
        FSDP(build_model(), process_group=be)
    with pytest.raises(
        ValueError,
        match="pass one of mesh, comm, process_group and device_mesh, got \\['comm', 'mesh'\\]",
    ):
        FSDP(build_model(), mesh=be, comm=_be())
    with pytest.raises(ValueError, match="HYBRID_SHARD needs mesh=init_mesh.*got mesh=Threads"):
        FSDP(build_model(), mesh=be, sharding_strategy=TorchStrategy.HYBRID_SHARD)
    with pytest.raises(TypeError, match="device_mesh must be a torch DeviceMesh, got str"):
        FSDP(build_model(), device_mesh="cpu")
