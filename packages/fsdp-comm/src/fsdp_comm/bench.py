"""Bus-bandwidth sweep of the collectives, printed like nccl-tests.

    python -m fsdp_comm.bench --backend torch --world-size 2 --sizes 1K,1M,16M,64M --compare-raw

For each collective and message size: time per call, algorithm bandwidth (bytes / time) and bus
bandwidth (algorithm bandwidth times the collective's traffic factor: (n-1)/n for all-gather
and reduce-scatter, 2(n-1)/n for all-reduce, 1 for broadcast), the slowest rank's figure.
``--compare-raw`` (torch backend) times torch.distributed called directly on the same group in
the same run and prints the ratio. Sizes are bytes of the whole output (all-gather), the whole
input (reduce-scatter) or the tensor (all-reduce, broadcast), as in nccl-tests.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from ._backend import Backend
from ._cli_format import CliHelpFormatter
from ._launch import launch
from ._reduce_op import ReduceOp
from ._registry import available_backends
from ._sizes import parse_size

__all__ = ["BenchConfig", "BenchResult", "run_sweep", "main"]

COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "broadcast")
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class BenchConfig:
    collectives: tuple[str, ...] = ("all_gather", "reduce_scatter")
    sizes: tuple[int, ...] = (1 << 10, 1 << 20, 16 << 20, 64 << 20)
    dtype: str = "fp32"
    iters: int = 10
    warmup: int = 3
    rounds: int = 5
    compare_raw: bool = False


@dataclass(frozen=True)
class BenchResult:
    collective: str
    nbytes: int
    time_us: float
    algbw_gbs: float
    busbw_gbs: float
    raw_time_us: float | None = None

    @property
    def speedup_vs_raw(self) -> float | None:
        """torch.distributed's time divided by ours (> 1: we are faster)."""
        return None if self.raw_time_us is None else self.raw_time_us / self.time_us


def _bus_factor(collective: str, n: int) -> float:
    if collective == "all_reduce":
        return 2 * (n - 1) / n
    if collective == "broadcast":
        return 1.0
    return (n - 1) / n


def _tensors(be: Backend, collective: str, nbytes: int, dtype: torch.dtype) -> tuple[Any, ...]:
    esize = torch.empty(0, dtype=dtype).element_size()
    per_rank = max(1, nbytes // esize // be.world_size)
    big = torch.ones(per_rank * be.world_size, dtype=dtype, device=be.device)
    small = torch.ones(per_rank, dtype=dtype, device=be.device)
    if collective == "all_gather":
        return big, small
    if collective == "reduce_scatter":
        return small, big
    return (big,)


def _ours(be: Backend, collective: str, ts: tuple[Any, ...]) -> Callable[[], object]:
    calls = {
        "all_gather": lambda: be.all_gather_into_tensor(ts[0], ts[1]),
        "reduce_scatter": lambda: be.reduce_scatter_tensor(ts[0], ts[1]),
        "all_reduce": lambda: be.all_reduce(ts[0]),
        "broadcast": lambda: be.broadcast(ts[0], src=0),
    }
    return calls[collective]


def _raw(be: Backend, collective: str, ts: tuple[Any, ...]) -> Callable[[], object]:
    """torch.distributed called directly, with the names torch users call today."""
    import torch.distributed as dist

    group = be.group  # type: ignore[attr-defined]
    calls = {
        "all_gather": lambda: dist.all_gather_into_tensor(ts[0], ts[1], group=group),
        "reduce_scatter": lambda: dist.reduce_scatter_tensor(ts[0], ts[1], group=group),
        "all_reduce": lambda: dist.all_reduce(ts[0], group=group),
        "broadcast": lambda: dist.broadcast(ts[0], src=be.ranks[0], group=group),
    }
    return calls[collective]


def _time_round(be: Backend, fn: Callable[[], object], iters: int) -> float:
    """Mean seconds per call over one round, on the slowest rank."""
    _sync(be)
    be.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    _sync(be)
    mean = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64, device=be.device)
    be.all_reduce(mean, op=ReduceOp.MAX)
    return float(mean.item())


def _time(be: Backend, fns: Sequence[Callable[[], object]], cfg: BenchConfig) -> list[float]:
    """Median seconds per call of each function; rounds alternate between the functions so a
    busy machine slows all of them alike."""
    for fn in fns:
        for _ in range(cfg.warmup):
            fn()
    samples: list[list[float]] = [[] for _ in fns]
    for _ in range(cfg.rounds):
        for i, fn in enumerate(fns):
            samples[i].append(_time_round(be, fn, cfg.iters))
    return [statistics.median(s) for s in samples]


def _sync(be: Backend) -> None:
    if be.device.type == "cuda":
        torch.cuda.synchronize(be.device)


