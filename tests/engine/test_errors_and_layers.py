"""Bad input gets clear errors; the comm and memory layers are swappable; explicit control."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn.functional as F
from fsdp_comm import ThreadsBackend, init_mesh, launch
from fsdp_engine import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    ShardedGradScaler,
    clip_grad_norm_,
    full_parameters,
    fully_shard,
)
from fsdp_memory import MemoryManager
from torch import nn

from ..log_lines import LogLines
from .models import make_batch
from .parity import build_model


def _shard(model, be, **kw):
    for block in model.blocks:
        fully_shard(block, mesh=be, **kw)
    return fully_shard(model, mesh=be, **kw)


def _loss(model, step=0, rank=0, world=1):
    x, y = make_batch(step, rank, world)
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


def _one_rank():
    return ThreadsBackend.create(1)[0]


def test_thread_ranks_sharing_a_gpu_are_refused() -> None:
    """They would deadlock in backward (CUDA backward runs on one autograd thread per device
    for every rank thread); the error names the process-rank alternative. Needs no GPU."""
    be = ThreadsBackend.create(2, device="cuda")[0]
    with pytest.raises(ValueError, match="deadlock in backward.*process_group_backend"):
        fully_shard(build_model(), mesh=be)


def test_module_sharded_twice() -> None:
    model = build_model()
    fully_shard(model.blocks[0], mesh=_one_rank())
    with pytest.raises(AssertionError, match="already an FSDP unit"):
        fully_shard(model.blocks[0], mesh=_one_rank())


def test_mixed_dtypes_in_one_unit_are_named() -> None:
    model = build_model()
    model.blocks[0].ln1.double()
    with pytest.raises(
        ValueError,
        match=r"fully_shard\(Block\).*one dtype.*ln1.weight: "
        r"torch.float64",
    ):
        _shard(model, _one_rank())


def test_reshard_after_forward_must_divide_the_shard_group() -> None:
    def body(be):
        model = _shard(build_model(), be, reshard_after_forward=3)
        _loss(model, rank=be.rank, world=be.world_size)

    with pytest.raises(
        ValueError, match="reshard_after_forward=3 must divide the shard group size 4"
    ):
        launch(body, 4, backend="threads", timeout=60)


@pytest.mark.parametrize("bad", [0, -2, 1.5, "yes"])
def test_reshard_after_forward_type(bad) -> None:
    with pytest.raises(
        ValueError, match="reshard_after_forward must be True, False or a positive int"
    ):
        fully_shard(build_model(), mesh=_one_rank(), reshard_after_forward=bad)


def test_mesh_of_the_wrong_kind() -> None:
    with pytest.raises(TypeError, match="mesh must be None.*got int"):
        fully_shard(build_model(), mesh=4)


def test_mesh_that_does_not_divide() -> None:
    with pytest.raises(ValueError, match="replicate \\* shard == world size 4"):
        init_mesh((3, 2), backend=ThreadsBackend.create(4)[0])


def test_backward_twice_without_forward() -> None:
    model = _shard(build_model(), _one_rank())
    loss = _loss(model)
    loss.backward(retain_graph=True)
    with pytest.raises(
        RuntimeError,
        match="FSDP unit '.*': backward reached its parameters more often than forward",
    ):
        loss.backward()


def test_parameters_changed_between_forward_and_backward() -> None:
    model = _shard(build_model(), _one_rank())
    loss = _loss(model)
    with torch.no_grad():
        model.blocks[1].mlp[0].weight.add_(1.0)  # an optimizer step too early, say
    with pytest.raises(
        RuntimeError, match="FSDP unit 'blocks.1'.*modified in place between forward and backward"
    ):
        loss.backward()


def test_replaced_parameter_is_named() -> None:
    model = _shard(build_model(), _one_rank())
    _loss(model).backward()
    model.ln_f.weight = nn.Parameter(torch.ones(22))
    with pytest.raises(ValueError, match="parameter ln_f.weight was replaced after fully_shard"):
        _loss(model)


class CountingThreads(ThreadsBackend):
    """The user's own backend: counts what the engine sends through it."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.counts = {"all_gather": 0, "reduce_scatter": 0}

    def _all_gather_impl(self, out, inp, async_op):
        self.counts["all_gather"] += 1
        return super()._all_gather_impl(out, inp, async_op)

    def _reduce_scatter_impl(self, out, inp, op, async_op):
        self.counts["reduce_scatter"] += 1
        return super()._reduce_scatter_impl(out, inp, op, async_op)


def _swapped_layers_rank(be):
    mine = CountingThreads(be.world, be.rank)
    memory = MemoryManager("cpu", pooling=False, max_inflight_all_gathers=None)
    model = _shard(build_model(), mine, memory=memory)
    _loss(model, rank=be.rank, world=be.world_size).backward()
    return mine.counts, memory.stats()


