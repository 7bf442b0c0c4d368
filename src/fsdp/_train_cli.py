"""Argument parsing for ``fsdp train``."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from ._gpt import MODEL_SIZES
from ._train import (
    COMPILE_BACKENDS,
    STRATEGIES,
    TrainConfig,
    TrainSummary,
    inductor_problem,
    run_training,
)

__all__ = ["main", "build_parser", "config_from_args"]


def _reshard(text: str) -> bool | int:
    lowered = text.lower()
    if lowered in ("true", "yes", "1"):
        return True
    if lowered in ("false", "no", "0"):
        return False
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be true, false or a group size, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a group size >= 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fsdp train", description="Train a GPT with FSDP on local "
                                "ranks (2 processes over gloo by default), under torchrun or "
                                "Slurm. Default data: Python's standard library sources.")
    a = p.add_argument
    a("--model", choices=sorted(MODEL_SIZES), default="small", help="model size (default small)")
    a("--world-size", type=int, default=2, help="local ranks to start (ignored under torchrun)")
    a("--backend", default="torch", help="torch (gloo on CPU, NCCL on GPU), cupy-nccl, threads")
    a("--strategy", choices=STRATEGIES, default="full_shard")
    a("--shard-size", type=int, help="hybrid_shard: ranks per shard group")
    a("--reshard-after-forward", type=_reshard, default=True, metavar="true|false|N")
    a("--param-dtype", choices=["bf16", "fp16", "fp32"], help="mixed precision compute dtype")
    a("--reduce-dtype", choices=["bf16", "fp16", "fp32"], help="gradient reduction dtype")
    a("--no-prefetch", action="store_true", help="disable forward and backward prefetch")
    a("--grad-accum", type=int, default=1, help="micro-batches per step (no sync between)")
    a("--clip", type=float, default=1.0, help="max global gradient norm (0: off)")
    a("--activation-checkpointing", action="store_true")
    a("--compile", nargs="?", const="inductor", choices=COMPILE_BACKENDS, metavar="BACKEND",
      help="torch.compile each block before sharding it, with this backend: "
           f"{', '.join(COMPILE_BACKENDS)} (default off; a bare --compile: inductor, which on "
           "CPU needs a C++ compiler)")
    a("--cpu-offload", action="store_true")
    a("--meta-init", action="store_true", help="build on meta, materialise unit by unit")
    a("--steps", type=int, default=60)
    a("--global-batch", type=int, default=8, help="sequences per step, all ranks together")
    a("--lr", type=float, default=3e-3)
    a("--seed", type=int, default=0)
    a("--data", help="a text file or directory (default: the standard library sources)")
    a("--save", metavar="DIR", help="checkpoint directory (written at the end)")
    a("--save-every", type=int, default=0, metavar="N", help="also save every N steps")
    a("--resume", metavar="DIR", help="continue from this checkpoint")
    a("--metrics", metavar="PATH", help="append one JSON line per step")
    a("--plot", metavar="PNG", help="draw loss and memory over steps (needs matplotlib)")
    a("--no-progress", action="store_true", help="no progress bar")
    a("--threads-per-rank", type=int)
    a("--host-mmap-threshold", type=int, default=0, metavar="BYTES",
      help="fix glibc's mmap threshold per rank: less host memory, slower steps (default 0: "
           "glibc's own; the engine trims the heap instead)")
    a("--hf-config", metavar="SPEC", help="a transformers model instead of --model: a config.json "
      "path or MODEL_TYPE[:key=value,...], e.g. gpt2:n_layer=4,n_embd=256,n_head=4 (random "
      "weights, nothing downloaded; needs fsdp[hf])")
    a("--seq-len", type=int, help="tokens per sequence (default: the model's; 128 for --hf-config)")
    a("--json", action="store_true", help="also print the summary as one JSON line")
    return p


def config_from_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> TrainConfig:
    if args.world_size < 1:
        p.error(f"--world-size must be >= 1, got {args.world_size}")
    for name in ("steps", "global_batch", "grad_accum"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.global_batch % args.world_size:
        p.error(f"--global-batch {args.global_batch} must be divisible by --world-size "
                f"{args.world_size} (each rank takes an equal share)")
    if args.strategy == "hybrid_shard" and args.shard_size and args.world_size % args.shard_size:
        p.error(f"--shard-size {args.shard_size} must divide --world-size {args.world_size}")
    if args.data and not Path(args.data).exists():
        p.error(f"--data: no such file or directory: {args.data}")
    if args.resume and not Path(args.resume).exists():
        p.error(f"--resume: no checkpoint at {args.resume}")
    if args.hf_config:
        from ._hf import parse_hf_spec

        try:
            parse_hf_spec(args.hf_config)
        except ValueError as exc:
            p.error(str(exc))
    if not 0 <= args.host_mmap_threshold <= 32 * 2**20:
        p.error(f"--host-mmap-threshold must be 0 (glibc's own) or at most 33554432 bytes, got "
                f"{args.host_mmap_threshold}")
    if args.seq_len is not None and args.seq_len < 1:
        p.error(f"--seq-len must be >= 1, got {args.seq_len}")
    if args.compile == "inductor":
        problem = inductor_problem()
        if problem is not None:
            p.error(f"--compile inductor: {problem} (--compile aot_eager needs no compiler)")
    if args.metrics is None and args.plot:
        args.metrics = str(Path(args.plot).with_suffix(".jsonl"))
    return TrainConfig(
        model=args.model, world_size=args.world_size, backend=args.backend,
        strategy=args.strategy, shard_size=args.shard_size,
        reshard_after_forward=args.reshard_after_forward, param_dtype=args.param_dtype,
        reduce_dtype=args.reduce_dtype, prefetch=not args.no_prefetch,
        grad_accum=args.grad_accum, clip=args.clip or None,
        activation_checkpointing=args.activation_checkpointing, cpu_offload=args.cpu_offload,
        meta_init=args.meta_init, steps=args.steps, global_batch=args.global_batch, lr=args.lr,
        seed=args.seed, data=args.data, save=args.save, save_every=args.save_every,
        resume=args.resume, metrics=args.metrics, threads_per_rank=args.threads_per_rank,
        progress=not args.no_progress, hf_config=args.hf_config, seq_len=args.seq_len,
        host_mmap_threshold=args.host_mmap_threshold, compile=args.compile)


def print_summary(cfg: TrainConfig, s: TrainSummary) -> None:
    first = s.losses[0] if s.losses else float("nan")
    last = s.losses[-1] if s.losses else float("nan")
    name = cfg.hf_config if cfg.hf_config else cfg.model
    print(f"model {name} ({s.params / 1e6:.1f} M parameters), {cfg.strategy}, "
          f"{cfg.world_size} ranks over {cfg.backend}")
    print(f"steps {s.start_step}->{s.steps}: loss {first:.4f} -> {last:.4f}, "
          f"{s.tokens_per_s:,.0f} tokens/s, peak RSS per rank (MiB) {s.peak_rss_mib}")
    if s.checkpoint:
        print(f"checkpoint: {s.checkpoint}")


def _plot(metrics: str, png: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install matplotlib") from None
    rows = [json.loads(line) for line in Path(metrics).read_text().splitlines() if line]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    ax1.plot([r["step"] for r in rows], [r["loss"] for r in rows])
    ax1.set_ylabel("loss")
    for rank in range(len(rows[0]["peak_rss_mib"])):
        ax2.plot([r["step"] for r in rows], [r["peak_rss_mib"][rank] for r in rows],
                 label=f"rank {rank}")
    ax2.set_ylabel("peak RSS (MiB)")
    ax2.set_xlabel("step")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(png)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    cfg = config_from_args(parser, args)
    try:
        summary = run_training(cfg)
    except ValueError as exc:  # a user error found once ranks run (e.g. a foreign checkpoint)
        print(f"fsdp train: error: {exc.args[0] if exc.args else exc}", file=sys.stderr)
        return 2
    if os.environ.get("RANK", "0") != "0":
        return 0  # under torchrun/Slurm every rank returns; rank 0 reports
    print_summary(cfg, summary)
    if args.plot:
        _plot(cfg.metrics or "", args.plot)
        print(f"plot: {args.plot}")
    if args.json:
        print(json.dumps({"summary": asdict(summary)}))
    return 0
