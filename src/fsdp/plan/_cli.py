"""``fsdp plan``: print the per-GPU memory and per-step communication a configuration needs.

    fsdp plan --model llama3-70b --gpus 64 --gpus-per-node 8 --strategy hybrid_shard \\
        --param-dtype bf16 --seq-len 4096 --gpu-memory 80GB --host-memory 1TiB
    fsdp plan --hf-config path/to/model --gpus 8 --gpu-memory 80GB
    fsdp plan --params 7e9 --layers 32 --d-model 4096 --gpus 64
    fsdp plan --model llama3-70b --gpus 64 --tp 8 --param-dtype bf16 --seq-len 4096

The figures come from `fsdp.plan._plan` (the FSDP paper's formulas, Sections 3.2.1 and 3.2.2).
Sizes (``--gpu-memory``, ``--host-memory``) follow every size flag's rule
(`fsdp_comm.parse_size`: K, M, G, T as powers of 1024; a bare number is GiB here).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from fsdp_comm import CliHelpFormatter, size_arg

from ..models import MODEL_SIZES
from ._plan import PRESETS, STRATEGIES, ModelShape, Plan, PlanError, format_bytes, parse_count, plan

__all__ = ["main", "build_parser", "render"]

#: Keyword of `plan` -> the option that sets it, for error messages.
_OPTION = {
    "model": "--model",
    "params": "--params",
    "layers": "--layers",
    "d_model": "--d-model",
    "vocab_size": "--vocab",
    "largest_unit": "--largest-unit",
    "gpus": "--gpus",
    "gpus_per_node": "--gpus-per-node",
    "strategy": "--strategy",
    "shard_size": "--shard-size",
    "param_dtype": "--param-dtype",
    "reduce_dtype": "--reduce-dtype",
    "master_dtype": "--master-dtype",
    "optimizer_bytes_per_param": "--optimizer-bytes",
    "micro_batch": "--micro-batch",
    "seq_len": "--seq-len",
    "gpu_memory": "--gpu-memory",
    "host_memory": "--host-memory",
    "hf_config": "--hf-config",
    "tp": "--tp",
}


def _count(text: str) -> int:
    try:
        return parse_count(text)
    except PlanError as exc:
        raise argparse.ArgumentTypeError(exc.message) from None


def _strategy(text: str) -> str:
    name = text.lower().replace("-", "_")
    if name not in STRATEGIES:
        raise argparse.ArgumentTypeError(
            f"unknown strategy {text!r}; choose from {', '.join(STRATEGIES)}"
        )
    return name


def build_parser() -> argparse.ArgumentParser:
    """The options of ``fsdp plan``."""
    p = argparse.ArgumentParser(
        prog="fsdp plan",
        formatter_class=CliHelpFormatter,
        description="Predict per-GPU memory and communication per step of FSDP training (the "
        "FSDP paper's formulas, Sections 3.2.1-3.2.2).",
    )
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument(
        "--model",
        metavar="NAME",
        help="a size of fsdp train "
        f"({', '.join(MODEL_SIZES)}) or a known model ({', '.join(PRESETS)})",
    )
    which.add_argument(
        "--hf-config",
        metavar="PATH",
        help="a Hugging Face config.json, or a "
        "model directory holding one (model_type llama, mistral, qwen2, gpt2)",
    )
    which.add_argument(
        "--params",
        type=_count,
        metavar="N",
        help="parameter count: 7e9, 70B "
        "(alone: a known model's shape within 10%%, else a guessed one)",
    )
    a = p.add_argument
    a("--layers", type=int, help="with --params: transformer blocks (one FSDP unit each)")
    a("--d-model", type=int, help="with --params: hidden size")
    a("--vocab", type=int, help="with --params: vocabulary (default 32000)")
    a(
        "--largest-unit",
        type=_count,
        metavar="N",
        help="with --params: parameters of the largest unit, when units are not all alike",
    )
    a("--gpus", type=int, required=True, metavar="W", help="GPUs in all (world size)")
    a("--gpus-per-node", type=int, default=8, metavar="G", help="GPUs per node (default 8)")
    a("--strategy", type=_strategy, default="full_shard", help=" | ".join(STRATEGIES))
    a("--shard-size", type=int, help="hybrid_shard: GPUs per shard group (default: a node)")
    a(
        "--tp",
        type=int,
        default=1,
        metavar="N",
        help="tensor parallelism over groups of N "
        "consecutive GPUs (heads, MLP units, vocabulary cut N ways); FSDP shards over the "
        "gpus / N data-parallel ranks (default 1: none)",
    )
    a(
        "--no-sequence-parallel",
        action="store_true",
        help="with --tp: activations between "
        "blocks whole on every tp rank (all-reduces) instead of cut along the sequence",
    )
    a("--param-dtype", default="fp32", help="gather and compute dtype (bf16, fp16, fp32)")
    a("--reduce-dtype", help="gradient reduction dtype (default: --param-dtype)")
    a("--master-dtype", default="fp32", help="dtype of shards and optimizer step (fp32)")
    a(
        "--optimizer-bytes",
        type=float,
        default=8.0,
        metavar="B",
        help="optimizer state bytes per parameter (AdamW in fp32: 8)",
    )
    a("--micro-batch", type=int, default=1, help="sequences per GPU per step (activations)")
    a("--seq-len", type=int, help="tokens per sequence (default: the model's, or 2048)")
    a("--activation-checkpointing", action="store_true", help="recompute blocks in backward")
    a("--cpu-offload", action="store_true", help="keep shards and optimizer state on the host")
    a(
        "--gpu-memory",
        type=size_arg("--gpu-memory", default_unit="g"),
        metavar="SIZE",
        help="memory per GPU (80, 80GB, 40GiB; a bare number is GiB): recommend what fits",
    )
    a(
        "--host-memory",
        type=size_arg("--host-memory", default_unit="g"),
        metavar="SIZE",
        help="host memory per node, for CPU offload (default: this machine's)",
    )
    a("--json", action="store_true", help="print the plan as JSON")
    return p


def _size(value: int | None) -> str | None:
    """A size argparse has read (bytes), as `plan` reads it back exactly."""
    return None if value is None else f"{value}B"


def _model(args: argparse.Namespace) -> object:
    if args.hf_config is not None:
        return ModelShape.from_hf_config(args.hf_config)
    return args.model if args.params is None else args.params


def _make_plan(p: argparse.ArgumentParser, args: argparse.Namespace) -> Plan:
    try:
        return plan(
            _model(args),
            gpus=args.gpus,
            gpus_per_node=args.gpus_per_node,
            strategy=args.strategy,
            shard_size=args.shard_size,
            param_dtype=args.param_dtype,
            reduce_dtype=args.reduce_dtype,
            master_dtype=args.master_dtype,
            optimizer_bytes_per_param=args.optimizer_bytes,
            micro_batch=args.micro_batch,
            seq_len=args.seq_len,
            activation_checkpointing=args.activation_checkpointing,
            cpu_offload=args.cpu_offload,
            gpu_memory=_size(args.gpu_memory),
            host_memory=_size(args.host_memory),
            layers=args.layers,
            d_model=args.d_model,
            vocab_size=args.vocab,
            largest_unit=args.largest_unit,
            tp=args.tp,
            sequence_parallel=not args.no_sequence_parallel,
        )
    except PlanError as exc:
        option = _OPTION.get(exc.argument, exc.argument)
        if exc.argument == "params" and args.params is None:
            option = "--model"
        p.error(f"argument {option}: {exc.message}")
    raise AssertionError("unreachable")


def _header(pl: Plan) -> list[str]:
    m, c = pl.model, pl.config
    units = (
        f"{m.n_layers} blocks of {_count_text(m.block_numel)} + root {_count_text(m.root_numel)}"
    )
    if m.largest_unit:
        units += f", largest unit {_count_text(m.largest_unit)}"
    shard = f"shard group F={pl.shard_group}" + (
        f" x {pl.replicas} replicas" if pl.replicas > 1 else ""
    )
    if c.tp > 1:
        sp = "sequence parallel" if c.sequence_parallel else "no sequence parallelism"
        shard += f"; tensor parallel tp={c.tp} ({sp}) x dp={c.dp} (psi: a unit's tp pieces per GPU)"
    reduce = c.grad_dtype
    tokens = f"{c.micro_batch} x {c.seq_len or m.seq_len} tokens"
    lines = [
        f"model      {m.name}: {_count_text(m.total_params)} parameters ({units}; "
        f"d_model {m.d_model}, vocab {m.vocab_size})"
    ]
    if m.architecture is not None:
        lines.append(f"shape      {m.architecture.describe()}")
    if m.note:
        lines.append(f"note       {m.note}")
    return lines + [
        f"cluster    {c.gpus} GPU{'s' if c.gpus > 1 else ''} = {c.nodes} "
        f"node{'s' if c.nodes > 1 else ''} x "
        f"{min(c.gpus, c.gpus_per_node)} GPU{'s' if min(c.gpus, c.gpus_per_node) > 1 else ''}; "
        f"{c.strategy}, {shard}",
        f"precision  gather {c.param_dtype}, reduce {reduce}, master {c.master_dtype}; "
        f"optimizer {c.optimizer_bytes_per_param:g} B/param; micro-batch {tokens}"
        + ("; activation checkpointing" if c.activation_checkpointing else "")
        + ("; CPU offload" if c.cpu_offload else ""),
    ]


def _count_text(n: int) -> str:
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= scale:
            return f"{n / scale:.2f}{suffix}"
    return str(n)


def _memory_rows(pl: Plan) -> list[tuple[str, str, int]]:
    mem, c = pl.memory, pl.config
    held = "host (offload)" if c.cpu_offload else f"sum(psi)/F {c.master_dtype}"
    unsharded = "sum(psi)" if c.strategy == "shard_grad_op" else "root + 2 x max(psi)"
    acts = "block inputs + 1 block" if c.activation_checkpointing else "all blocks"
    return [
        ("sharded parameters", held, mem.sharded_params),
        ("sharded gradients", held, mem.gradients),
        ("optimizer state", f"{c.optimizer_bytes_per_param:g} B x Psi/F", mem.optimizer_state),
        ("unsharded parameters", f"{unsharded} {c.param_dtype}", mem.unsharded_params),
        ("collective buffers", "shard-sized", mem.comm_buffers),
        ("unsharded gradients", f"root + 2 x max(psi) {c.grad_dtype}", mem.unsharded_grads),
        ("activations (estimate)", acts, mem.activations),
    ]


def _unit(largest: int) -> tuple[str, int]:
    """GiB for real models, MiB for the small ones (so the table shows digits)."""
    return ("GiB", 2**30) if largest >= 2**30 else ("MiB", 2**20)


def _memory_table(pl: Plan) -> list[str]:
    unit, scale = _unit(pl.memory.total)
    lines = ["", f"{'memory per GPU':<26}{'formula':<30}{unit:>10}"]
    for name, formula, value in _memory_rows(pl):
        lines.append(f"  {name:<24}{formula:<30}{value / scale:>10.2f}")
    lines.append(f"  {'total':<24}{'':<30}{pl.memory.total / scale:>10.2f}")
    if pl.memory.host:
        lines.append(f"  {'in host memory':<24}{'per GPU':<30}{pl.memory.host / scale:>10.2f}")
    if pl.host_memory is not None:
        whose = (
            ""
            if pl.config.cpu_offload
            else " (recommended CPU offload)"
            if pl.recommendation.fits
            else " (CPU offload considered)"
        )
        lines.append(f"host memory per node{whose}: {pl.host_memory.text()}")
    return lines


def _comm_table(pl: Plan) -> list[str]:
    comm = pl.comm
    unit, scale = _unit(comm.total_bytes)
    lines = [
        "",
        f"{'communication per step':<26}{'calls':>6}{'group':>7}{unit + '/GPU':>11}  where",
    ]
    for c in comm.collectives:
        where = "cross-node" if c.cross_node else "intra-node"
        lines.append(
            f"  {c.name:<24}{c.calls:>6}{c.group_size:>7}{c.sent_bytes / scale:>11.2f}  {where}"
        )
    if not comm.collectives:
        lines.append("  (none)")
    lines.append(
        f"  {'total':<24}{'':>13}{comm.total_bytes / scale:>11.2f}  "
        f"intra-node {format_bytes(comm.intra_node_bytes)}, "
        f"cross-node {format_bytes(comm.cross_node_bytes)}"
    )
    if pl.config.tp > 1:
        dims = [
            f"{dim} {format_bytes(comm.dim_bytes(dim))}"
            for dim in ("shard", "replicate", "tp")
            if comm.dim_bytes(dim)
        ]
        lines.append(f"  {'by mesh dimension':<24}{'':>24}  {', '.join(dims)}")
    return lines


def render(pl: Plan) -> str:
    """The readable table ``fsdp plan`` prints."""
    lines = _header(pl) + _memory_table(pl) + _comm_table(pl)
    lines += ["", f"recommendation: {pl.recommendation.text}"]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``fsdp plan`` with ``argv`` (the options after ``plan``); bad options exit with
    status 2 and a message naming the option, as argparse does."""
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in ("layers", "d_model", "vocab", "largest_unit"):  # with --params only
        if args.params is None and getattr(args, name) is not None:
            parser.error(f"argument --{name.replace('_', '-')}: applies with --params only")
    if args.no_sequence_parallel and args.tp == 1:
        parser.error("argument --no-sequence-parallel: applies with --tp N >= 2 only, got --tp 1")
    result = _make_plan(parser, args)
    print(json.dumps(result.to_dict(), indent=2) if args.json else render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
