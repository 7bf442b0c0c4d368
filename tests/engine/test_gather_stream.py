"""Note [gather stream] (``_unit_gather.py``): on CUDA a gather is queued on the all-gather
stream from the cast to the copy-out, and the compute stream waits for its event.

On CPU the side-stream flow is forced (the memory layer's CPU all-gather stream stands in) to
check its bookkeeping: every strategy, fp64 and a bf16-cast policy, equal to the path it
replaces. On a GPU two ordering tests delay one stream with ``torch.cuda._sleep`` so that a
missing wait reads stale or unwritten memory: the side stream must wait for the compute
stream's write of the shard, and the compute stream for the side stream's gather.
"""

from __future__ import annotations

import pytest
import torch
from fsdp_comm import launch
from fsdp_engine import MixedPrecisionPolicy, fully_shard
from fsdp_engine._unit_gather import GatherPart, SideStreamReady
from torch import nn

from .parity import RunConfig, reference_run, sharded_rank

_CPU_SIDE_RUNS: list[int] = []


def _forced_side(self: GatherPart):
    streams = self.ctx.memory.streams
    _CPU_SIDE_RUNS.append(1)
    return streams.all_gather


@pytest.mark.parametrize("strategy", ["full", "grad_op", "hybrid", "reshard_int"])
def test_side_stream_flow_matches_one_process(strategy: str, monkeypatch) -> None:
    monkeypatch.setattr(GatherPart, "_side_stream", _forced_side)
    _CPU_SIDE_RUNS.clear()
    cfg = RunConfig(strategy=strategy, dtype="float64", accum=2)
    ref_losses, ref_params = reference_run(cfg, 4)
    results = launch(sharded_rank, 4, backend="threads", args=(cfg,), timeout=300)
    assert _CPU_SIDE_RUNS, "the side-stream path did not run"
    losses = [sum(r[0][s] for r in results) / 4 for s in range(cfg.steps)]
    torch.testing.assert_close(
        torch.tensor(losses, dtype=torch.float64),
        torch.tensor(ref_losses, dtype=torch.float64),
        rtol=1e-10,
        atol=0,
    )
    for _, params in results:
        for name, value in ref_params.items():
            torch.testing.assert_close(params[name], value, rtol=1e-10, atol=1e-12)


def _bf16_grads(be) -> list[torch.Tensor]:
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    model = nn.Sequential(*(nn.Linear(13, 13) for _ in range(3)))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model:
        fully_shard(layer, mesh=be, mp_policy=mp)
    fully_shard(model, mesh=be, mp_policy=mp)
    x = torch.randn(4, 13, generator=gen)
    for _ in range(2):
        model(x).sum().backward()
    return [p.grad.to_local().clone() for p in model.parameters()]


def test_side_stream_flow_bf16_cast_is_bitwise_the_same(monkeypatch) -> None:
    """The cast into this rank's slot, the collective and the copy-out in the new order give
    the same bits as before (world sizes 1 and 2: at 1 the cast is the whole gather)."""
    for world in (1, 2):
        plain = launch(_bf16_grads, world, backend="threads", timeout=120)
        with monkeypatch.context() as patch:  # thread ranks: the class is shared, restored
            patch.setattr(GatherPart, "_side_stream", _forced_side)
            forced = launch(_bf16_grads, world, backend="threads", timeout=120)
        assert GatherPart._side_stream is not _forced_side
        for a, b in zip(plain, forced):
            for x, y in zip(a, b):
                assert torch.equal(x, y)


def test_side_stream_ready_on_cpu_is_done() -> None:
    from fsdp_memory import MemoryManager

    streams = MemoryManager("cpu").streams
    ready = SideStreamReady(streams, streams.record_event(streams.all_gather))
    assert ready.is_completed()
    ready.wait()
    ready.wait_stream(streams.compute)


# ------------------------------------------------------------------------------- on a GPU

_ONE_GPU = {"device": "cuda:0", "process_group_backend": "gloo"}


def _cuda_models(be) -> tuple[nn.Module, nn.Module, torch.Tensor]:
    """Four bf16-gathered linear units on the GPU, the same model unsharded, an input."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(256, 256) for _ in range(4))).cuda()
    reference = nn.Sequential(*(nn.Linear(256, 256) for _ in range(4))).cuda()
    reference.load_state_dict(model.state_dict())
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model:
        fully_shard(layer, mesh=be, mp_policy=mp)
    fully_shard(model, mesh=be, mp_policy=mp)
    return model, reference, torch.randn(8, 256, device="cuda")


def _stale_shard_rank(be) -> tuple[torch.Tensor, torch.Tensor]:
    """The compute stream writes the shards late (behind a sleep); the next forward's gather
    must see the write."""
    model, reference, x = _cuda_models(be)
    model(x).sum().backward()  # lazy init; then every unit is resharded
    with torch.no_grad():
        torch.cuda._sleep(200_000_000)  # ~0.1 s of compute-stream delay before the write
        for p in model.parameters():
            p.to_local().mul_(2.0)
        for p in reference.parameters():
            p.mul_(2.0)
    out = model(x)
    ref = reference.to(torch.bfloat16)(x.to(torch.bfloat16))
    return out.float().cpu(), ref.float().cpu()


@pytest.mark.gpu
@pytest.mark.parametrize("world", [1, 2])
def test_side_stream_waits_for_the_shard_write(world: int) -> None:
    for out, ref in launch(
        _stale_shard_rank, world, backend="torch", timeout=300, backend_options=_ONE_GPU
    ):
        torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)


def _late_gather_rank(be) -> tuple[torch.Tensor, torch.Tensor]:
    """The side stream is delayed before every gather; the compute stream must wait."""
    original = GatherPart._launch

    def slow_launch(self, *args, **kwargs):
        torch.cuda._sleep(50_000_000)  # on the current stream: the all-gather stream
        return original(self, *args, **kwargs)

    GatherPart._launch = slow_launch  # type: ignore[method-assign]
    try:
        model, reference, x = _cuda_models(be)
        outs = [model(x).float().cpu() for _ in range(2)]
        ref = reference.to(torch.bfloat16)(x.to(torch.bfloat16)).float().cpu()
        return outs[1], ref
    finally:
        GatherPart._launch = original  # type: ignore[method-assign]


@pytest.mark.gpu
@pytest.mark.parametrize("world", [1, 2])
def test_compute_stream_waits_for_the_gather(world: int) -> None:
    for out, ref in launch(
        _late_gather_rank, world, backend="torch", timeout=300, backend_options=_ONE_GPU
    ):
        torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)
