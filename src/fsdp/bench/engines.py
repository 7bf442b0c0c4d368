"""Side-by-side training-step comparison: this engine against torch's FSDP2 (``fully_shard``),
FSDP1 (``FullyShardedDataParallel``) and DDP, on the same GPT, in the same run.

    python -m fsdp.bench.engines --world-size 2 --model 8x512 --steps 8 --repeats 2
    python -m fsdp.bench.engines --world-size 4 --tp 2 --engines ours,fsdp2   # FSDP x TP
    python -m fsdp.bench.engines --param-dtype bf16 --engines ours,fsdp2,fsdp1 --record DIR

Each engine runs in its own freshly started group of ranks (so peak memory is its own), the
engines alternating across repeats so a busy machine slows all alike. Per engine: median step
time (forward, backward, AdamW step), the ratio to DDP and to FSDP2, per-rank peak RSS, and the
first losses (all engines must agree). One torch thread per rank. ``--param-dtype bf16`` is
what users run: bf16 parameters and compute, gradients reduced in fp32 (FSDP2's and this
engine's ``MixedPrecisionPolicy``, FSDP1's ``MixedPrecision``; DDP has no such policy).
``--record DIR`` also writes the run as a JSON record (`fsdp.bench._record`).
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.nn.functional as F

from ..models import GPT, MODEL_SIZES, Block, GPTConfig
from ._record import add_record_argument, make_record, write_record

__all__ = ["EngineBenchConfig", "EngineResult", "run_engine", "unit_overhead", "main", "ENGINES"]

ENGINES = ("ours", "fsdp2", "fsdp1", "ddp")
#: ``--param-dtype``: the parameters' dtype in forward and backward (reduction in fp32).
PARAM_DTYPES = ("fp32", "bf16")


@dataclass(frozen=True)
class EngineBenchConfig:
    engine: str = "ours"
    model: str = "8x512"
    global_batch: int = 8
    steps: int = 8
    warmup: int = 2
    seed: int = 0
    # Variants of this engine, for the paper's ablations (fsdp.bench.ablations):
    prefetch: bool = True
    max_inflight_all_gathers: int | None = 2
    reshard_after_forward: bool | None = None  # None: the engine's default (Note [last unit stays])
    hybrid: bool = False
    prefetch_depth: int = 1  # units gathered ahead (explicit prefetch beyond the default 1)
    # A glibc mmap threshold every engine runs under (Note [host heap] in fsdp_memory); 0
    # leaves glibc's own. Off by default: this engine trims the heap instead.
    host_mmap_threshold: int = 0
    host_trim_bytes: int | str | None = "auto"  # this engine's MemoryManager (None: off)
    # torch.optim.AdamW's implementation for every engine: "default" (the per-tensor loop on
    # CPU: one DTensor dispatch per op and parameter for engines with DTensor parameters,
    # FSDP2's and this one's), "foreach" or "fused" (one dispatch per op for all of them).
    optimizer: str = "default"
    # Tensor parallel degree (ours and fsdp2 only): a (world / tp, tp) mesh, the model cut by
    # fsdp.models._tp_plan (sequence parallel) and sharded over the dp dim.
    tp: int = 1
    # "bf16": bf16 parameters and compute, fp32 gradient reduction (ours, fsdp2, fsdp1)
    param_dtype: str = "fp32"


@dataclass
class EngineResult:
    engine: str
    world_size: int
    step_s: float
    peak_rss_mib: float
    losses: list[float] = field(default_factory=list)
    pooled_peak_mib: float = 0.0  # this engine's gathered buffers (its memory manager)
    faults_per_step: float = 0.0  # minor page faults of a timed step (median; Note [host heap])


def _wrap_ours(model: GPT, be: Any, cfg: EngineBenchConfig, dp_mesh: Any = None) -> torch.nn.Module:
    from fsdp_comm import init_mesh
    from fsdp_engine import FSDPModule, fully_shard, strategy_mesh_shape
    from fsdp_memory import MemoryManager

    mesh = be if dp_mesh is None else dp_mesh
    if cfg.hybrid:  # shard groups of half the world (the engine's default)
        mesh = init_mesh(strategy_mesh_shape("hybrid_shard", be.world_size), backend=be)
    memory = MemoryManager(
        be.device,
        max_inflight_all_gathers=cfg.max_inflight_all_gathers,
        host_trim_bytes=cfg.host_trim_bytes,
    )
    kwargs: dict[str, Any] = dict(
        mesh=mesh, memory=memory, reshard_after_forward=cfg.reshard_after_forward
    )
    if cfg.param_dtype == "bf16":
        from fsdp_engine import MixedPrecisionPolicy

        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    for block in model.blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    # fully_shard made each of them an FSDPModule (its class is now FSDP<class>)
    blocks = [cast(FSDPModule, block) for block in model.blocks]
    if not cfg.prefetch:
        for unit in [*blocks, cast(FSDPModule, model)]:
            unit.set_modules_to_forward_prefetch([])
            unit.set_modules_to_backward_prefetch([])
    elif cfg.prefetch_depth > 1:
        for i, unit in enumerate(blocks):
            unit.set_modules_to_forward_prefetch(blocks[i + 1 : i + 1 + cfg.prefetch_depth])
            unit.set_modules_to_backward_prefetch(blocks[max(0, i - cfg.prefetch_depth) : i][::-1])
    # read back for the pooled peak (nn.Module types its attributes as Tensor | Module)
    model._bench_memory = memory  # type: ignore[assignment]
    return model


def _wrap(
    model: GPT, be: Any, engine: str, dp_mesh: Any = None, param_dtype: str = "fp32"
) -> torch.nn.Module:
    bf16 = param_dtype == "bf16"
    if engine == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
        from torch.distributed.fsdp import fully_shard as torch_fully_shard

        mesh = init_device_mesh("cpu", (be.world_size,)) if dp_mesh is None else dp_mesh
        mp = TorchMP(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else TorchMP()
        for block in model.blocks:
            torch_fully_shard(block, mesh=mesh, mp_policy=mp)
        torch_fully_shard(model, mesh=mesh, mp_policy=mp)  # the model, now FSDP<GPT>
        return model
    if engine == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        # FSDP1's equivalent of the policy above: buffers stay fp32 (buffer_dtype None), as
        # FSDP2 and this engine leave them
        fsdp1_mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        return FullyShardedDataParallel(
            model,
            auto_wrap_policy=ModuleWrapPolicy({Block}),
            device_id=torch.device("cpu"),
            mixed_precision=fsdp1_mp if bf16 else None,
        )
    if engine == "ddp":
        if bf16:
            raise ValueError(
                "param_dtype must be 'fp32' for engine 'ddp' (DDP has no mixed-precision "
                "policy), got 'bf16'"
            )
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model)
    raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")


def _batch(cfg: EngineBenchConfig, gpt: GPTConfig, step: int, rank: int, world: int) -> Any:
    g = torch.Generator().manual_seed(cfg.seed * 1000 + step)
    data = torch.randint(0, gpt.vocab_size, (cfg.global_batch, gpt.seq_len + 1), generator=g)
    per = cfg.global_batch // world
    mine = data[rank * per : (rank + 1) * per]
    return mine[:, :-1], mine[:, 1:]


def engine_rank(be: Any, cfg: EngineBenchConfig) -> EngineResult:
    """One rank of one engine's run (every rank of the group calls it)."""
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    if cfg.host_mmap_threshold:
        from fsdp_memory import set_host_mmap_threshold

        set_host_mmap_threshold(cfg.host_mmap_threshold)
    gpt = MODEL_SIZES[cfg.model]
    torch.manual_seed(cfg.seed)
    model, dp_mesh = GPT(gpt), None
    dp_rank, dp = be.rank, be.world_size
    if cfg.tp > 1:  # FSDP x TP: cut the model over tp, shard over dp
        from torch.distributed.device_mesh import init_device_mesh

        from ..models import parallelize

        mesh = init_device_mesh(
            "cpu", (be.world_size // cfg.tp, cfg.tp), mesh_dim_names=("dp", "tp")
        )
        parallelize(model, mesh["tp"])
        dp_mesh, dp_rank, dp = mesh["dp"], mesh["dp"].get_local_rank(), mesh["dp"].size()
    wrapped = (
        _wrap_ours(model, be, cfg, dp_mesh)
        if cfg.engine == "ours"
        else _wrap(model, be, cfg.engine, dp_mesh, cfg.param_dtype)
    )
    impl: dict[str, Any] = {"foreach": {"foreach": True}, "fused": {"fused": True}}.get(
        cfg.optimizer, {}
    )
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-3, **impl)
    times, losses, faults = [], [], []
    for step in range(cfg.warmup + cfg.steps):
        x, y = _batch(cfg, gpt, step, dp_rank, dp)  # tp ranks of a dp rank: the same
        be.barrier()
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0 = time.perf_counter()
        loss = F.cross_entropy(wrapped(x).flatten(0, 1).float(), y.flatten())
        loss.backward()  # type: ignore[no-untyped-call]  # unannotated in torch
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
        mean = loss.detach().reshape(1).clone()
        be.all_reduce(mean)  # the global batch's loss, the same on every rank and engine
        losses.append(mean.item() / be.world_size)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    memory = getattr(wrapped, "_bench_memory", None)
    pooled = memory.stats().peak_bytes / 2**20 if memory is not None else 0.0
    return EngineResult(
        cfg.engine,
        be.world_size,
        statistics.median(times[cfg.warmup :]),
        peak,
        losses[:3],
        pooled,
        statistics.median(faults[cfg.warmup :]),
    )


