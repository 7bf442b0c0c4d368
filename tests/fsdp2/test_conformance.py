"""Behaviours PyTorch's own FSDP2 tests check (``test/distributed/_composable/fsdp/``), each
on torch's ``fully_shard`` and ours, against a one-process reference on uneven shapes. Every
case here failed on this engine before issue #26: five gave wrong gradients without an error.

The cases of one implementation at one world size run in one launched group (cached for the
session); each test reads its own case.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
from fsdp_comm import launch

from . import conformance_ranks as cr
from .harness import IMPLS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

TOL = 1e-5
_W2 = (
    "partial_forward",
    "frozen_after_shard",
    "non_root_after_step",
    "chunked_loss_reshard",
    "chunked_loss_default",
    "tied_grouped",
    "tied_siblings",
    "meta_assign",
    "meta_left",
    "frozen_float8",
    "placement",
    "extension",
    "all_reduce_hook",
    "registration",
    "ignored_params",
    "module_rules",
    "pending_gradients",
    "pending_set_by_user",
    "input_grad_then_backward",
    "chunked_accumulation",
    "split_backward_bf16",
    "split_backward_fp32",
    "chunked_loss_resident_ac",
)
_W4 = ("hsdp_accumulation",)


# Cases whose rank torch's fully_shard aborts over gloo processes (gloo has no float8 type;
# the bf16 all-gather of the extension case ends its rank too); PyTorch's own tests of both
# pass on its in-process threaded group, where the FSDP2 suite run checks both
# implementations (docs/coming-from.md).
_TORCH_ABORTS = ("frozen_float8", "extension")


# Cases whose behaviour torch's own fully_shard gained in 2.13 (the oldest-versions leg runs
# torch 2.11, whose FSDP2 got them wrong: the chunked loss over a grouped unit, and a weight
# tied across sibling units was not refused).
_TORCH_SINCE = {
    "chunked_loss_reshard": (2, 13),
    "chunked_loss_default": (2, 13),
    "chunked_accumulation": (2, 13),
    "chunked_loss_resident_ac": (2, 13),
    "tied_siblings": (2, 13),
}


def _skip_old_torch(impl: str, name: str) -> None:
    import torch

    need = _TORCH_SINCE.get(name)
    have = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    if impl == "torch" and need is not None and have < need:
        pytest.skip(
            f"torch {torch.__version__}'s fully_shard predates this FSDP2 behaviour "
            f"(torch >= {need[0]}.{need[1]})"
        )


def _skip_old_torch_for_split_backward() -> None:
    import torch

    have = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    if have < (2, 13):
        pytest.skip(
            f"torch {torch.__version__}: the split backward is supported from torch "
            "2.13 (Note [split backward]; on 2.11 the weight pass doubled the gradient, "
            "so the engine keeps the registered parameters out of the graph and warns)"
        )


def _skip_torch_abort(impl: str, name: str) -> None:
    if impl == "torch" and name in _TORCH_ABORTS:
        pytest.skip(
            f"torch's fully_shard aborts its rank in case {name} over gloo processes; "
            "the FSDP2 suite run on torch's threaded group covers it"
        )


@functools.cache
def _results(impl: str, world: int) -> list[dict[str, Any]]:
    from ..forkserver_preload import warm_forkserver

    warm_forkserver()
    names = _W2 if world == 2 else _W4
    if impl == "torch":  # see _TORCH_ABORTS
        names = tuple(n for n in names if n not in _TORCH_ABORTS)
    return launch(cr.run_cases, world, backend="torch", args=(impl, names), timeout=300)


def _case(impl: str, world: int, name: str) -> list[dict[str, Any]]:
    per_rank = [r[name] for r in _results(impl, world)]
    for rank, res in enumerate(per_rank):
        if "exception" in res:
            pytest.fail(f"case {name} raised on rank {rank}:\n{res['exception']}")
    return per_rank


def _assert_grads(res: dict[str, Any], none: set[str] = frozenset(), tol: float = TOL) -> None:
    for name, value in res.items():
        if name in none:
            assert value == "none", f"{name}: expected no gradient, got {value!r}"
        else:
            assert isinstance(value, float), f"{name}: {value}"
            assert value <= tol, f"{name}: differs from the reference by {value}"


@pytest.mark.parametrize("impl", IMPLS)
def test_unused_parameters_get_no_gradient(impl: str) -> None:
    """FSDP2's test_double_partial_forward_then_backward: a parameter of a unit that takes no
    part in a forward gets ``None`` (before: zeros, which weight decay and Adam then step)."""
    for res in _case(impl, 2, "partial_forward"):
        _assert_grads(res, none={"head.weight", "head.bias"})


@pytest.mark.parametrize("impl", IMPLS)
def test_requires_grad_false_after_fully_shard(impl: str) -> None:
    """test_train_mixed_requires_grad_across_groups: freezing after sharding is honoured
    (before: the frozen parameter still got a gradient and trained)."""
    for res in _case(impl, 2, "frozen_after_shard"):
        _assert_grads(res, none={"body.0.weight", "head.bias"})


@pytest.mark.parametrize("impl", IMPLS)
def test_non_root_unit_alone_after_a_step(impl: str) -> None:
    """test_non_root_forward_backward: ``model.body(x).sum().backward()`` after a root step
    (before: that unit's first layer got wrong gradients)."""
    for res in _case(impl, 2, "non_root_after_step"):
        _assert_grads(res, none={n for n in res if not n.startswith("body.")})


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", ["chunked_loss_reshard", "chunked_loss_default"])
def test_chunked_loss_over_a_grouped_head(impl: str, case: str) -> None:
    """test_partial_group_forward_grad_accum_chunked: the head of ``fully_shard([norm, head],
    reshard_after_forward=True)`` called per chunk (before: wrong gradients for every unit
    before it)."""
    _skip_old_torch(impl, case)
    for res in _case(impl, 2, case):
        _assert_grads(res)


@pytest.mark.parametrize("impl", IMPLS)
def test_chunked_loss_recomputes_resident_units(impl: str) -> None:
    """A chunked loss over units whose shard group has one rank, activation-checkpointed:
    the second backward's recompute finds full parameters (torchtitan at dp 1 x tp 2)."""
    _skip_old_torch(impl, "chunked_loss_resident_ac")
    for res in _case(impl, 2, "chunked_loss_resident_ac"):
        _assert_grads(res)


@pytest.mark.parametrize("impl", IMPLS)
def test_chunked_loss_with_accumulation(impl: str) -> None:
    """test_partial_group_forward_grad_accum_chunked: micro-batches without sync, the head
    called per chunk, the last micro-batch synchronising."""
    _skip_old_torch(impl, "chunked_accumulation")
    for res in _case(impl, 2, "chunked_accumulation"):
        # gradients of order 100 summed in another order: 3e-5 on torch's fully_shard too;
        # the bug this guards against was off by 1.5
        _assert_grads(res, tol=1e-4)


@pytest.mark.parametrize("impl", IMPLS)
def test_hsdp_accumulation_without_all_reduce(impl: str) -> None:
    """test_gradient_accumulation, HSDP with ``set_requires_all_reduce(False)`` (before:
    gradients off by up to 0.016 on a 2x2 mesh)."""
    for res in _case(impl, 4, "hsdp_accumulation"):
        _assert_grads(res)


@pytest.mark.parametrize("impl", IMPLS)
def test_tied_weights_grouped(impl: str) -> None:
    """test_train_shared_params_uneven_shard: ``fully_shard([embed, head])`` over a tied
    weight, then the root (before: ValueError)."""
    for res in _case(impl, 2, "tied_grouped"):
        assert res["grads"] <= TOL and res["params"] <= TOL, res


@pytest.mark.parametrize("impl", IMPLS)
def test_tied_weights_in_sibling_units_refused(impl: str) -> None:
    """test_shared_params_separate_fsdp_groups_error: refused at the first forward."""
    _skip_old_torch(impl, "tied_siblings")
    for res in _case(impl, 2, "tied_siblings"):
        assert res["error"] is not None and "already managed by another" in res["error"]


@pytest.mark.parametrize("impl", IMPLS)
def test_meta_then_load_state_dict_assign(impl: str) -> None:
    """test_rank0_broadcast_meta_device_init: meta, shard, ``load_state_dict(sd,
    assign=True)``, train (before: 'Cannot swap t1 and t2 if they have different slots')."""
    for res in _case(impl, 2, "meta_assign"):
        _assert_grads(res)


@pytest.mark.parametrize("impl", IMPLS)
def test_parameters_left_on_meta_are_named(impl: str) -> None:
    """test_invalid_meta_device_init: FSDP2's message, naming the parameters."""
    for res in _case(impl, 2, "meta_left"):
        assert res["error"] is not None
        assert "still on meta device" in res["error"] and "embed.weight" in res["error"]


@pytest.mark.parametrize("impl", IMPLS)
def test_mixed_precision_policy_positional(impl: str) -> None:
    """FSDP2's field order: the fourth positional field is ``cast_forward_inputs``."""
    import torch

    if impl == "torch":
        from torch.distributed.fsdp import MixedPrecisionPolicy
    else:
        from fsdp_engine import MixedPrecisionPolicy
    policy = MixedPrecisionPolicy(torch.bfloat16, torch.float32, None, False)
    assert policy.cast_forward_inputs is False
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)