def bench_rank(be: Backend, cfg: BenchConfig) -> list[BenchResult]:
    """Run the sweep on one rank (every rank runs it; all return the same figures)."""
    dtype = _DTYPES[cfg.dtype]
    results = []
    for collective in cfg.collectives:
        for nbytes in cfg.sizes:
            ts = _tensors(be, collective, nbytes, dtype)
            real_bytes = max(t.numel() * t.element_size() for t in ts)
            fns = [_ours(be, collective, ts)]
            if cfg.compare_raw:
                fns.append(_raw(be, collective, ts))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)  # torch's old names, raw only
                times = _time(be, fns, cfg)
            raw = times[1] * 1e6 if cfg.compare_raw else None
            algbw = real_bytes / times[0] / 1e9
            results.append(
                BenchResult(
                    collective,
                    real_bytes,
                    times[0] * 1e6,
                    algbw,
                    algbw * _bus_factor(collective, be.world_size),
                    raw,
                )
            )
    return results


def run_sweep(
    cfg: BenchConfig,
    *,
    backend: str = "torch",
    world_size: int = 2,
    backend_options: dict[str, Any] | None = None,
) -> list[BenchResult]:
    """Launch ``world_size`` local ranks and return rank 0's results."""
    if cfg.compare_raw and backend != "torch":
        raise ValueError(f"compare_raw needs backend='torch', got backend={backend!r}")
    per_rank: list[list[BenchResult]] = launch(
        bench_rank,
        world_size,
        backend=backend,
        args=(cfg,),
        backend_options=backend_options,
        timeout=3600,
    )
    return per_rank[0]


def format_table(results: Sequence[BenchResult], header: str) -> str:
    lines = [
        header,
        f"{'collective':<15}{'bytes':>12}{'time us':>12}{'algbw GB/s':>12}"
        f"{'busbw GB/s':>12}{'raw us':>12}{'raw/ours':>10}",
    ]
    for r in results:
        raw = "" if r.raw_time_us is None else f"{r.raw_time_us:12.1f}{r.speedup_vs_raw:10.2f}"
        lines.append(
            f"{r.collective:<15}{r.nbytes:>12}{r.time_us:12.1f}{r.algbw_gbs:12.3f}"
            f"{r.busbw_gbs:12.3f}{raw}"
        )
    return "\n".join(lines)


def _sizes(text: str) -> tuple[int, ...]:
    """``--sizes``: comma-separated sizes (`fsdp_comm.parse_size`'s rule); a bad one is an
    argparse error naming the flag, not a traceback."""
    try:
        sizes = tuple(parse_size(s, argument="--sizes") for s in text.split(",") if s.strip())
    except ValueError as exc:  # argparse names the flag itself
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--sizes: ")) from None
    if not sizes:
        raise argparse.ArgumentTypeError(f"no sizes given, got {text!r}")
    return sizes


def _parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=CliHelpFormatter)
    p.add_argument(
        "--backend",
        choices=available_backends(),
        default="torch",
        help="communication backend the ranks use",
    )
    p.add_argument("--world-size", type=int, default=2, help="local ranks to start")
    p.add_argument(
        "--collectives",
        default="all_gather,reduce_scatter",
        help=f"comma-separated, from {','.join(COLLECTIVES)}",
    )
    p.add_argument(
        "--sizes",
        type=_sizes,
        default="1K,1M,16M,64M",
        help="comma-separated message sizes in bytes, with an optional unit K, M, G "
        "or T (powers of 1024): 4096,1K,4M,1G",
    )
    p.add_argument(
        "--dtype", choices=sorted(_DTYPES), default="fp32", help="element type of the messages"
    )
    p.add_argument("--iters", type=int, default=10, help="calls per timed round")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls before the rounds")
    p.add_argument(
        "--rounds",
        type=int,
        default=5,
        help="rounds of --iters calls; the median round is reported",
    )
    p.add_argument(
        "--compare-raw",
        action="store_true",
        help="also time torch.distributed directly (torch backend)",
    )
    p.add_argument(
        "--json", action="store_true", help="print the results as JSON instead of the table"
    )
    p.add_argument("--out", metavar="PATH", help="also write the results as JSON to PATH")
    return p


def main(argv: Sequence[str] | None = None, prog: str = "python -m fsdp_comm.bench") -> int:
    """Run the sweep from the command line; ``prog`` names the command in usage and errors."""
    parser = _parser(prog)
    args = parser.parse_args(argv)
    collectives = tuple(c.strip() for c in args.collectives.split(",") if c.strip())
    unknown = sorted(set(collectives) - set(COLLECTIVES))
    if unknown:
        parser.error(f"--collectives: unknown {unknown}; choose from {list(COLLECTIVES)}")
    cfg = BenchConfig(
        collectives=collectives,
        sizes=args.sizes,
        dtype=args.dtype,
        iters=args.iters,
        warmup=args.warmup,
        rounds=args.rounds,
        compare_raw=args.compare_raw,
    )
    results = run_sweep(cfg, backend=args.backend, world_size=args.world_size)
    rows = [asdict(r) for r in results]
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print(
            format_table(
                results,
                f"# backend={args.backend} world_size={args.world_size} "
                f"dtype={args.dtype} iters={args.iters}",
            )
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