def run_engine(cfg: EngineBenchConfig, world_size: int) -> EngineResult:
    """Launch ``world_size`` ranks over gloo; the slowest rank's time, the largest peak."""
    from fsdp_comm import launch

    results: list[EngineResult] = launch(
        engine_rank, world_size, args=(cfg,), timeout=3600, threads_per_rank=1
    )
    worst = max(results, key=lambda r: r.step_s)
    worst.peak_rss_mib = max(r.peak_rss_mib for r in results)
    worst.faults_per_step = max(r.faults_per_step for r in results)
    return worst


def format_results(results: dict[str, list[EngineResult]]) -> str:
    med = {e: statistics.median(r.step_s for r in rs) for e, rs in results.items()}
    rss = {e: max(r.peak_rss_mib for r in rs) for e, rs in results.items()}
    flt = {e: statistics.median(r.faults_per_step for r in rs) for e, rs in results.items()}
    lines = [
        f"{'engine':<8}{'step s':>9}{'vs DDP':>9}{'vs FSDP2':>10}{'peak RSS MiB':>14}"
        f"{'faults/step':>13}{'  first losses'}"
    ]
    for e, rs in results.items():
        vs_ddp = f"{med[e] / med['ddp']:9.2f}" if "ddp" in med else f"{'':9}"
        vs_f2 = f"{med[e] / med['fsdp2']:10.2f}" if "fsdp2" in med else f"{'':10}"
        losses = ", ".join(f"{v:.5f}" for v in rs[0].losses)
        lines.append(f"{e:<8}{med[e]:9.3f}{vs_ddp}{vs_f2}{rss[e]:14.0f}{flt[e]:13.0f}  {losses}")
    return "\n".join(lines)