@pytest.mark.parametrize("impl", IMPLS)
def test_frozen_float8_parameter(impl: str) -> None:
    """test_mixed_dtypes_no_grad_param: a frozen float8 weight in a unit is gathered (before:
    gloo refused the dtype, 'Invalid scalar type')."""
    _skip_torch_abort(impl, "frozen_float8")
    for res in _case(impl, 2, "frozen_float8"):
        assert res.pop("w8") == 0.0
        _assert_grads(res, none={"w8"})


@pytest.mark.parametrize("impl", IMPLS)
def test_shard_placement_fn(impl: str) -> None:
    """The TestFullyShardShardPlacementFn tests: Shard(1) for 2-D weights; the DTensors say
    so, local tensors and gradients are contiguous, training matches (before: ValueError)."""
    for res in _case(impl, 2, "placement"):
        assert res["placements"]["body.0.weight"] == ["Shard(dim=1)"]
        assert res["placements"]["body.0.bias"] == ["Shard(dim=0)"]
        assert res["placements"]["head.weight"] == ["Shard(dim=1)"]
        assert res["contiguous"]
        assert res["grads"] <= TOL and res["params"] <= TOL, res


@pytest.mark.parametrize("impl", IMPLS)
def test_all_gather_extension(impl: str) -> None:
    """test_all_gather_extensions_monkey_patch: fsdp_pre/post_all_gather run and forward
    computes with their result (before: never called; plain data was gathered)."""
    _skip_torch_abort(impl, "extension")
    for res in _case(impl, 2, "extension"):
        assert res.pop("calls") is True
        _assert_grads(res)


