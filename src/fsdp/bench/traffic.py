"""Noise-free counters of what a sharding engine adds to one training step: this engine and
torch's FSDP2 side by side, in one run.

    python -m fsdp.bench.traffic --world-size 2

Configuration (what users run): the bench GPT (``--model``, default ``small``), bf16
parameters, fp32 reduction, every block a unit, gloo. The counts come from a
``TorchDispatchMode`` over one step after a warm-up step, so they do not depend on the machine's
load; they stand in for what the engine costs a GPU (memory traffic and kernels), not for time.

- ``copy_bytes_per_param``: bytes read and written by copy-like ops (copies, casts, cats,
  splits, chunk-cats) in the sharded step, minus those of the plain bf16 model's step, on one
  rank, divided by the model's parameter count. The gathers' reorder copies, the mixed
  precision casts, the gradient's copies to the reduce-scatter's layout all count.
- ``copy_ops``: how many such ops the engine added (kernels, on a GPU).
- ``collectives``: collectives the process group ran for the step (all-gathers,
  reduce-scatters, all-reduces; point-to-point messages apart).
- ``pool_allocations`` (this engine): buffers its memory manager handed out in the step.

The gloo backend's own algorithms (pairwise exchange, shared memory) are switched off, so this
engine takes the path NCCL takes, as FSDP2 does; each engine still makes one copy around its
reduce-scatter that only gloo needs (counted for both), and this engine's scaling multiply for
gloo's missing pre-multiplied sum is not a copy (not counted). `asv_bench/benchmarks/engine.py`'s
``Traffic`` tracks these numbers; ``tests/integration/test_bench_traffic.py`` bounds them.
"""

from __future__ import annotations

import argparse
import warnings
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from ..models import GPT, MODEL_SIZES, GPTConfig
from ._record import add_record_argument, make_record, write_record

__all__ = ["TrafficCounters", "count_traffic", "main", "TRAFFIC_ENGINES"]

TRAFFIC_ENGINES = ("ours", "fsdp2")

# Copy-like ops: they only move data (a cast is a copy that converts).
_COPIES = frozenset(
    {
        "copy_",
        "_to_copy",
        "cat",
        "split_with_sizes_copy",
        "_chunk_cat",
        "clone",
        "stack",
        "_foreach_copy_",
        "all_gather_copy_in",
        "chunk_cat",
        "index_select",
        "narrow_copy",
    }
)
_COLLECTIVES = frozenset(
    {
        "_allgather_base_",
        "allgather_",
        "allgather_into_tensor_coalesced_",
        "_reduce_scatter_base_",
        "reduce_scatter_",
        "reduce_scatter_tensor_coalesced_",
        "allreduce_",
        "allreduce_coalesced_",
        "broadcast_",
    }
)
_POINT_TO_POINT = frozenset({"send", "recv_", "recv_any_source_"})


@dataclass(frozen=True)
class TrafficCounters:
    """One rank's counters for one step of one engine (see the module docstring)."""

    engine: str
    world_size: int
    params: int
    copy_bytes_per_param: float
    copy_ops: int
    collectives: int
    point_to_point: int
    pool_allocations: int | None


class _Count(TorchDispatchMode):  # type: ignore[no-untyped-call]  # unannotated in torch
    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # unannotated in torch
        self.copy_bytes = 0
        self.copy_ops = 0
        self.calls: Counter[str] = Counter()
        self.allocations = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.__name__.split(".")[0]
        ns = func.namespace
        if ns == "c10d":
            self.calls[name] += 1
        elif name in _COPIES:
            self.copy_ops += 1
            self.copy_bytes += _bytes(args, kwargs, out, writes_only_first=name.endswith("_"))
        return out


def _tensors(tree: Any) -> list[torch.Tensor]:
    flat, _ = torch.utils._pytree.tree_flatten(tree)
    return [t for t in flat if isinstance(t, torch.Tensor)]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _bytes(args: Any, kwargs: Any, out: Any, *, writes_only_first: bool) -> int:
    """Bytes read (the inputs) plus bytes written (the outputs; an in-place op's first
    argument and any ``out=`` are written, not read)."""
    ins = _tensors(args[1:] if writes_only_first else args) + _tensors(
        {k: v for k, v in kwargs.items() if k != "out"}
    )
    if writes_only_first:
        written = _tensors(args[0])
    else:
        written = _tensors(kwargs["out"]) if "out" in kwargs else _tensors(out)
    return sum(map(_nbytes, ins)) + sum(map(_nbytes, written))


def _plain_gloo_paths(be: Any) -> None:
    """This engine's gloo-only algorithms off: the collectives NCCL would run."""
    from fsdp_comm import TorchBackend

    if isinstance(be, TorchBackend):
        be._ag_pairwise_min = be._rs_pairwise_min = 1 << 62
        be._ag_shm_min = be._rs_shm_min = None