def result_figures(results: dict[str, list[EngineResult]]) -> dict[str, Any]:
    """The figures of a comparison, for its record: per engine the median step time, every
    repeat's, peak RSS (the largest), the median faults per step, the pooled peak and the
    first losses; each engine's ratios to DDP and FSDP2 (of the medians, as printed)."""
    med = {e: statistics.median(r.step_s for r in rs) for e, rs in results.items()}
    rss = {e: max(r.peak_rss_mib for r in rs) for e, rs in results.items()}
    per_engine: dict[str, Any] = {}
    for e, rs in results.items():
        per_engine[e] = {
            "step_s": med[e],
            "step_s_runs": [r.step_s for r in rs],
            "peak_rss_mib": rss[e],
            "faults_per_step": statistics.median(r.faults_per_step for r in rs),
            "pooled_peak_mib": max(r.pooled_peak_mib for r in rs),
            "first_losses": rs[0].losses,
        }
        for base in ("ddp", "fsdp2"):
            if base in med and base != e:
                per_engine[e][f"step_ratio_to_{base}"] = med[e] / med[base]
                per_engine[e][f"peak_rss_ratio_to_{base}"] = rss[e] / rss[base]
    return {"engines": per_engine}


def _trim_arg(value: int | None) -> int | str | None:
    return "auto" if value is None else (value or None)