@pytest.mark.parametrize("impl", IMPLS)
def test_all_reduce_hook(impl: str) -> None:
    """test_custom_hsdp_all_reduce_hook: the root's hook sees its reduced gradient shards and
    what it writes becomes the gradient (before: NotImplementedError)."""
    for res in _case(impl, 2, "all_reduce_hook"):
        assert res["hook_calls"] >= 1
        _assert_grads(res["grads"])


@pytest.mark.parametrize("impl", IMPLS)
def test_registered_parameters_after_forward(impl: str) -> None:
    """test_param_registration_after_forward: a unit that stays gathered shows its unsharded
    tensors until backward (before: still the DTensors)."""
    for res in _case(impl, 2, "registration"):
        assert res["after_forward"] == ["Parameter"], res
        assert res["full_shape"] == (cr.VOCAB, cr.DIM)
        assert res["after_backward"]


@pytest.mark.parametrize("impl", IMPLS)
def test_ignored_params(impl: str) -> None:
    """test_fully_shard_ignore_params: ignored parameters stay plain, with local gradients
    (before: ValueError)."""
    for res in _case(impl, 2, "ignored_params"):
        assert sorted(res["plain"]) == [
            "body2.0.bias",
            "body2.0.weight",
            "body2.2.bias",
            "body2.2.weight",
        ]
        assert res["ignored"] <= TOL
        _assert_grads(res["grads"])