def test_engine_uses_the_backend_and_memory_it_is_given() -> None:
    for counts, stats in launch(_swapped_layers_rank, 2, backend="threads", timeout=60):
        # Forward gathers 3 blocks and the root's two groups (trainable, frozen); backward
        # re-gathers the 3 blocks (the root keeps its own); one reduce-scatter per unit.
        assert counts["all_gather"] == 5 + 3 and counts["reduce_scatter"] == 4
        assert stats.num_allocs > 0 and stats.num_reuses == 0  # the non-pooling manager


def _explicit_rank(be):
    model = _shard(build_model(), be)
    blocks = list(model.blocks)
    for i, block in enumerate(blocks[:-1]):
        block.set_modules_to_forward_prefetch([blocks[i + 1]])
    for i, block in enumerate(blocks[1:], 1):
        block.set_modules_to_backward_prefetch([blocks[i - 1]])
    handle = model.unshard(async_op=True)
    handle.wait()
    losses = []
    for step in range(2):
        loss = _loss(model, step, be.rank, be.world_size)
        loss.backward()
        losses.append(loss.item())
    model.blocks[0].unshard()
    model.blocks[0].reshard()
    return losses


def test_explicit_prefetch_and_unshard() -> None:
    results = launch(_explicit_rank, 2, backend="threads", timeout=60)
    assert all(torch.isfinite(torch.tensor(r)).all() for r in results)


def _norms_rank(be, norm_type):
    model = _shard(build_model(), be)
    _loss(model, 0, be.rank, be.world_size).backward()
    return float(clip_grad_norm_(model, 1e9, norm_type))


@pytest.mark.parametrize("norm_type", [2.0, float("inf"), 1.0])
def test_clip_grad_norm_returns_the_global_norm(norm_type: float) -> None:
    ref = build_model()
    xs, ys = zip(*[make_batch(0, r, 2) for r in range(2)])
    F.cross_entropy(ref(torch.cat(xs)).flatten(0, 1), torch.cat(ys).flatten()).backward()
    want = torch.nn.utils.clip_grad_norm_(
        [p for p in ref.parameters() if p.grad is not None], 1e9, norm_type
    )
    for got in launch(_norms_rank, 2, backend="threads", args=(norm_type,), timeout=60):
        assert got == pytest.approx(float(want), rel=1e-5)


@pytest.mark.parametrize(
    ("max_norm", "norm_type", "error", "words"),
    [
        (-1.0, 2.0, ValueError, "max_norm must be >= 0"),
        (float("nan"), 2.0, ValueError, "max_norm must be >= 0"),
        ("1.0", 2.0, TypeError, "max_norm must be a real number, got str"),
        (True, 2.0, TypeError, "max_norm must be a real number, got bool"),
        (1.0, 0.0, ValueError, "norm_type must be > 0"),
    ],
)
def test_clip_grad_norm_refuses_bad_arguments_and_leaves_gradients_alone(
    max_norm: object, norm_type: float, error: type, words: str
) -> None:
    # A negative max_norm used to be accepted (as torch's is) and flipped every gradient's
    # sign, so the optimizer climbed the loss (issue #30).
    be = ThreadsBackend.create(1)[0]
    model = _shard(build_model(), be)
    _loss(model, 0, 0, 1).backward()
    before = [p.grad.full_tensor().clone() for p in model.parameters() if p.grad is not None]
    with pytest.raises(error, match=words):
        clip_grad_norm_(model, max_norm, norm_type)  # type: ignore[arg-type]
    after = [p.grad.full_tensor() for p in model.parameters() if p.grad is not None]
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    assert float(clip_grad_norm_(model, float("inf"))) > 0  # inf: measure, never clip
    assert float(clip_grad_norm_(model, torch.tensor(1e9))) > 0  # a one-element tensor


def _scaler_rank(be):
    model = _shard(build_model(), be)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    scaler = ShardedGradScaler("cpu", backend=be, init_scale=2.0**4)
    scaler.scale(_loss(model, 0, be.rank, be.world_size)).backward()
    if be.rank == 1:  # only rank 1's shard overflows
        grad = next(
            p.grad for p in model.parameters() if p.grad is not None and p.grad.to_local().numel()
        )
        grad.to_local()[0] = float("inf")
    before = full_parameters(model)
    scaler.step(opt)
    scaler.update()
    after = full_parameters(model)
    return scaler.get_scale(), all(torch.equal(before[n], after[n]) for n in before)


def test_sharded_grad_scaler_skips_the_step_on_every_rank() -> None:
    for scale, unchanged in launch(_scaler_rank, 2, backend="threads", timeout=60):
        assert scale == 2.0**3 and unchanged


