"""The FSDP paper's ablations, reproduced at small scale on this engine.

    python -m fsdp.bench.ablations --world-size 2 --steps 4

1. FlatParameter against per-parameter collectives: one all-gather of a block's flat buffer
   against one all-gather per parameter of the same block (paper Fig. 2: many small
   collectives cost far more than one large one).
2. Backward (and forward) prefetch on and off (paper Sec. 3.3.2): overlap of all-gathers with
   compute.
3. Rate limiter on (2 in flight) and off (paper Sec. 3.4, Fig. 6c), with explicit prefetching
   of 4 units ahead: the limiter bounds the gathered buffers alive at once.
4. Reshard after forward on and off (FULL_SHARD against SHARD_GRAD_OP): memory against
   the backward all-gathers.
5. Full against hybrid sharding at world size 4 (paper Sec. 3.2.2).

Each line gives step time (or collective time) and the pooled peak of gathered buffers.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from ..models import MODEL_SIZES, Block
from ._record import add_record_argument, make_record, write_record
from .engines import EngineBenchConfig, EngineResult, run_engine

__all__ = ["ABLATIONS", "AblationRow", "collective_granularity", "run_ablation", "main"]


@dataclass(frozen=True)
class AblationRow:
    name: str
    on: float
    off: float
    unit: str
    note: str

    @property
    def ratio(self) -> float:
        """off / on: > 1 means the feature helps."""
        return self.off / self.on


# name -> (setting for "on", setting for "off", what it shows)
ABLATIONS: dict[str, tuple[dict[str, Any], dict[str, Any], str]] = {
    "prefetch": (
        {"prefetch": True},
        {"prefetch": False},
        "step time: all-gathers overlapped with compute",
    ),
    "rate_limiter": (
        {"max_inflight_all_gathers": 2, "prefetch_depth": 4},
        {"max_inflight_all_gathers": None, "prefetch_depth": 4},
        "pooled peak: gathered buffers alive at once (prefetching 4 ahead)",
    ),
    "reshard_after_forward": (
        {"reshard_after_forward": True},
        {"reshard_after_forward": False},
        "pooled peak: memory freed between forward and backward",
    ),
    "hybrid": ({"hybrid": True}, {"hybrid": False}, "step time: shard groups of half the world"),
}


def _granularity_rank(be: Any, iters: int) -> tuple[float, float]:
    block = Block(MODEL_SIZES["8x512"])
    sizes = [p.numel() for p in block.parameters()]
    shards = [torch.ones(-(-n // be.world_size)) for n in sizes]
    outs = [torch.empty(s.numel() * be.world_size) for s in shards]
    flat = torch.ones(sum(s.numel() for s in shards))
    flat_out = torch.empty(flat.numel() * be.world_size)

    def per_param() -> None:
        for o, s in zip(outs, shards):
            be.all_gather_into_tensor(o, s)

    def one_flat() -> None:
        be.all_gather_into_tensor(flat_out, flat)

    times: dict[str, list[float]] = {}
    for name, fn in (("flat", one_flat), ("per_param", per_param)) * 2:
        be.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        times.setdefault(name, []).append((time.perf_counter() - t0) / iters)
    return statistics.median(times["flat"]), statistics.median(times["per_param"])


def collective_granularity(world_size: int, iters: int = 5) -> AblationRow:
    """Ablation 1: one flat all-gather of a block against one per parameter."""
    from fsdp_comm import launch

    flat, per_param = launch(_granularity_rank, world_size, args=(iters,), timeout=900)[0]
    return AblationRow(
        "flat_parameter",
        flat * 1e3,
        per_param * 1e3,
        "ms per block gather",
        "one all-gather per unit against one per parameter (12 per block)",
    )


def run_ablation(name: str, base: EngineBenchConfig, world_size: int) -> AblationRow:
    on, off, note = ABLATIONS[name]
    if name == "hybrid":
        world_size = max(world_size, 4)
    r_on: EngineResult = run_engine(replace(base, **on), world_size)
    r_off: EngineResult = run_engine(replace(base, **off), world_size)
    if note.startswith("pooled"):
        return AblationRow(name, r_on.pooled_peak_mib, r_off.pooled_peak_mib, "MiB", note)
    return AblationRow(name, r_on.step_s, r_off.step_s, "s per step", note)


def _parser() -> argparse.ArgumentParser:
    from fsdp_comm import CliHelpFormatter

    p = argparse.ArgumentParser(
        prog="python -m fsdp.bench.ablations", description=__doc__, formatter_class=CliHelpFormatter
    )
    p.add_argument(
        "--world-size",
        type=int,
        default=2,
        help="ranks of every run (hybrid sharding uses at least 4)",
    )
    p.add_argument("--model", choices=sorted(MODEL_SIZES), default="8x512", help="GPT size")
    p.add_argument("--steps", type=int, default=4, help="timed steps per run")
    add_record_argument(p)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    base = EngineBenchConfig(model=args.model, steps=args.steps, warmup=1)
    rows = [collective_granularity(args.world_size)]
    rows += [run_ablation(name, base, args.world_size) for name in ABLATIONS]
    print(f"# model={args.model} world_size={args.world_size} (hybrid at >= 4) steps={args.steps}")
    print(f"{'ablation':<24}{'on':>10}{'off':>10}{'off/on':>8}  unit / what it shows")
    for r in rows:
        print(f"{r.name:<24}{r.on:10.3f}{r.off:10.3f}{r.ratio:8.2f}  {r.unit}: {r.note}")
    if args.record:
        config = {
            "model": args.model,
            "world_size": args.world_size,
            "steps": args.steps,
            "warmup": 1,
            "backend": "gloo",
        }
        figures = {r.name: {**asdict(r), "off_over_on": r.ratio} for r in rows}
        prog = "python -m fsdp.bench.ablations"
        record = make_record("ablations", config, figures, prog=prog, argv=argv)
        print(f"record: {write_record(record, args.record)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
