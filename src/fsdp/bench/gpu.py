"""GPU benchmarks: this engine, torch's FSDP2 and the plain model on one GPU, in one run.

    python -m fsdp.bench.gpu                                     # = speed, the defaults below
    python -m fsdp.bench.gpu speed --model 1b --out results/     # tokens/s, MFU, peak memory
    python -m fsdp.bench.gpu speed --trace                       # + where the GPU's time went
    python -m fsdp.bench.gpu overhead                            # per-unit overhead (us)
    python -m fsdp.bench.gpu offload --model 300m --out results/ # CPU offload + a trace
    python -m fsdp.bench.gpu step                                # one small step (sanitizers)

``speed`` trains a Llama-style model (`fsdp.models.Llama`) in bf16 compute with fp32 master weights,
one FSDP unit per block, with and without activation checkpointing. Every run of a
configuration is its own fresh process (so its peak memory is its own). The configurations run
interleaved and repeated, every other round reversed (ABC CBA ..., ``--repeats``, default 2):
per configuration the median step time and its range over the rounds, and each engine's ratio
to FSDP2 and to the plain model, the median of the ratios of runs of the same round. The
GPU's clocks, power and temperature are read before and after every run (nvidia-smi, else
torch.cuda; reported as absent when neither can). ``--trace``: one torch.profiler trace per
configuration (first round, after the timed steps), reduced to the compute stream's idle time
and the kernel time by category (gemm, nccl, copy+cast, other). World size 1 over NCCL: the
collectives are local copies, so the figures are each engine's own cost on top of the model.
MFU counts model FLOPs (`LlamaConfig.flops_per_token`) against the GPU's dense bf16 peak.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ..models import LLAMA_SIZES, Llama, LlamaConfig
from ._gpu_measure import (
    GpuState,
    config_label,
    events_from_chrome_trace,
    format_gpu_state,
    format_speed_table,
    format_trace_lines,
    paired_ratios,
    read_gpu_state,
    reduce_trace,
    round_order,
    spread,
    summarize_runs,
    union_length,
)
from ._record import add_record_argument, make_record, write_record

__all__ = ["SpeedConfig", "SpeedResult", "h2d_overlap", "main", "trace_figures"]

ENGINES = ("plain", "fsdp2", "ours")
#: Dense bf16 peak of the GPUs we have measured on (SXM parts), FLOP/s.
BF16_PEAK = {"H100": 989.4e12, "H200": 989.4e12, "A100": 312e12}
#: Seconds one configuration may take in its own process.
_TIMEOUT = float(os.environ.get("FSDP_BENCH_TIMEOUT", "600"))
#: Steps a ``--trace`` records (after the timed steps).
_TRACED_STEPS = 2


@dataclass(frozen=True)
class SpeedConfig:
    engine: str = "ours"
    model: str = "1b"
    batch: int = 4
    steps: int = 10
    warmup: int = 3
    ac: bool = False
    offload: bool = False
    trace: str | None = None  # write a chrome trace of two steps here


@dataclass
class SpeedResult:
    config: SpeedConfig
    step_s: float
    tokens_per_s: float
    mfu: float | None
    peak_mib: float
    first_loss: float
    device: str


def _peak_flops() -> float | None:
    name = torch.cuda.get_device_name()
    return next((v for k, v in BF16_PEAK.items() if k in name), None)


def _init_world_of_one() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.distributed.init_process_group(
        "nccl",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=0,
        world_size=1,
        device_id=torch.device("cuda", 0),
    )


def _fully_shard_of(engine: str) -> Any:
    """torch's ``fully_shard`` for "fsdp2", this engine's otherwise: called the same way."""
    if engine == "fsdp2":
        from torch.distributed.fsdp import fully_shard as torch_fully_shard

        return torch_fully_shard
    from fsdp_engine import fully_shard

    return fully_shard


def _apply_ac(model: Llama) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    for i, block in enumerate(model.blocks):
        model.blocks[i] = checkpoint_wrapper(block)


def build(cfg: SpeedConfig) -> torch.nn.Module:
    """The model of ``cfg`` on the GPU, wrapped for ``cfg.engine``."""
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Llama(LLAMA_SIZES[cfg.model])
    if cfg.ac:
        _apply_ac(model)
    if cfg.engine == "plain":
        return model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

    fully_shard = _fully_shard_of(cfg.engine)
    mesh = init_device_mesh("cuda", (1,))
    kw: dict[str, Any] = {
        "mesh": mesh,
        "offload_policy": CPUOffloadPolicy() if cfg.offload else OffloadPolicy(),
        "mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
    }
    for block in model.blocks:
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    return model


def _step(
    model: torch.nn.Module, opt: torch.optim.Optimizer, tokens: torch.Tensor, autocast: bool
) -> torch.Tensor:
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
    loss.backward()  # type: ignore[no-untyped-call]  # unannotated in torch
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def _optimizer(model: torch.nn.Module, offload: bool) -> torch.optim.Optimizer:
    # Fused AdamW on the GPU; parameters offloaded to the host step there (foreach).
    flag: dict[str, Any] = {"foreach": True} if offload else {"fused": True}
    return torch.optim.AdamW(model.parameters(), lr=1e-4, **flag)


def _trace(
    model: torch.nn.Module, opt: torch.optim.Optimizer, batch: Any, path: str, autocast: bool
) -> None:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(_TRACED_STEPS):
            _step(model, opt, batch, autocast)
        torch.cuda.synchronize()
    prof.export_chrome_trace(path)


def run_speed(cfg: SpeedConfig) -> SpeedResult:
    """Train ``cfg`` in this process (it must be fresh: peak memory is measured from zero)."""
    _init_world_of_one()
    mcfg: LlamaConfig = LLAMA_SIZES[cfg.model]
    model = build(cfg)
    opt = _optimizer(model, cfg.offload)
    g = torch.Generator(device="cuda").manual_seed(0)
    batch = torch.randint(
        0, mcfg.vocab_size, (cfg.batch, mcfg.seq_len + 1), device="cuda", generator=g
    )
    autocast = cfg.engine == "plain"
    first = _step(model, opt, batch, autocast).item()
    for _ in range(cfg.warmup - 1):
        _step(model, opt, batch, autocast)
    torch.cuda.synchronize()
    times = []
    for _ in range(cfg.steps):
        t0 = time.perf_counter()
        _step(model, opt, batch, autocast)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    if cfg.trace:
        _trace(model, opt, batch, cfg.trace, autocast)
    step = statistics.median(times)
    tps = cfg.batch * mcfg.seq_len / step
    peak = _peak_flops()
    return SpeedResult(
        cfg,
        step,
        tps,
        None if peak is None else mcfg.flops_per_token() * tps / peak,
        torch.cuda.max_memory_allocated() / 2**20,
        first,
        torch.cuda.get_device_name(),
    )


def _in_fresh_process(cfg: SpeedConfig) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "fsdp.bench.gpu", "_one", json.dumps(asdict(cfg))]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=_TIMEOUT)
    except subprocess.TimeoutExpired as exc:
        tail = (exc.stderr or b"")[-3000:]
        return {"config": asdict(cfg), "error": f"{tail!r}\ntimed out after {_TIMEOUT} s"}
    if out.returncode:
        return {"config": asdict(cfg), "error": out.stderr[-6000:]}
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def _gpu_change(before: GpuState, after: GpuState) -> str:
    """``sm 1980->1755 MHz, 41->63 C, 98->690 W``: what moved while a run ran."""
    if before.source == "absent" and after.source == "absent":
        return "GPU state absent"
    parts = []
    for attr, unit in (("sm_mhz", "MHz"), ("temp_c", "C"), ("power_w", "W")):
        a, b = getattr(before, attr), getattr(after, attr)
        if a is not None or b is not None:
            parts.append(f"{_num(a)}->{_num(b)} {unit}")
    return ", ".join(parts) or "GPU state absent"


def _num(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0f}"


def _row(r: dict[str, Any]) -> str:
    name = config_label(r["config"])
    if "error" in r:
        return f"{name:<18} FAILED: {r['error'].strip().splitlines()[-1]}"
    mfu = "-" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
    return (
        f"{name:<18} {1e3 * r['step_s']:9.1f} ms {r['tokens_per_s']:9.0f} tok/s {mfu:>6} "
        f"{r['peak_mib'] / 1024:7.2f} GiB  loss {r['first_loss']:.5f}"
    )


def _run_rounds(
    configs: Sequence[SpeedConfig],
    repeats: int,
    trace_of: Callable[[SpeedConfig], str | None] | None = None,
) -> list[dict[str, Any]]:
    """Every configuration in a fresh process, in `round_order`; the GPU's state read before
    and after each run. ``trace_of(cfg)``: a trace path for the configuration's first run, or
    None."""
    runs = []
    for rnd, cfg in round_order(list(configs), repeats):
        if trace_of is not None and rnd == 0:
            cfg = replace(cfg, trace=trace_of(cfg))
        before = read_gpu_state()
        t0 = time.perf_counter()
        result = _in_fresh_process(cfg)
        after = read_gpu_state()
        result.update(
            round=rnd,
            wall_s=time.perf_counter() - t0,
            gpu_before=asdict(before),
            gpu_after=asdict(after),
        )
        runs.append(result)
        print(
            f"round {rnd + 1}/{repeats} {_row(result)}  [{_gpu_change(before, after)}; "
            f"{result['wall_s']:.0f} s]",
            flush=True,
        )
    return runs


def _report(
    runs: list[dict[str, Any]], gpu: dict[str, GpuState], out: str | None, name: str, started: float
) -> None:
    summaries = summarize_runs(runs)
    rounds = 1 + max((r["round"] for r in runs), default=0)
    print(
        f"\n# {name}: median of {rounds} round(s), every other round reversed; "
        "ratios: median of the per-round ratios (min-max)"
    )
    print(format_speed_table(summaries))
    for line in format_trace_lines(summaries):
        print(line)
    print(f"GPU before: {format_gpu_state(gpu['before'])}")
    print(f"GPU after:  {format_gpu_state(gpu['after'])}")
    print(f"{len(runs)} runs in {time.perf_counter() - started:.0f} s")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        doc = {
            "summary": [s.as_json() for s in summaries],
            "runs": runs,
            "gpu": {k: asdict(v) for k, v in gpu.items()},
        }
        Path(out, f"{name}.json").write_text(json.dumps(doc, indent=1))


def _compare(
    args: argparse.Namespace,
    configs: list[SpeedConfig],
    name: str,
    trace_of: Callable[[SpeedConfig, str], str | None],
) -> int:
    """Run ``configs`` in rounds (`_run_rounds`), then print and save the summary."""
    started, before = time.perf_counter(), read_gpu_state()
    print(f"GPU before: {format_gpu_state(before)}", flush=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)  # the traces go there as they come
    with tempfile.TemporaryDirectory(prefix="fsdp-bench-gpu-") as tmp:
        trace_dir = args.out or tmp

        def path_of(cfg: SpeedConfig) -> str | None:
            return trace_of(cfg, trace_dir)

        runs = _run_rounds(configs, args.repeats, path_of)
    gpu = {"before": before, "after": read_gpu_state()}
    _report(runs, gpu, args.out, name, started)
    if args.record:
        config = {
            "model": args.model,
            "batch": args.batch,
            "steps": args.steps,
            "repeats": args.repeats,
            "trace": args.trace,
            "configurations": [config_label(asdict(c)) for c in configs],
            "world_size": 1,
            "backend": "nccl",
        }
        figures = {
            "summary": [s.as_json() for s in summarize_runs(runs)],
            "gpu": {k: asdict(v) for k, v in gpu.items()},
        }
        kind = "gpu-offload" if name.startswith("offload") else "gpu-speed"
        _write_record(args, kind, config, figures)
    return 0


def _write_record(
    args: argparse.Namespace, kind: str, config: dict[str, Any], figures: dict[str, Any]
) -> None:
    record = make_record(kind, config, figures, prog="python -m fsdp.bench.gpu", argv=args.argv)
    print(f"record: {write_record(record, args.record)}")


def _trace_name(cfg: SpeedConfig, folder: str) -> str:
    tag = config_label(asdict(cfg)).replace(" +", "-").replace(" ", "")
    return str(Path(folder, f"trace-{tag}.json"))


def speed(args: argparse.Namespace) -> int:
    configs = [
        SpeedConfig(engine=engine, model=args.model, batch=args.batch, steps=args.steps, ac=ac)
        for ac in (False, True)
        for engine in ENGINES
    ]

    def trace_of(cfg: SpeedConfig, folder: str) -> str | None:
        return _trace_name(cfg, folder) if args.trace else None

    return _compare(args, configs, f"speed-{args.model}", trace_of)


def offload(args: argparse.Namespace) -> int:
    configs = [
        SpeedConfig(
            engine=engine, model=args.model, batch=args.batch, steps=args.steps, offload=off
        )
        for engine in ("fsdp2", "ours")
        for off in (False, True)
    ]

    def trace_of(cfg: SpeedConfig, folder: str) -> str | None:
        # As before: the offloaded runs are traced when there is a folder to keep them in.
        keep = cfg.offload and args.out
        return _trace_name(cfg, folder) if args.trace or keep else None

    return _compare(args, configs, f"offload-{args.model}", trace_of)


def h2d_overlap(trace_path: str) -> dict[str, float]:
    """Host-to-device copy time in a chrome trace, and the share of it that ran while a kernel
    ran on another stream (1.0: every copy hidden behind compute)."""
    return _h2d_overlap(json.loads(Path(trace_path).read_text())["traceEvents"])


def _h2d_overlap(events: list[dict[str, Any]]) -> dict[str, float]:
    copies = [
        (e["ts"], e["ts"] + e["dur"], e.get("tid"))
        for e in events
        if e.get("cat") == "gpu_memcpy" and "HtoD" in e.get("name", "")
    ]
    kernels = sorted(
        (e["ts"], e["ts"] + e["dur"], e.get("tid")) for e in events if e.get("cat") == "kernel"
    )
    total = sum(b - a for a, b, _ in copies)
    hidden = 0.0
    for a, b, stream in copies:
        covered = [
            (max(a, ka), min(b, kb)) for ka, kb, ks in kernels if ks != stream and ka < b and kb > a
        ]
        hidden += union_length(covered)
    return {"h2d_ms": total / 1e3, "h2d_hidden_share": hidden / total if total else 0.0}


def trace_figures(trace_path: str, steps: int = _TRACED_STEPS) -> dict[str, Any]:
    """What a trace of ``steps`` steps is reduced to: host-to-device copies and their overlap
    (`h2d_overlap`), and the compute stream's idle time and kernel time by category per step
    (`fsdp.bench._gpu_measure.reduce_trace`)."""
    trace = json.loads(Path(trace_path).read_text())
    figures: dict[str, Any] = dict(_h2d_overlap(trace["traceEvents"]))
    figures["trace"] = asdict(reduce_trace(events_from_chrome_trace(trace), steps))
    return figures


def overhead(args: argparse.Namespace) -> int:
    """Per-unit overhead on the GPU: 64 tiny linear units, this engine and FSDP2 over the
    plain model, world size 1, each run's fastest of 10 rounds; the engines' runs interleaved
    over ``--repeats`` rounds (AB BA ...), each in a fresh process."""
    started, before = time.perf_counter(), read_gpu_state()
    print(f"GPU before: {format_gpu_state(before)}", flush=True)
    got: dict[str, dict[int, float]] = {"ours": {}, "fsdp2": {}}
    errors: dict[str, list[str]] = {"ours": [], "fsdp2": []}
    for rnd, engine in round_order(list(got), args.repeats):
        value = _overhead_in_fresh_process(engine)
        if isinstance(value, float):
            got[engine][rnd] = value
        else:
            errors[engine].append(value)
        shown = (
            f"{value:.1f} us per unit"
            if isinstance(value, float)
            else f"FAILED: {(value.strip().splitlines() or ['?'])[-1]}"
        )
        print(f"round {rnd + 1}/{args.repeats} {engine}: {shown}", flush=True)
    after = read_gpu_state()
    summary = {e: spread(v.values()) for e, v in got.items()}
    ratio = paired_ratios(got["ours"], got["fsdp2"])
    for engine, s in summary.items():
        print(
            f"{engine:<6} {'FAILED' if s is None else s.format()} us per unit per "
            f"forward+backward (median (min-max) of {args.repeats} runs)"
        )
    print(f"ratio  {'-' if ratio is None else ratio.format(digits=2)} ours / fsdp2 (per round)")
    print(f"GPU before: {format_gpu_state(before)}\nGPU after:  {format_gpu_state(after)}")
    print(f"{sum(len(v) for v in got.values())} runs in {time.perf_counter() - started:.0f} s")
    if args.out or args.record:
        doc = {
            "us_per_unit": {
                e: {"runs": v, "summary": None if (s := summary[e]) is None else asdict(s)}
                for e, v in got.items()
            },
            "ours_over_fsdp2": None if ratio is None else asdict(ratio),
            "errors": errors,
            "gpu": {"before": asdict(before), "after": asdict(after)},
        }
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, "overhead.json").write_text(json.dumps(doc, indent=1))
    if args.record:
        config = {"units": 64, "repeats": args.repeats, "world_size": 1, "backend": "nccl"}
        _write_record(args, "gpu-overhead", config, doc)
    return 0


def _overhead_in_fresh_process(engine: str) -> float | str:
    """This engine's per-unit overhead (us) from a fresh process, or why there is none."""
    cmd = [sys.executable, "-m", "fsdp.bench.gpu", "_overhead", engine]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=_TIMEOUT)
    except subprocess.TimeoutExpired:
        return f"timed out after {_TIMEOUT} s"
    if done.returncode:
        return done.stderr[-1500:]
    return float(done.stdout.split()[-1])