def _offload_rank(be):
    from .parity import RunConfig, _train

    model = _shard(
        build_model(), be, offload_policy=CPUOffloadPolicy(), mp_policy=MixedPrecisionPolicy()
    )
    losses = _train(model, RunConfig(), lambda i: make_batch(i, be.rank, be.world_size), None)
    devices = {p.device.type for p in model.parameters()}
    return losses, full_parameters(model), devices


def test_cpu_offload_keeps_shards_on_the_host_and_trains_the_same() -> None:
    from .parity import RunConfig, reference_run

    ref_losses, ref_params = reference_run(RunConfig(), 2)
    results = launch(_offload_rank, 2, backend="threads", timeout=60)
    losses = [sum(r[0][s] for r in results) / 2 for s in range(3)]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    for _, params, devices in results:
        assert devices == {"cpu"}
        for n, v in ref_params.items():
            torch.testing.assert_close(params[n], v, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
def test_cpu_offload_on_cuda() -> None:
    """Shards, gradients and optimizer state on the host; compute on the GPU."""
    be = ThreadsBackend.create(1, device="cuda")[0]
    model = _shard(build_model().cuda(), be, offload_policy=CPUOffloadPolicy())
    x, y = make_batch(0, 0, 1)
    F.cross_entropy(model(x.cuda()).flatten(0, 1), y.cuda().flatten()).backward()
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    assert all(p.grad is None or p.grad.device.type == "cpu" for p in model.parameters())
    # Pinned, so the device-to-host copy of each step runs at full speed.
    assert all(p.grad.to_local().is_pinned() for p in model.parameters() if p.grad is not None)


def test_weight_tied_across_units_goes_to_the_common_parent() -> None:
    # Note [shared parameters]: the parent's fully_shard takes the weight over from the unit
    # that sharded it first (FSDP2 would train two copies); one INFO line names it. (A handler
    # of its own: other tests configure the "fsdp" loggers, which caplog then misses.)
    model = build_model()
    model.blocks[0].mlp[0].weight = model.blocks[1].mlp[0].weight
    ref = copy.deepcopy(model)
    fully_shard(model.blocks[1], mesh=_one_rank())
    log, lines = logging.getLogger("fsdp.engine"), LogLines()
    level = log.level
    log.addHandler(lines)
    log.setLevel(logging.INFO)
    try:
        fully_shard(model, mesh=_one_rank())
    finally:
        log.removeHandler(lines)
        log.setLevel(level)
    assert any(
        "holds the shared parameter mlp.0.weight of fully_shard(Block)" in line
        for line in lines.lines
    ), lines.lines
    assert model.blocks[0].mlp[0].weight is model.blocks[1].mlp[0].weight
    torch.testing.assert_close(_loss(model), _loss(ref))


def test_scalar_parameter_is_named() -> None:
    module = nn.Linear(3, 3)
    module.scale = nn.Parameter(torch.tensor(2.0))
    with pytest.raises(ValueError, match="parameter scale is a scalar.*shape \\(1,\\)"):
        fully_shard(module, mesh=_one_rank())


def test_ignored_params_must_be_a_set_of_parameters() -> None:
    with pytest.raises(TypeError, match="ignored_params must be a set of nn.Parameter"):
        fully_shard(nn.Linear(3, 3), mesh=_one_rank(), ignored_params=[nn.Parameter(torch.ones(1))])


def test_containers_without_forward_are_refused() -> None:
    with pytest.raises(ValueError, match="containers that do not implement forward: ModuleList"):
        fully_shard(nn.ModuleList([nn.Linear(3, 3)]), mesh=_one_rank())


def test_deepcopy_of_a_unit_is_refused() -> None:
    model = fully_shard(nn.Linear(3, 3), mesh=_one_rank())
    with pytest.raises(AssertionError, match="FSDP does not support deepcopy"):
        copy.deepcopy(model)


def test_parameters_are_dtensors_of_their_original_shape_at_every_step() -> None:
    from torch.distributed.tensor import DTensor, Shard

    model = build_model()
    shapes = {n: p.shape for n, p in model.named_parameters()}
    _shard(model, _one_rank())
    for _ in range(2):
        for n, p in model.named_parameters():
            assert isinstance(p, DTensor) and p.shape == shapes[n], n
            assert p.placements == (Shard(0),), n
        _loss(model).backward()


def test_the_layers_below_provide_the_engines_protocols() -> None:
    from fsdp_engine import CommBackend, MemoryLayer

    assert isinstance(_one_rank(), CommBackend)
    assert isinstance(MemoryManager("cpu"), MemoryLayer)
    assert not isinstance(object(), CommBackend)
