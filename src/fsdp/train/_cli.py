"""Argument parsing for ``fsdp train``."""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from fsdp_comm import CliHelpFormatter, available_backends, size_arg

from ._config_file import add_config_options, config_toml, parse_args_with_config
from ._metrics import metrics_problem
from ._reporter import performance_line
from ._tp import resume_tp_problem
from ._train import (
    COMPILE_BACKENDS,
    PROFILE_WARMUP,
    STRATEGIES,
    TRAIN_MODELS,
    TrainConfig,
    TrainSummary,
    inductor_problem,
    launcher_problem,
    launcher_world_size,
    resume_problem,
    run_training,
    world_problem,
)

__all__ = ["main", "build_parser", "config_from_args"]


def _reshard(text: str) -> bool | int | None:
    """auto (None: the engine's default), true/yes or false/no: reshard or not; an integer
    >= 2: reshard to groups of that many ranks. 0 and 1 are refused: as booleans and as group
    sizes they would mean different things."""
    lowered = text.strip().lower()
    if lowered == "auto":
        return None
    if lowered in ("true", "yes"):
        return True
    if lowered in ("false", "no"):
        return False
    try:
        value = int(lowered)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be auto, true, false (or yes, no) or a group size >= 2, got {text!r}"
        ) from None
    if value in (0, 1):
        raise argparse.ArgumentTypeError(
            f"{value} is ambiguous: write true or false to turn resharding on or off; an "
            f"integer is a group size of ranks and must be >= 2, got {text!r}"
        )
    if value < 2:
        raise argparse.ArgumentTypeError(f"a group size must be >= 2, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fsdp train",
        description="Train a GPT or Llama with FSDP "
        "(and optionally tensor parallelism) on local ranks (2 "
        "processes over gloo by default), under torchrun or Slurm. "
        "Default data: Python's standard library sources.",
        formatter_class=CliHelpFormatter,
    )
    a = p.add_argument
    a(
        "--model",
        choices=sorted(TRAIN_MODELS),
        default="small",
        help="model: a GPT size, or a Llama size (llama-*: RMSNorm, rotary positions, SwiGLU)",
    )
    a("--world-size", type=int, default=2, help="local ranks to start (ignored under torchrun)")
    a(
        "--backend",
        choices=available_backends(),
        default="torch",
        help="communication backend: torch (gloo on CPU, NCCL on GPU), cupy-nccl, threads (ranks "
        "as threads of one process)",
    )
    a(
        "--strategy",
        choices=STRATEGIES,
        default="full_shard",
        help="full_shard: parameters, gradients and optimizer state sharded; shard_grad_op: "
        "parameters kept gathered between forward and backward; no_shard: replicated (DDP); "
        "hybrid_shard: sharded within groups of --shard-size ranks, replicated across them",
    )
    a("--shard-size", type=int, help="hybrid_shard: ranks per shard group")
    a(
        "--fault-tolerant",
        action="store_true",
        help="hybrid_shard across hosts that survives losing one: each host one replica group "
        "under its own torchrun, meeting at FSDP_FT_STORE (FSDP_FT_REPLICA, FSDP_FT_REPLICAS); "
        "see docs/fault-tolerance.md",
    )
    a(
        "--tp",
        type=int,
        default=1,
        metavar="N",
        help="tensor parallelism: groups of N consecutive ranks cut every block (heads and MLP "
        "units) and the embeddings and head; FSDP shards over the world size / N "
        "data-parallel ranks, where --strategy, --shard-size and --global-batch apply "
        "(default 1: none; needs --backend torch)",
    )
    a(
        "--no-sequence-parallel",
        action="store_true",
        help="with --tp: keep activations between blocks whole on every tp rank (all-reduces) "
        "instead of cut along the sequence (all-gathers and reduce-scatters)",
    )
    a(
        "--reshard-after-forward",
        type=_reshard,
        default=None,
        metavar="auto|true|false|N",
        help="free gathered parameters after forward (true) or keep them (false); auto (the "
        "default) frees every block but the last, whose backward comes first; an integer "
        "N >= 2 reshards to groups of N ranks (must divide the shard group)",
    )
    a("--param-dtype", choices=["bf16", "fp16", "fp32"], help="mixed precision compute dtype")
    a("--reduce-dtype", choices=["bf16", "fp16", "fp32"], help="gradient reduction dtype")
    a("--no-prefetch", action="store_true", help="disable forward and backward prefetch")
    a("--grad-accum", type=int, default=1, help="micro-batches per step (no sync between)")
    a("--clip", type=float, default=1.0, help="max global gradient norm (0: off)")
    a(
        "--activation-checkpointing",
        action="store_true",
        help="recompute each block's activations in backward instead of keeping them",
    )
    a(
        "--compile",
        nargs="?",
        const="inductor",
        choices=COMPILE_BACKENDS,
        metavar="BACKEND",
        help="torch.compile each block before sharding it, with this backend: "
        f"{', '.join(COMPILE_BACKENDS)} (default off; a bare --compile: inductor, which on "
        "CPU needs a C++ compiler)",
    )
    a(
        "--cpu-offload",
        action="store_true",
        help="keep sharded parameters, gradients and optimizer state in host memory",
    )
    a("--meta-init", action="store_true", help="build on meta, materialise unit by unit")
    a(
        "--steps",
        type=int,
        default=60,
        help="total steps (with --resume: counted from 0, so greater than the checkpoint's step)",
    )
    a("--global-batch", type=int, default=8, help="sequences per step, all ranks together")
    a("--lr", type=float, default=3e-3, help="AdamW learning rate")
    a("--seed", type=int, default=0, help="seed of the initial weights and the batch order")
    a("--data", help="a text file or directory (default: the standard library sources)")
    a("--save", metavar="DIR", help="checkpoint directory (written at the end)")
    a(
        "--save-every",
        type=int,
        default=0,
        metavar="N",
        help="also save every N steps (0: only at the end)",
    )
    a(
        "--resume",
        metavar="DIR",
        help="continue from this checkpoint (the same DIR as --save holding nothing yet: start "
        "at step 0, so one command line serves a job that a launcher restarts)",
    )
    a(
        "--metrics",
        metavar="PATH",
        help="append one record per step: JSON lines, or CSV when "
        "PATH ends in .csv (keys: docs/guide.md, Logs and metrics)",
    )
    a("--plot", metavar="PNG", help="draw loss and memory over steps (needs matplotlib)")
    a(
        "--no-progress",
        action="store_true",
        help="neither the progress bar nor the plain progress lines (the summary is still printed)",
    )
    a("--threads-per-rank", type=int, help="torch threads per rank (>= 1; default: cores / ranks)")
    a(
        "--host-mmap-threshold",
        type=size_arg("--host-mmap-threshold", allow_zero=True),
        default=0,
        metavar="SIZE",
        help="fix glibc's mmap threshold per rank, in bytes or with a unit (128K, 1M; at most "
        "32M): less host memory, slower steps (default 0: glibc's own; the engine trims the "
        "heap instead)",
    )
    a(
        "--hf-config",
        metavar="SPEC",
        help="a transformers model instead of --model: a config.json "
        "path or MODEL_TYPE[:key=value,...], e.g. gpt2:n_layer=4,n_embd=256,n_head=4 (random "
        "weights, nothing downloaded; needs fsdp[hf])",
    )
    a(
        "--hf-pretrained",
        metavar="DIR",
        help="a transformers model and its weights from a "
        "save_pretrained directory (config.json, safetensors, a tokenizer), each rank reading only "
        "its shards; the text is tokenised with DIR's tokenizer (needs fsdp[hf])",
    )
    a("--seq-len", type=int, help="tokens per sequence (default: the model's; 128 for --hf-config)")
    a("--json", action="store_true", help="also print the summary as one JSON line")
    _add_metrics_options(p)
    add_config_options(p)
    return p