def _parser(prog: str) -> argparse.ArgumentParser:
    from fsdp_comm import CliHelpFormatter, size_arg

    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=CliHelpFormatter)
    p.add_argument("--world-size", type=int, default=2, help="ranks of every engine")
    p.add_argument("--model", choices=sorted(MODEL_SIZES), default="8x512", help="GPT size")
    p.add_argument(
        "--engines", default="ours,fsdp2,ddp", help=f"comma-separated, from {','.join(ENGINES)}"
    )
    p.add_argument(
        "--global-batch",
        type=int,
        default=8,
        help="sequences per step, all ranks together (a multiple of --world-size)",
    )
    p.add_argument("--steps", type=int, default=8, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps before them")
    p.add_argument(
        "--repeats",
        type=int,
        default=2,
        help="runs of each engine, engines alternating; the median is reported",
    )
    p.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor parallel degree (ours and fsdp2): a (world/tp, tp) mesh, the "
        "GPT cut by fsdp's tensor-parallel plan, sequence parallel, then "
        "sharded over dp",
    )
    p.add_argument(
        "--optimizer",
        choices=["default", "foreach", "fused"],
        default="default",
        help="AdamW implementation for every engine (default: torch's per-tensor "
        "loop on CPU, which pays DTensor's dispatch per op and parameter)",
    )
    p.add_argument(
        "--param-dtype",
        choices=PARAM_DTYPES,
        default="fp32",
        help="bf16: what users run, bf16 parameters and compute with fp32 gradient "
        "reduction (ours and fsdp2: MixedPrecisionPolicy, fsdp1: MixedPrecision; "
        "not ddp, which has no such policy)",
    )
    p.add_argument(
        "--host-mmap-threshold",
        type=size_arg("--host-mmap-threshold", allow_zero=True),
        default=0,
        metavar="SIZE",
        help="a glibc mmap threshold every engine runs under, in bytes or with a "
        "unit: 128K, 1M (default 0: glibc's own; see Note [host heap] in "
        "fsdp_memory)",
    )
    p.add_argument(
        "--host-trim-bytes",
        type=size_arg("--host-trim-bytes", allow_zero=True),
        default=None,
        metavar="SIZE",
        help="this engine trims the host heap when more than SIZE of it is free, "
        "in bytes or with a unit: 128M (default: its memory manager's, 256 MiB "
        "on CPU; 0: never; Note [host heap] in fsdp_memory)",
    )
    p.add_argument(
        "--unit-overhead",
        action="store_true",
        help="instead: Python time per unit per forward+backward on a 64-unit model "
        "of tiny layers, ours against FSDP2",
    )
    p.add_argument(
        "--overhead-world-size",
        type=int,
        default=None,
        help="world size of --unit-overhead (default: 2 for bf16-gathered, 1 for fp32-resident)",
    )
    p.add_argument(
        "--overhead-config",
        choices=OVERHEAD_CONFIGS,
        default="bf16-gathered",
        help="--unit-overhead's units: bf16-gathered (what users run: bf16 "
        "parameters gathered per forward, fp32 reduction) or fp32-resident "
        "(fp32, world size 1: never gathered, cast or reduced; the engines' "
        "bookkeeping alone)",
    )
    add_record_argument(p)
    return p


