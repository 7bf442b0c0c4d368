"""The step timeline of a GPT training step (`fsdp_engine.profile_steps`): exposed and hidden
communication and the engine's Python per step, for the asv suite (asv_bench/benchmarks/
timeline.py) and by hand:

    python -m fsdp.bench.timeline --model small --world-size 2 --steps 4

Ranks run over gloo, one torch thread each; the rank function lives here because asv's
benchmark process cannot hand its own functions to spawned ranks.
"""

from __future__ import annotations

import argparse
import dataclasses
import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from ..models import GPT, MODEL_SIZES
from ._record import add_record_argument, make_record, write_record

__all__ = ["timeline_rank", "run_timeline", "main"]


def timeline_rank(be: Any, model: str, steps: int, warmup: int) -> Any:
    """One rank: ``warmup`` steps, then ``steps`` profiled ones; this rank's summary."""
    from fsdp_engine import fully_shard, profile_steps

    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    cfg = MODEL_SIZES[model]
    torch.manual_seed(0)
    net = GPT(cfg)
    for block in net.blocks:
        fully_shard(block, mesh=be)
    fully_shard(net, mesh=be)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(be.rank)
    x = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=g)

    def step() -> None:
        loss = F.cross_entropy(net(x).flatten(0, 1), x.flatten())
        loss.backward()  # type: ignore[no-untyped-call]  # unannotated in torch
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(warmup):
        step()
    with profile_steps(net) as prof:
        for _ in range(steps):
            be.barrier()
            prof.begin_step()  # the barrier is not the step's
            step()
            prof.step()
    return prof.summary()


def run_timeline(
    *, model: str = "small", world_size: int = 2, steps: int = 4, warmup: int = 2
) -> Any:
    """The summary of the rank with the most exposed communication."""
    from fsdp_comm import launch

    if model not in MODEL_SIZES:
        raise ValueError(f"model must be one of {sorted(MODEL_SIZES)}, got {model!r}")
    results = launch(
        timeline_rank, world_size, args=(model, steps, warmup), timeout=1800, threads_per_rank=1
    )
    return max(results, key=lambda s: s.exposed_ms)


def main(argv: Sequence[str] | None = None) -> int:
    from fsdp_comm import CliHelpFormatter

    p = argparse.ArgumentParser(
        prog="python -m fsdp.bench.timeline", description=__doc__, formatter_class=CliHelpFormatter
    )
    p.add_argument("--model", choices=sorted(MODEL_SIZES), default="small", help="GPT size")
    p.add_argument("--world-size", type=int, default=2, help="ranks over gloo")
    p.add_argument("--steps", type=int, default=4, help="profiled steps")
    p.add_argument("--warmup", type=int, default=2, help="steps before them")
    add_record_argument(p)
    args = p.parse_args(argv)
    for name in ("world_size", "steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 1:
        p.error(f"--warmup must be >= 1 (the first step builds the units), got {args.warmup}")
    summary = run_timeline(
        model=args.model, world_size=args.world_size, steps=args.steps, warmup=args.warmup
    )
    print(summary.format())
    if args.record:
        config = {
            "model": args.model,
            "world_size": args.world_size,
            "steps": args.steps,
            "warmup": args.warmup,
            "backend": "gloo",
            "threads_per_rank": 1,
        }
        # the rank with the most exposed communication (run_timeline)
        figures = dataclasses.asdict(summary)
        prog = "python -m fsdp.bench.timeline"
        record = make_record("timeline", config, figures, prog=prog, argv=argv)
        print(f"record: {write_record(record, args.record)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