def _add_metrics_options(p: argparse.ArgumentParser) -> None:
    """Options of the run's metrics and progress lines (see fsdp.train._metrics, _progress)."""
    a = p.add_argument
    a(
        "--tensorboard",
        metavar="DIR",
        help="also write TensorBoard scalars (loss, lr, grad_norm, "
        "step time, tokens/s, MFU, memory) to DIR (needs pip install 'fsdp[tb]')",
    )
    a(
        "--peak-tflops",
        type=float,
        metavar="X",
        help="peak TFLOP/s of one device, for MFU "
        "(default: known for H200, H100, A100, L40S and L4 GPUs; none on CPU)",
    )
    a(
        "--log-every",
        type=int,
        default=10,
        metavar="N",
        help="when stdout is not a terminal "
        "(Slurm, tee, a pipe): one plain progress line every N steps instead of a progress bar",
    )
    a(
        "--profile",
        metavar="DIR",
        help="profile a few steps after warm-up: a Chrome/Perfetto "
        "trace per rank (DIR/rank<R>.trace.json: torch's events plus all-gather, reduce-scatter, "
        "host-copy and compute lanes), a step-timeline summary printed at the end and its "
        "figures in --metrics",
    )
    a(
        "--profile-steps",
        type=int,
        default=3,
        metavar="N",
        help=f"steps --profile records, after up to {PROFILE_WARMUP} warm-up steps",
    )