def _overhead_one(engine: str, units: int = 64, iters: int = 20, rounds: int = 10) -> float:
    from .engines import _Tiny

    _init_world_of_one()
    torch.manual_seed(0)
    plain, model = _Tiny(units, 8).cuda(), _Tiny(units, 8).cuda()
    from torch.distributed.device_mesh import init_device_mesh

    fully_shard = _fully_shard_of(engine)
    mesh = init_device_mesh("cuda", (1,))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    x = torch.randn(4, 8, device="cuda")

    def timed(m: torch.nn.Module) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(iters):
            m(x).sum().backward()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / iters

    for m in (plain, model):  # warm-up
        timed(m)
    best = {"plain": float("inf"), "sharded": float("inf")}
    for _ in range(rounds):  # taking turns, each keeps its fastest round (as fsdp.bench.engines)
        best["plain"] = min(best["plain"], timed(plain))
        best["sharded"] = min(best["sharded"], timed(model))
    return (best["sharded"] - best["plain"]) / units * 1e6


def step(args: argparse.Namespace) -> int:
    """Two training steps of a tiny Llama on ``--world-size`` process ranks sharing the GPU
    over gloo: small enough to run under compute-sanitizer or TORCH_CUDA_SANITIZER=1."""
    from fsdp_comm import launch

    losses = launch(
        _step_rank,
        args.world_size,
        backend="torch",
        timeout=600,
        backend_options={"device": "cuda:0", "process_group_backend": "gloo"},
    )
    print("losses per rank:", losses)
    return 0


