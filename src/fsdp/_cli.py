"""The ``fsdp`` command."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fsdp", description=__doc__)
    parser.add_argument(
        "--version",
        action="store_true",
        help="print the versions of every package, torch, CUDA and NCCL, and "
        "the backends known, then exit",
    )
    sub = parser.add_subparsers(
        dest="command", metavar="COMMAND", help="what to do (fsdp COMMAND --help for its options)"
    )
    # Options of delegated sub-commands are parsed by the command itself (see main).
    sub.add_parser(
        "comm-bench",
        help="bus-bandwidth sweep of the collectives "
        "(same as python -m fsdp_comm.bench, plus --record; --help for its options)",
        add_help=False,
    )
    sub.add_parser(
        "ckpt-bench",
        help="checkpoint save and load against torch DCP "
        "(same as python -m fsdp_ckpt.bench, plus --record; --help for its options)",
        add_help=False,
    )
    sub.add_parser("train", help="train a GPT with FSDP (--help for options)", add_help=False)
    sub.add_parser(
        "plan", help="predict per-GPU memory and traffic (--help for options)", add_help=False
    )
    sub.add_parser(
        "ckpt", help="inspect, verify or export a checkpoint (--help for options)", add_help=False
    )
    sub.add_parser(
        "export-hf",
        help="write a checkpoint as a Hugging Face save_pretrained directory (--help for options)",
        add_help=False,
    )
    sub.add_parser(
        "compare",
        help="training step against torch FSDP2/FSDP1/DDP "
        "(same as python -m fsdp.bench.engines; --help for its options)",
        add_help=False,
    )
    return parser


def _comm_bench_figures(rows: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    return {}, {"results": rows}  # its --out: one object per collective and size


def _ckpt_bench_figures(doc: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    return doc["config"], doc["result"]  # its --out: {"config": ..., "result": ...}


def bench_parser(command: str) -> argparse.ArgumentParser:
    """The parser of ``fsdp comm-bench`` or ``fsdp ckpt-bench``: the package's own, plus
    ``--record`` (for the command reference)."""
    from fsdp.bench._record import add_record_argument

    if command == "comm-bench":
        from fsdp_comm import bench as comm_bench

        parser = comm_bench._parser("fsdp comm-bench")
    elif command == "ckpt-bench":
        from fsdp_ckpt import bench as ckpt_bench

        parser = ckpt_bench._parser("fsdp ckpt-bench")
    else:
        raise ValueError(f"command must be 'comm-bench' or 'ckpt-bench', got {command!r}")
    add_record_argument(parser)
    return parser


def _versions() -> str:
    """Every package, torch with its CUDA and NCCL, and the backends usable here."""
    import fsdp_ckpt
    import fsdp_comm
    import fsdp_engine
    import fsdp_memory
    import torch

    import fsdp

    nccl = (
        ".".join(map(str, torch.cuda.nccl.version()))  # type: ignore[no-untyped-call]  # unannotated in torch
        if torch.cuda.is_available()
        else None
    )
    lines = [
        f"fsdp {fsdp.__version__}",
        *(
            f"{m.__name__.replace('_', '-')} {m.__version__}"
            for m in (fsdp_comm, fsdp_memory, fsdp_engine, fsdp_ckpt)
        ),
        f"torch {torch.__version__} (CUDA {torch.version.cuda or 'none'}, NCCL "
        f"{nccl or 'none'}, GPUs {torch.cuda.device_count()})",
        f"backends known: {', '.join(fsdp_comm.available_backends())}",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = _build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.version:
        print(_versions())
        return 0
    if args.command in ("comm-bench", "ckpt-bench"):
        # the package's own command; --record is the umbrella's (the packages below it do
        # not import it), made from the JSON the command writes
        from fsdp_ckpt import bench as ckpt_bench
        from fsdp_comm import bench as comm_bench

        from fsdp.bench._record import run_recorded

        comm = args.command == "comm-bench"
        return run_recorded(
            comm_bench.main if comm else ckpt_bench.main,
            comm_bench._parser if comm else ckpt_bench._parser,
            _comm_bench_figures if comm else _ckpt_bench_figures,
            rest,
            prog=f"fsdp {args.command}",
            kind=args.command,
        )
    if args.command == "train":
        from fsdp.train._cli import main as train_main

        return train_main(rest)
    if args.command == "plan":
        from fsdp.plan._cli import main as plan_main

        return plan_main(rest)
    if args.command == "ckpt":
        from fsdp_ckpt.cli import main as ckpt_main

        return ckpt_main(rest, prog="fsdp ckpt")
    if args.command == "export-hf":
        from fsdp.hf._export_cli import main as export_hf_main

        return export_hf_main(rest)
    if args.command == "compare":
        from fsdp.bench import engines

        return engines.main(rest, prog="fsdp compare")
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    parser.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