def main(argv: Sequence[str] | None = None, prog: str = "python -m fsdp.bench.engines") -> int:
    """Run the comparison from the command line; ``prog`` names the command in usage."""
    p = _parser(prog)
    args = p.parse_args(argv)
    if args.unit_overhead:
        if args.param_dtype != "fp32":
            p.error(
                "--param-dtype is the step comparison's; --unit-overhead's units take "
                f"--overhead-config (bf16-gathered or fp32-resident), got --param-dtype "
                f"{args.param_dtype}"
            )
        cfg = args.overhead_config
        world = args.overhead_world_size or (2 if cfg == "bf16-gathered" else 1)
        got: dict[str, list[float]] = {"ours": [], "fsdp2": []}
        for _ in range(args.repeats):  # engines alternating, as in the step comparison
            for engine in got:
                got[engine].append(unit_overhead(engine, world_size=world, config=cfg))
        for engine, values in got.items():
            print(
                f"{engine:<8}{statistics.median(values):8.1f} us per unit per "
                f"forward+backward (64 units, {cfg}, world size {world}; runs: "
                f"{', '.join(f'{v:.1f}' for v in values)})"
            )
        ratio = statistics.median(got["ours"]) / statistics.median(got["fsdp2"])
        print(f"ratio   {ratio:8.2f} ours / fsdp2")
        if args.record:
            config: dict[str, Any] = {
                "overhead_config": cfg,
                "world_size": world,
                "units": 64,
                "repeats": args.repeats,
            }
            figures = {
                "us_per_unit": {e: statistics.median(v) for e, v in got.items()},
                "runs_us": got,
                "ratio_ours_to_fsdp2": ratio,
            }
            record = make_record("unit-overhead", config, figures, prog=prog, argv=argv)
            print(f"record: {write_record(record, args.record)}")
        return 0
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    bad = [e for e in engines if e not in ENGINES]
    if bad:
        p.error(f"--engines: unknown {bad}; choose from {list(ENGINES)}")
    if args.global_batch % args.world_size:
        p.error(f"--global-batch {args.global_batch} must divide by --world-size {args.world_size}")
    if args.tp < 1 or args.world_size % args.tp:
        p.error(f"--tp must be a positive divisor of --world-size {args.world_size}, got {args.tp}")
    if args.tp > 1 and set(engines) - {"ours", "fsdp2"}:
        p.error(
            f"--tp {args.tp} runs the engines ours and fsdp2 only (FSDP x TP), got "
            f"--engines {args.engines}"
        )
    if args.param_dtype == "bf16" and "ddp" in engines:
        p.error(
            "--param-dtype bf16 needs a mixed-precision policy (bf16 parameters, fp32 "
            f"reduction), which DDP has none of: leave ddp out of --engines, got --engines "
            f"{args.engines}"
        )
    results: dict[str, list[EngineResult]] = {e: [] for e in engines}
    for _ in range(args.repeats):
        for e in engines:
            cfg = EngineBenchConfig(
                engine=e,
                model=args.model,
                global_batch=args.global_batch,
                steps=args.steps,
                warmup=args.warmup,
                host_mmap_threshold=args.host_mmap_threshold,
                host_trim_bytes=_trim_arg(args.host_trim_bytes),
                optimizer=args.optimizer,
                tp=args.tp,
                param_dtype=args.param_dtype,
            )
            results[e].append(run_engine(cfg, args.world_size))
    print(
        f"# model={args.model} world_size={args.world_size} tp={args.tp} "
        f"global_batch={args.global_batch} "
        f"steps={args.steps} repeats={args.repeats} host_mmap_threshold="
        f"{args.host_mmap_threshold or 'glibc default'} optimizer=AdamW({args.optimizer}) "
        f"param_dtype={args.param_dtype} (gloo, 1 thread per rank)"
    )
    print(format_results(results))
    if args.record:
        config = {
            "engines": engines,
            "model": args.model,
            "world_size": args.world_size,
            "tp": args.tp,
            "param_dtype": args.param_dtype,
            "reduce_dtype": "fp32",
            "global_batch": args.global_batch,
            "steps": args.steps,
            "warmup": args.warmup,
            "repeats": args.repeats,
            "optimizer": args.optimizer,
            "host_mmap_threshold": args.host_mmap_threshold,
            "host_trim_bytes": args.host_trim_bytes,
            "backend": "gloo",
            "threads_per_rank": 1,
        }
        record = make_record("engines", config, result_figures(results), prog=prog, argv=argv)
        print(f"record: {write_record(record, args.record)}")
    return 0


