"""The ``fsdp`` command."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


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
        "(same as python -m fsdp_comm.bench; --help for its options)",
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


def _versions() -> str:
    """Every package, torch with its CUDA and NCCL, and the backends usable here."""
    import fsdp_ckpt
    import fsdp_comm
    import fsdp_engine
    import fsdp_memory
    import torch

    import fsdp

    nccl = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None
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
    if args.command == "comm-bench":
        from fsdp_comm import bench

        return bench.main(rest, prog="fsdp comm-bench")
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
