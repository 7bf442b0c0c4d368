"""GPU benchmarks: this engine, torch's FSDP2 and the plain model on one GPU, in one run.

    python -m fsdp.bench_gpu speed --model 1b --out results/     # tokens/s, MFU, peak memory
    python -m fsdp.bench_gpu overhead                            # per-unit overhead (us)
    python -m fsdp.bench_gpu offload --model 300m --out results/ # CPU offload + a trace
    python -m fsdp.bench_gpu step                                # one small step (sanitizers)

``speed`` trains a Llama-style model (`fsdp._llama`) in bf16 compute with fp32 master weights,
one FSDP unit per block, with and without activation checkpointing. Every configuration runs in
its own fresh process (so its peak memory is its own), configurations interleaved. World size
1 over NCCL: the collectives are local copies, so the figures are each engine's own cost on top
of the model. MFU counts model FLOPs (`LlamaConfig.flops_per_token`) against the GPU's dense
bf16 peak.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ._llama import LLAMA_SIZES, Llama, LlamaConfig

__all__ = ["SpeedConfig", "SpeedResult", "main"]

ENGINES = ("plain", "fsdp2", "ours")
#: Dense bf16 peak of the GPUs we have measured on (SXM parts), FLOP/s.
BF16_PEAK = {"H100": 989.4e12, "H200": 989.4e12, "A100": 312e12}
#: Seconds one configuration may take in its own process.
_TIMEOUT = float(os.environ.get("FSDP_BENCH_TIMEOUT", "600"))


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
    torch.distributed.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}",
                                         rank=0, world_size=1, device_id=torch.device("cuda", 0))


def _fully_shard_of(engine: str) -> Any:
    """torch's ``fully_shard`` for "fsdp2", this engine's otherwise: called the same way."""
    if engine == "fsdp2":
        from torch.distributed.fsdp import fully_shard
    else:
        from fsdp_engine import fully_shard  # type: ignore[assignment]
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
    kw: dict[str, Any] = {"mesh": mesh, "offload_policy": CPUOffloadPolicy() if cfg.offload
                          else OffloadPolicy(),
                          "mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                            reduce_dtype=torch.float32)}
    for block in model.blocks:
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    return model


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, tokens: torch.Tensor,
          autocast: bool) -> torch.Tensor:
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def _optimizer(model: torch.nn.Module, offload: bool) -> torch.optim.Optimizer:
    # Fused AdamW on the GPU; parameters offloaded to the host step there (foreach).
    flag = {"foreach": True} if offload else {"fused": True}
    return torch.optim.AdamW(model.parameters(), lr=1e-4, **flag)


def _trace(model: torch.nn.Module, opt: torch.optim.Optimizer, batch: Any, path: str,
           autocast: bool) -> None:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
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
    batch = torch.randint(0, mcfg.vocab_size, (cfg.batch, mcfg.seq_len + 1), device="cuda",
                          generator=g)
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
    return SpeedResult(cfg, step, tps, None if peak is None else
                       mcfg.flops_per_token() * tps / peak,
                       torch.cuda.max_memory_allocated() / 2**20, first,
                       torch.cuda.get_device_name())


def _in_fresh_process(cfg: SpeedConfig) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "fsdp.bench_gpu", "_one", json.dumps(asdict(cfg))]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=_TIMEOUT)
    except subprocess.TimeoutExpired as exc:
        tail = (exc.stderr or b"")[-3000:]
        return {"config": asdict(cfg), "error": f"{tail!r}\ntimed out after {_TIMEOUT} s"}
    if out.returncode:
        return {"config": asdict(cfg), "error": out.stderr[-6000:]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def _row(r: dict[str, Any]) -> str:
    c = r["config"]
    name = f"{c['engine']}{' +AC' if c['ac'] else ''}{' +offload' if c['offload'] else ''}"
    if "error" in r:
        return f"{name:<22} FAILED: {r['error'].strip().splitlines()[-1]}"
    mfu = "-" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
    return (f"{name:<22} {1e3 * r['step_s']:9.1f} {r['tokens_per_s']:11.0f} {mfu:>6} "
            f"{r['peak_mib'] / 1024:9.2f} {r['first_loss']:10.5f}")


def _report(results: list[dict[str, Any]], out: str | None, name: str) -> None:
    print(f"{'engine':<22} {'step ms':>9} {'tokens/s':>11} {'MFU':>6} {'peak GiB':>9} "
          f"{'loss 1':>10}")
    for r in results:
        print(_row(r))
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        Path(out, f"{name}.json").write_text(json.dumps(results, indent=1))


def speed(args: argparse.Namespace) -> int:
    results = []
    for ac in (False, True):
        for engine in ENGINES:
            cfg = SpeedConfig(engine=engine, model=args.model, batch=args.batch,
                              steps=args.steps, ac=ac)
            results.append(_in_fresh_process(cfg))
            print(_row(results[-1]), flush=True)
    _report(results, args.out, f"speed-{args.model}")
    return 0


def offload(args: argparse.Namespace) -> int:
    results = []
    for engine in ("fsdp2", "ours"):
        for off in (False, True):
            trace = (str(Path(args.out, f"trace-{engine}-offload.json")) if off and args.out
                     else None)
            cfg = SpeedConfig(engine=engine, model=args.model, batch=args.batch,
                              steps=args.steps, offload=off, trace=trace)
            results.append(_in_fresh_process(cfg))
            print(_row(results[-1]), flush=True)
    _report(results, args.out, f"offload-{args.model}")
    return 0


def h2d_overlap(trace_path: str) -> dict[str, float]:
    """Host-to-device copy time in a chrome trace, and the share of it that ran while a kernel
    ran on another stream (1.0: every copy hidden behind compute)."""
    events = json.loads(Path(trace_path).read_text())["traceEvents"]
    copies = [(e["ts"], e["ts"] + e["dur"], e.get("tid")) for e in events
              if e.get("cat") == "gpu_memcpy" and "HtoD" in e.get("name", "")]
    kernels = sorted((e["ts"], e["ts"] + e["dur"], e.get("tid")) for e in events
                     if e.get("cat") == "kernel")
    total = sum(b - a for a, b, _ in copies)
    hidden = 0.0
    for a, b, stream in copies:
        covered = [(max(a, ka), min(b, kb)) for ka, kb, ks in kernels
                   if ks != stream and ka < b and kb > a]
        hidden += _union_length(covered)
    return {"h2d_ms": total / 1e3, "h2d_hidden_share": hidden / total if total else 0.0}


def _union_length(spans: list[tuple[float, float]]) -> float:
    length, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            length += b - max(a, end)
            end = b
    return length


def overhead(args: argparse.Namespace) -> int:
    """Per-unit overhead on the GPU: 64 tiny linear units, this engine and FSDP2 over the
    plain model, world size 1, each engine's fastest of 10 rounds."""
    out = {}
    for engine in ("ours", "fsdp2"):
        cmd = [sys.executable, "-m", "fsdp.bench_gpu", "_overhead", engine]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=_TIMEOUT)
            out[engine] = (float(done.stdout.split()[-1]) if done.returncode == 0
                           else done.stderr[-1500:])
        except subprocess.TimeoutExpired:
            out[engine] = f"timed out after {_TIMEOUT} s"
        print(f"{engine}: {out[engine]} us per unit", flush=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, "overhead.json").write_text(json.dumps(out))
    return 0