def _step_rank(be: Any) -> list[float]:
    from fsdp_engine import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    model = Llama(LLAMA_SIZES["tiny"]).cuda()
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mesh=be, mp_policy=mp)
    fully_shard(model, mesh=be, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(
        0, 256, (2, 65), device="cuda", generator=torch.Generator("cuda").manual_seed(be.rank)
    )
    return [_step(model, opt, tokens, False).item() for _ in range(2)]


def _one(spec: str) -> int:
    cfg = SpeedConfig(**json.loads(spec))
    result = asdict(run_speed(cfg))
    if cfg.trace:
        result.update(trace_figures(cfg.trace))
        subprocess.run(["gzip", "-f", cfg.trace], check=False)
    print(json.dumps(result))
    return 0


_SUBCOMMANDS = {
    "speed": "tokens/s, MFU and peak memory: this engine, FSDP2 and the plain model (the default)",
    "offload": "CPU offload of this engine and FSDP2, with a trace of each",
    "overhead": "per-unit Python overhead (us) of this engine and FSDP2",
    "step": "two small training steps on process ranks sharing the GPU (for sanitizers)",
}


def _repeats(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _parser() -> argparse.ArgumentParser:
    from fsdp_comm import CliHelpFormatter

    p = argparse.ArgumentParser(
        prog="python -m fsdp.bench.gpu", description=__doc__, formatter_class=CliHelpFormatter
    )
    sub = p.add_subparsers(
        dest="what",
        required=True,
        metavar="BENCHMARK",
        help="which benchmark to run (speed when none is named)",
    )
    subs = {
        name: sub.add_parser(name, help=text, description=text, formatter_class=CliHelpFormatter)
        for name, text in _SUBCOMMANDS.items()
    }
    for name, default in (("speed", "1b"), ("offload", "300m")):
        s = subs[name]
        s.add_argument(
            "--model", choices=sorted(LLAMA_SIZES), default=default, help="Llama-style model size"
        )
        s.add_argument("--batch", type=int, default=4, help="sequences per step")
        s.add_argument("--steps", type=int, default=10, help="timed steps per run")
        s.add_argument("--out", help="folder for the JSON results (and the traces)")
        s.add_argument(
            "--trace",
            action="store_true",
            help="trace each configuration's first run (2 steps after the timed "
            "ones) and report the compute stream's idle time and the kernel "
            "time by category",
        )
    for name in ("speed", "offload", "overhead"):
        subs[name].add_argument(
            "--repeats",
            type=_repeats,
            default=2,
            help="rounds of every configuration, each a fresh process, "
            "every other round in reverse order",
        )
    subs["overhead"].add_argument("--out", help="folder for overhead.json")
    for name in ("speed", "offload", "overhead"):
        add_record_argument(subs[name])
    subs["step"].add_argument(
        "--world-size", type=int, default=2, help="process ranks sharing the GPU over gloo"
    )
    return p


def _with_default_benchmark(argv: list[str]) -> list[str]:
    """``speed`` first when no benchmark is named (``python -m fsdp.bench.gpu --repeats 3``)."""
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help")):
        return ["speed", *argv]
    return argv


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if os.environ.get("FSDP_DUMP_AFTER") and argv[:1] in (["_one"], ["_overhead"], ["step"]):
        # Stacks of every thread, then exit, if one configuration hangs.
        import faulthandler

        faulthandler.dump_traceback_later(float(os.environ["FSDP_DUMP_AFTER"]), exit=True)
    if argv[:1] == ["_one"]:
        return _one(argv[1])
    if argv[:1] == ["_overhead"]:
        print(_overhead_one(argv[1]))
        return 0
    p = _parser()
    args = p.parse_args(_with_default_benchmark(argv))
    args.argv = argv  # as typed, for --record's command line
    if not torch.cuda.is_available():
        p.error("needs a CUDA device: torch.cuda.is_available() is False")
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    return {"speed": speed, "offload": offload, "overhead": overhead, "step": step}[args.what](args)


if __name__ == "__main__":
    raise SystemExit(main())