# ---- per-unit Python overhead ------------------------------------------------------------------
class _Tiny(torch.nn.Module):
    def __init__(self, n: int, width: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


#: `unit_overhead`'s unit configurations (``--overhead-config``).
OVERHEAD_CONFIGS = ("bf16-gathered", "fp32-resident")


def overhead_rank(
    be: Any, engine: str, units: int, iters: int, rounds: int = 10, config: str = "fp32-resident"
) -> float:
    """Microseconds per unit per forward+backward added by ``engine`` over the plain model.

    The plain and the sharded model take turns, ``rounds`` times ``iters`` steps each, and
    each keeps its fastest round: on a shared machine the minimum is the figure least moved
    by other work (as ``timeit`` does), and taking turns exposes both to the same load.
    ``config`` "bf16-gathered": bf16 parameters (the plain model is bf16 too), fp32
    reduction, every unit resharded after forward, so each gathers, casts and reduces; the
    clock is the calling thread's CPU time, so the time spent waiting for collectives (gloo's
    latency over loopback, about a millisecond per collective here, which no host work
    shortens) is left out and what remains is the host's own work per unit."""
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    bf16 = config == "bf16-gathered"
    clock = time.thread_time if bf16 else time.perf_counter
    x = torch.randn(4, 8)

    def timed(model: torch.nn.Module, inp: torch.Tensor) -> float:
        t0 = clock()
        for _ in range(iters):
            model(inp).sum().backward()
        return (clock() - t0) / iters

    torch.manual_seed(0)
    plain, model = _Tiny(units, 8), _Tiny(units, 8)
    if bf16:
        plain = plain.to(torch.bfloat16)
    _shard_tiny(model, engine, be, bf16)
    runs = ((plain, x.to(torch.bfloat16) if bf16 else x), (model, x))
    for m, inp in runs:
        for _ in range(3):
            m(inp).sum().backward()
    best = {"plain": float("inf"), "sharded": float("inf")}
    for _ in range(rounds):
        best["plain"] = min(best["plain"], timed(*runs[0]))
        best["sharded"] = min(best["sharded"], timed(*runs[1]))
    return (best["sharded"] - best["plain"]) / units * 1e6


def _shard_tiny(model: _Tiny, engine: str, be: Any, bf16: bool = False) -> None:
    if engine == "ours":
        from fsdp_engine import MixedPrecisionPolicy, fully_shard

        mp = (
            MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            if bf16
            else MixedPrecisionPolicy()
        )
        for layer in model.layers:
            fully_shard(layer, mesh=be, mp_policy=mp)
        fully_shard(model, mesh=be, mp_policy=mp)
        return
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    tmp = TorchMP(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else TorchMP()
    mesh = init_device_mesh("cpu", (be.world_size,))
    for layer in model.layers:
        torch_fully_shard(layer, mesh=mesh, mp_policy=tmp)
    torch_fully_shard(model, mesh=mesh, mp_policy=tmp)


def unit_overhead(
    engine: str,
    *,
    world_size: int = 1,
    units: int = 64,
    iters: int = 20,
    rounds: int = 10,
    config: str = "fp32-resident",
) -> float:
    """Per-unit overhead in microseconds (slowest rank). "fp32-resident" at world size 1
    measures the engines' bookkeeping alone (nothing gathered, cast or reduced);
    "bf16-gathered" at world size 2 is the path users run, collectives included."""
    from fsdp_comm import launch

    if config not in OVERHEAD_CONFIGS:
        raise ValueError(f"config must be one of {OVERHEAD_CONFIGS}, got {config!r}")
    per_rank: list[float] = launch(
        overhead_rank,
        world_size,
        args=(engine, units, iters, rounds, config),
        timeout=600,
        threads_per_rank=1,
    )
    return max(per_rank)


if __name__ == "__main__":
    raise SystemExit(main())