def _sharded(model: GPT, be: Any, engine: str) -> tuple[torch.nn.Module, Any]:
    if engine == "ours":
        from fsdp_engine import MixedPrecisionPolicy, fully_shard
        from fsdp_memory import MemoryManager

        _plain_gloo_paths(be)
        memory = MemoryManager(be.device)
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.blocks:
            fully_shard(block, mesh=be, mp_policy=mp, memory=memory)
        fully_shard(model, mesh=be, mp_policy=mp, memory=memory)
        return model, memory
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    mesh = init_device_mesh("cpu", (be.world_size,))
    tmp = TorchMP(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        torch_fully_shard(block, mesh=mesh, mp_policy=tmp)
    torch_fully_shard(model, mesh=mesh, mp_policy=tmp)
    return model, None


def _counted_step(model: torch.nn.Module, gpt: GPTConfig, rank: int, memory: Any = None) -> _Count:
    """Forward and backward of one batch, counted, after an uncounted warm-up step."""
    g = torch.Generator().manual_seed(rank)
    data = torch.randint(0, gpt.vocab_size, (2, gpt.seq_len + 1), generator=g)
    x, y = data[:, :-1], data[:, 1:]
    loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
    loss.backward()  # type: ignore[no-untyped-call]  # unannotated in torch; a warm-up
    model.zero_grad(set_to_none=True)
    before = memory.stats().num_allocs if memory is not None else 0
    counts = _Count()
    with counts:
        loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
        loss.backward()  # type: ignore[no-untyped-call]  # unannotated in torch
    counts.allocations = memory.stats().num_allocs - before if memory is not None else 0
    return counts


def traffic_rank(be: Any, engine: str, model_name: str) -> TrafficCounters:
    """One rank of one engine's count (every rank of the group calls it)."""
    if engine not in TRAFFIC_ENGINES:
        raise ValueError(f"engine must be one of {TRAFFIC_ENGINES}, got {engine!r}")
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    gpt = MODEL_SIZES[model_name]
    torch.manual_seed(0)
    plain = _counted_step(GPT(gpt).to(torch.bfloat16), gpt, be.rank)
    torch.manual_seed(0)
    model = GPT(gpt)
    params = sum(p.numel() for p in model.parameters())
    sharded, memory = _sharded(model, be, engine)
    got = _counted_step(sharded, gpt, be.rank, memory)
    allocs = None if memory is None else got.allocations
    return TrafficCounters(
        engine,
        be.world_size,
        params,
        (got.copy_bytes - plain.copy_bytes) / params,
        got.copy_ops - plain.copy_ops,
        sum(n for k, n in got.calls.items() if k in _COLLECTIVES),
        sum(n for k, n in got.calls.items() if k in _POINT_TO_POINT),
        allocs,
    )


def count_traffic(engine: str, *, world_size: int = 2, model: str = "small") -> TrafficCounters:
    """Rank 0's counters of one step of ``engine`` at ``world_size`` over gloo processes."""
    from fsdp_comm import launch

    if engine not in TRAFFIC_ENGINES:
        raise ValueError(f"engine must be one of {TRAFFIC_ENGINES}, got {engine!r}")
    if model not in MODEL_SIZES:
        raise ValueError(f"model must be one of {sorted(MODEL_SIZES)}, got {model!r}")
    per_rank: list[TrafficCounters] = launch(
        traffic_rank, world_size, args=(engine, model), timeout=600, threads_per_rank=1
    )
    return per_rank[0]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m fsdp.bench.traffic",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--world-size",
        type=int,
        nargs="+",
        default=[1, 2],
        help="world sizes to count at (default: 1 2)",
    )
    p.add_argument(
        "--model", choices=sorted(MODEL_SIZES), default="small", help="GPT size (default: small)"
    )
    add_record_argument(p)
    args = p.parse_args(argv)
    figures: dict[str, Any] = {}
    print(f"# model={args.model} bf16 parameters, fp32 reduction, gloo; one step, rank 0")
    print(
        f"{'engine':<8}{'world':>6}{'copy B/param':>14}{'copy ops':>10}{'collectives':>13}"
        f"{'p2p':>6}{'pool allocs':>13}"
    )
    for world in args.world_size:
        rows = {e: count_traffic(e, world_size=world, model=args.model) for e in TRAFFIC_ENGINES}
        for e, c in rows.items():
            allocs = "-" if c.pool_allocations is None else str(c.pool_allocations)
            print(
                f"{e:<8}{world:>6}{c.copy_bytes_per_param:>14.2f}{c.copy_ops:>10}"
                f"{c.collectives:>13}{c.point_to_point:>6}{allocs:>13}"
            )
        ratio = rows["ours"].copy_bytes_per_param / max(rows["fsdp2"].copy_bytes_per_param, 1e-9)
        print(f"{'ratio':<8}{world:>6}{ratio:>14.2f}   ours / fsdp2 copy bytes")
        figures[f"world_size_{world}"] = {
            **{e: asdict(c) for e, c in rows.items()},
            "copy_bytes_ratio_ours_to_fsdp2": ratio,
        }
    if args.record:
        config = {
            "world_sizes": args.world_size,
            "model": args.model,
            "engines": list(TRAFFIC_ENGINES),
            "param_dtype": "bf16",
            "reduce_dtype": "fp32",
            "backend": "gloo",
        }
        prog = "python -m fsdp.bench.traffic"
        record = make_record("traffic", config, figures, prog=prog, argv=argv)
        print(f"record: {write_record(record, args.record)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