@pytest.mark.parametrize("impl", IMPLS)
def test_state_reapply_containers_deepcopy(impl: str) -> None:
    """test_fully_shard_state: ``fully_shard.state`` per call, FSDP2's errors for a second
    call on one module, for ModuleList and for deepcopy."""
    for res in _case(impl, 2, "module_rules"):
        assert res["states"] == 2
        assert "can only be applied to a module once" in res["reapply"]
        assert "containers that do not implement forward" in res["module_list"]
        assert "FSDP does not support deepcopy" in res["deepcopy"]


@pytest.mark.parametrize("impl", IMPLS)
def test_pending_gradients(impl: str) -> None:
    """test_fully_shard_pending_grad (torch 2.13): without gradient sync the unsharded
    parameters show the unreduced gradient, the same tensor each step, edits counted; the
    next synced backward reduces it (before: .grad was None until the sync)."""
    for res in _case(impl, 2, "pending_gradients"):
        assert res["pending0"] <= TOL and res["pending1"] <= TOL, res
        assert res["same_object"] and res["none_after_sync"], res
        assert res["reduced"] <= TOL, res


@pytest.mark.parametrize("impl", IMPLS)
def test_gradients_set_on_unsharded_parameters_are_pending(impl: str) -> None:
    """test_grouped_pipeline_split_backward's accumulation: ``p.grad`` set (and added to in
    place) on the registered unsharded parameters between forwards is reduced by the next
    synchronising backward (before: dropped when no backward had left a pending gradient)."""
    for res in _case(impl, 2, "pending_set_by_user"):
        assert res["same_object"] is True and res["reduced"] <= TOL, res


@pytest.mark.parametrize("impl", IMPLS)
def test_input_gradient_first_then_backward(impl: str) -> None:
    """``torch.autograd.grad`` toward the input, then a backward through the same graph:
    right gradients on both; this engine also warns that the first pass skipped the
    parameters (pipelining's zero-bubble weight pass could not reach them)."""
    for res in _case(impl, 2, "input_grad_then_backward"):
        warned = res.pop("warned")
        _assert_grads(res)
        assert warned is (impl == "ours"), warned


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("reduce", ["bf16", "fp32"])
def test_pipeline_split_backward(impl: str, reduce: str) -> None:
    """Zero-bubble pipelining's split backward (input pass, then weight pass toward the
    registered unsharded parameters) on a grouped unit that stays gathered: each weight
    pass leaves the micro-batch's gradient as the parameters' unreduced ``.grad`` (the same
    tensor from micro-batch to micro-batch, in the reduce dtype), and the synchronising
    backward reduces all three (before: the weight pass found no gradient on this engine)."""
    _skip_old_torch_for_split_backward()
    if impl == "torch" and reduce == "fp32":
        pytest.skip(
            "torch 2.13's fully_shard leaves .grad None after the weight pass with an "
            "fp32 reduce dtype; PyTorch's test at its main branch expects the gradient "
            "(the FSDP2 suite's run of test_grouped_pipeline_split_backward)"
        )
    for res in _case(impl, 2, f"split_backward_{reduce}"):
        for flag in ("dtype", "same_object", "none_after_sync"):
            assert res.pop(flag) is True, (flag, res)
        _assert_grads(res, tol=2**-6 if reduce == "bf16" else 2**-8)  # relative