def _overhead_one(engine: str, units: int = 64, iters: int = 20, rounds: int = 10) -> float:
    from .bench_engines import _Tiny

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
    for _ in range(rounds):  # taking turns, each keeps its fastest round (as bench_engines)
        best["plain"] = min(best["plain"], timed(plain))
        best["sharded"] = min(best["sharded"], timed(model))
    return (best["sharded"] - best["plain"]) / units * 1e6


def step(args: argparse.Namespace) -> int:
    """Two training steps of a tiny Llama on ``--world-size`` process ranks sharing the GPU
    over gloo: small enough to run under compute-sanitizer or TORCH_CUDA_SANITIZER=1."""
    from fsdp_comm import launch

    losses = launch(_step_rank, args.world_size, backend="torch", timeout=600,
                    backend_options={"device": "cuda:0", "process_group_backend": "gloo"})
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
    tokens = torch.randint(0, 256, (2, 65), device="cuda",
                           generator=torch.Generator("cuda").manual_seed(be.rank))
    return [_step(model, opt, tokens, False).item() for _ in range(2)]


def _one(spec: str) -> int:
    cfg = SpeedConfig(**json.loads(spec))
    result = asdict(run_speed(cfg))
    if cfg.trace:
        result.update(h2d_overlap(cfg.trace))
        subprocess.run(["gzip", "-f", cfg.trace], check=False)
    print(json.dumps(result))
    return 0


_SUBCOMMANDS = {"speed": "tokens/s, MFU and peak memory: this engine, FSDP2 and the plain model",
                "offload": "CPU offload of this engine and FSDP2, with a trace of each",
                "overhead": "per-unit Python overhead (us) of this engine and FSDP2",
                "step": "two small training steps on process ranks sharing the GPU "
                        "(for sanitizers)"}


def _parser() -> argparse.ArgumentParser:
    from fsdp_comm import CliHelpFormatter

    p = argparse.ArgumentParser(prog="python -m fsdp.bench_gpu", description=__doc__,
                                formatter_class=CliHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True, metavar="BENCHMARK",
                           help="which benchmark to run")
    subs = {name: sub.add_parser(name, help=text, description=text,
                                 formatter_class=CliHelpFormatter)
            for name, text in _SUBCOMMANDS.items()}
    for name, default in (("speed", "1b"), ("offload", "300m")):
        s = subs[name]
        s.add_argument("--model", choices=sorted(LLAMA_SIZES), default=default,
                       help="Llama-style model size")
        s.add_argument("--batch", type=int, default=4, help="sequences per step")
        s.add_argument("--steps", type=int, default=10, help="timed steps per configuration")
        s.add_argument("--out", help="folder for the JSON results (and the offload trace)")
    subs["overhead"].add_argument("--out", help="folder for overhead.json")
    subs["step"].add_argument("--world-size", type=int, default=2,
                              help="process ranks sharing the GPU over gloo")
    return p


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
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA device: torch.cuda.is_available() is False")
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    return {"speed": speed, "offload": offload, "overhead": overhead, "step": step}[args.what](args)


if __name__ == "__main__":
    raise SystemExit(main())
