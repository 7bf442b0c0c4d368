"""``fsdp export-hf CKPT OUT``: a checkpoint as a Hugging Face ``save_pretrained`` directory.

    fsdp export-hf ckpt/run hf-out                       # config from the checkpoint
    fsdp export-hf ckpt/run hf-out --config config.json --max-shard-size 2GB --dtype bf16

Exit status: 0 written, 1 when the checkpoint is missing, damaged or does not match the config,
or a file cannot be written, 2 for usage errors (no config found, a bad size or dtype).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from fsdp_comm import CliHelpFormatter, size_arg

__all__ = ["main", "build_parser"]


def build_parser(prog: str = "fsdp export-hf") -> argparse.ArgumentParser:
    """The options of ``fsdp export-hf``."""
    p = argparse.ArgumentParser(
        prog=prog,
        formatter_class=CliHelpFormatter,
        description="Write the model of an fsdp checkpoint as a Hugging Face save_pretrained "
        "directory (config.json, safetensors files of at most --max-shard-size, and "
        "model.safetensors.index.json when there are several), for "
        "AutoModelForCausalLM.from_pretrained(OUT). Reads one tensor at a time.",
    )
    p.add_argument("checkpoint", metavar="CKPT", help="the checkpoint: the path it was saved to")
    p.add_argument("out", metavar="OUT", help="the output directory (created if needed)")
    p.add_argument(
        "--config",
        metavar="PATH",
        default=None,
        help="the model's config.json (or its directory); default: the config the "
        "checkpoint records (fsdp train --hf-config records it)",
    )
    p.add_argument(
        "--max-shard-size",
        metavar="SIZE",
        type=size_arg("--max-shard-size"),
        default=size_arg("--max-shard-size")("5GB"),
        help="the largest weight file: K, M, G, T are powers of 1024 (5GB = 5 "
        "GiB; Hugging Face's own '5GB' is 5*10^9 bytes). A tensor larger than "
        "this gets a file of its own, as in Hugging Face (default: 5GB)",
    )
    p.add_argument(
        "--dtype",
        choices=["bf16", "fp16", "fp32"],
        default=None,
        help="cast floating-point tensors (default: as saved)",
    )
    return p


def main(argv: Sequence[str] | None = None, prog: str = "fsdp export-hf") -> int:
    """Run ``fsdp export-hf`` with ``argv`` (the words after ``export-hf``); the exit status."""
    args = build_parser(prog).parse_args(argv)
    from fsdp_ckpt import CheckpointError

    from ._export import export_hf

    try:
        report = export_hf(
            args.checkpoint,
            args.out,
            config=args.config,
            max_shard_size=args.max_shard_size,
            dtype=args.dtype,
        )
    except ImportError as exc:
        print(f'{prog}: error: needs transformers ({exc}): pip install "fsdp[hf]"', file=sys.stderr)
        return 2
    except (CheckpointError, OSError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:
        status = (
            2
            if "no Hugging Face config" in str(exc)
            or str(exc).startswith(("config:", "dtype:", "max_shard_size"))
            else 1
        )
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return status
    print(
        f"wrote {report.out_dir}: {len(report.files)} weight file"
        f"{'s' if len(report.files) != 1 else ''}, {report.num_tensors} tensors, "
        f"{report.total_size} bytes"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