def _check_metrics_options(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Set up logging (FSDP_LOG_LEVEL, default WARNING), then check the metrics options."""
    from fsdp_comm import configure_logging

    try:
        configure_logging()
    except ValueError as exc:
        p.error(str(exc))
    if args.peak_tflops is not None and not (
        math.isfinite(args.peak_tflops) and args.peak_tflops > 0
    ):
        p.error(
            f"--peak-tflops must be a finite number > 0 (TFLOP/s per device), got "
            f"{args.peak_tflops}"
        )
    if args.log_every < 1:
        p.error(f"--log-every must be >= 1, got {args.log_every}")
    if args.profile_steps < 1:
        p.error(f"--profile-steps must be >= 1, got {args.profile_steps}")
    if args.profile and Path(args.profile).exists() and not Path(args.profile).is_dir():
        p.error(f"--profile must be a directory, but {args.profile} is an existing file")
    if args.plot and args.metrics and args.metrics.lower().endswith(".csv"):
        p.error(
            f"--plot reads JSON-lines metrics, but --metrics {args.metrics} is a CSV file: "
            "give --metrics a .jsonl path or leave it out"
        )
    problem = metrics_problem(args.metrics, args.tensorboard, profile=bool(args.profile))
    if problem is not None:
        p.error(problem)


def _check_counts(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.world_size < 1:
        p.error(f"--world-size must be >= 1, got {args.world_size}")
    for name in ("steps", "global_batch", "grad_accum"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.save_every < 0:
        p.error(f"--save-every must be >= 0 (0: only at the end), got {args.save_every}")
    if args.threads_per_rank is not None and args.threads_per_rank < 1:
        p.error(f"--threads-per-rank must be >= 1, got {args.threads_per_rank}")
    if args.seq_len is not None and args.seq_len < 1:
        p.error(f"--seq-len must be >= 1, got {args.seq_len}")
    if not 0 <= args.host_mmap_threshold <= 32 * 2**20:
        p.error(
            f"--host-mmap-threshold must be 0 (glibc's own) or at most 32M (33554432 "
            f"bytes), got {args.host_mmap_threshold}"
        )


def _check_floats(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if not (math.isfinite(args.lr) and args.lr > 0):
        p.error(f"--lr must be a finite number > 0, got {args.lr}")
    if not (math.isfinite(args.clip) and args.clip >= 0):
        p.error(f"--clip must be a finite number >= 0 (0: no clipping), got {args.clip}")


def _world(p: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[int, str]:
    """The world size the ranks will have, and how a message names it: torchrun's or Slurm's
    (--world-size is ignored there), else --world-size."""
    found = launcher_world_size()
    if found is None:
        return args.world_size, f"--world-size {args.world_size}"
    name, text = found
    try:
        size = int(text)
    except ValueError:
        size = 0
    if size < 1:
        p.error(f"{name} (set by torchrun or Slurm) must be an integer >= 1, got {text!r}")
    return size, f"the launcher's world size {size} ({name}; --world-size is ignored there)"


def _check_sharding(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if getattr(args, "fault_tolerant", False):  # issue #31
        from ._fault_tolerant import fault_tolerant_problem

        problem = fault_tolerant_problem(args.strategy, args.tp, args.shard_size)
        if problem is not None:
            p.error(problem)
        return
    if args.shard_size is None:
        return
    if args.strategy != "hybrid_shard":
        p.error(
            f"--shard-size applies only to --strategy hybrid_shard, got --strategy "
            f"{args.strategy} with --shard-size {args.shard_size}"
        )
    if args.shard_size < 1:
        p.error(f"--shard-size must be >= 1, got {args.shard_size}")


def _check_tp(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.tp < 1:
        p.error(f"--tp must be >= 1 (ranks per tensor-parallel group), got {args.tp}")
    if args.no_sequence_parallel and args.tp == 1:
        p.error(
            "--no-sequence-parallel applies with --tp N >= 2 only (sequence parallelism "
            "is part of tensor parallelism), got --tp 1"
        )


def _check_paths(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.data and not Path(args.data).exists():
        p.error(f"--data: no such file or directory: {args.data}")
    if args.save_every and not args.save:
        p.error(f"--save-every {args.save_every} needs --save DIR (where to save)")
    if args.save and Path(args.save).exists() and not Path(args.save).is_dir():
        p.error(f"--save must be a directory, but {args.save} is an existing file")
    if (
        args.save
        and (Path(args.save) / "CURRENT").exists()
        and not _same_dir(args.resume, args.save)
    ):
        p.error(
            f"--save {args.save} already holds a checkpoint, which this run would replace "
            f"(keep_last deletes it): pass --resume {args.save} to continue it, or save "
            "to another directory"
        )
    if args.plot:
        _check_output_file(p, "--plot", args.plot)
        if importlib.util.find_spec("matplotlib") is None:
            p.error("--plot needs matplotlib: pip install matplotlib")
    if args.metrics:
        _check_output_file(p, "--metrics", args.metrics)


def _same_dir(a: str | None, b: str) -> bool:
    return a is not None and Path(a).resolve() == Path(b).resolve()


def _check_output_file(p: argparse.ArgumentParser, flag: str, path: str) -> None:
    target = Path(path)
    if target.is_dir():
        p.error(f"{flag} must be a file, but {path} is a directory")
    if not target.parent.is_dir():
        p.error(f"{flag}: the directory of {path} does not exist ({target.parent})")


def _checkpoint_extra(p: argparse.ArgumentParser, path: str) -> dict[str, object]:
    """What the committed checkpoint at ``path`` records besides tensors (its step, model)."""
    import fsdp_ckpt

    if not Path(path).exists():
        p.error(f"--resume: no checkpoint at {path}")
    try:
        extra = fsdp_ckpt.inspect_checkpoint(path).index.extra
    except fsdp_ckpt.CheckpointError as exc:
        p.error(f"--resume: {exc}")
    return extra if isinstance(extra, dict) else {}


def _check_resume(p: argparse.ArgumentParser, args: argparse.Namespace, cfg: TrainConfig) -> None:
    if not args.resume:
        return
    extra = _checkpoint_extra(p, args.resume)
    step = extra.get("step", 0)
    problem = resume_problem(
        step if isinstance(step, int) else 0, args.steps, args.resume
    ) or resume_tp_problem(cfg, extra)
    if problem is not None:
        p.error(problem)


def _max_seq_len(p: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[int | None, str]:
    """The model's longest sequence and what holds it (its positional table)."""
    if args.hf_pretrained:
        if args.hf_config:
            p.error("--hf-config and --hf-pretrained both name the model: give one")
        from ..hf import check_hf_pretrained

        try:
            return (
                check_hf_pretrained(args.hf_pretrained),
                f"--hf-pretrained {args.hf_pretrained}",
            )
        except ValueError as exc:
            p.error(str(exc))
    if not args.hf_config:
        return TRAIN_MODELS[args.model].seq_len, f"--model {args.model}"
    from ..hf import check_hf_spec

    try:
        return check_hf_spec(args.hf_config), f"--hf-config {args.hf_config}"
    except ValueError as exc:
        p.error(str(exc))


def _check_model(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    longest, model = _max_seq_len(p, args)
    if args.seq_len is not None and longest is not None and args.seq_len > longest:
        p.error(
            f"--seq-len must be at most {longest}, the maximum sequence length of {model} "
            f"(its positional table), got {args.seq_len}"
        )


def _check_compile(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.compile == "inductor":
        problem = inductor_problem()
        if problem is not None:
            p.error(f"--compile inductor: {problem} (--compile aot_eager needs no compiler)")


def _config(args: argparse.Namespace, world_size: int) -> TrainConfig:
    return TrainConfig(
        model=args.model,
        world_size=world_size,
        backend=args.backend,
        strategy=args.strategy,
        shard_size=args.shard_size,
        reshard_after_forward=args.reshard_after_forward,
        param_dtype=args.param_dtype,
        reduce_dtype=args.reduce_dtype,
        prefetch=not args.no_prefetch,
        grad_accum=args.grad_accum,
        clip=args.clip or None,
        activation_checkpointing=args.activation_checkpointing,
        cpu_offload=args.cpu_offload,
        meta_init=args.meta_init,
        steps=args.steps,
        global_batch=args.global_batch,
        lr=args.lr,
        seed=args.seed,
        data=args.data,
        save=args.save,
        save_every=args.save_every,
        resume=args.resume,
        metrics=args.metrics,
        threads_per_rank=args.threads_per_rank,
        progress=not args.no_progress,
        hf_config=args.hf_config,
        seq_len=args.seq_len,
        hf_pretrained=args.hf_pretrained,
        host_mmap_threshold=args.host_mmap_threshold,
        compile=args.compile,
        tensorboard=args.tensorboard,
        peak_tflops=args.peak_tflops,
        log_every=args.log_every,
        profile=args.profile,
        profile_steps=args.profile_steps,
        tp=args.tp,
        sequence_parallel=not args.no_sequence_parallel,
        fault_tolerant=getattr(args, "fault_tolerant", False),
    )


def _start_fresh_if_nothing_saved_yet(args: argparse.Namespace) -> None:
    """``--resume DIR --save DIR`` with no checkpoint in DIR yet starts at step 0: one command
    line then serves the first start and every restart of a job a launcher restarts
    (``torchrun --max-restarts``). A --resume elsewhere that holds nothing is still an error
    (a mistyped path must not silently train from scratch), and so is a URL, which this
    check cannot look into."""
    resume, save = args.resume, args.save
    if not resume or not save or "://" in resume or not _same_dir(resume, save):
        return
    if (Path(resume) / "CURRENT").exists():
        return
    if os.environ.get("RANK", "0") == "0":
        print(
            f"fsdp train: {resume} holds no checkpoint yet: starting at step 0 (--resume is "
            "also --save: a restart will continue from its last save)",
            file=sys.stderr,
        )
    args.resume = None


def config_from_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> TrainConfig:
    """Check every flag (calling ``p.error``, which exits, on the first bad one) before any
    rank starts, sizes against the world the ranks will have; return the configuration."""
    _check_metrics_options(p, args)
    _check_counts(p, args)
    _check_floats(p, args)
    _check_sharding(p, args)
    _check_tp(p, args)
    world_size, world = _world(p, args)
    _start_fresh_if_nothing_saved_yet(args)
    if args.metrics is None and args.plot:
        args.metrics = str(Path(args.plot).with_suffix(".jsonl"))
    cfg = _config(args, world_size)
    problem = world_problem(cfg, world_size, world) or launcher_problem()
    if problem is not None:
        p.error(problem)
    _check_paths(p, args)
    _check_resume(p, args, cfg)
    _check_model(p, args)
    _check_compile(p, args)
    return cfg


def print_summary(cfg: TrainConfig, s: TrainSummary) -> None:
    first = s.losses[0] if s.losses else float("nan")
    last = s.losses[-1] if s.losses else float("nan")
    name = cfg.hf_config or cfg.hf_pretrained or cfg.model
    tp = ""
    if cfg.tp > 1:
        sp = "sequence parallel" if cfg.sequence_parallel else "no sequence parallelism"
        tp = f" (tp {cfg.tp} x dp {cfg.dp_size}, {sp})"
    print(
        f"model {name} ({s.params / 1e6:.1f} M parameters), {cfg.strategy}, "
        f"{cfg.world_size} ranks{tp} over {cfg.backend}"
    )
    print(
        f"steps {s.start_step}->{s.steps}: loss {first:.4f} -> {last:.4f}, "
        f"{s.tokens_per_s:,.0f} tokens/s, peak RSS per rank (MiB) {s.peak_rss_mib}"
    )
    print(performance_line(s))
    if s.timeline is not None:
        print(f"rank 0's {s.timeline.format()}")
        print(f"traces: {cfg.profile}/rank<R>.trace.json (chrome://tracing, ui.perfetto.dev)")
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
        ax2.plot(
            [r["step"] for r in rows], [r["peak_rss_mib"][rank] for r in rows], label=f"rank {rank}"
        )
    ax2.set_ylabel("peak RSS (MiB)")
    ax2.set_xlabel("step")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(png)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parse_args_with_config(parser, argv)
    # (as given, before the checks fill in derived values such as --metrics for --plot)
    effective = config_toml(parser, args) if args.print_config else ""
    cfg = config_from_args(parser, args)
    if args.print_config:
        print(effective, end="")
        return 0
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
