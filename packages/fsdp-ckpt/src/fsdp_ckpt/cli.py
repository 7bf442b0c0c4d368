"""``fsdp ckpt inspect|verify|export|from-dcp``: checkpoints from the command line.

`main(argv)` takes the arguments after ``ckpt`` and returns an exit status: 0 on success,
1 when a checkpoint is missing, damaged or does not verify (the message names the file), 2 for
usage errors (argparse's convention).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from ._dcp import from_dcp, to_dcp
from ._errors import CheckpointError
from ._export import export
from ._inspect import CheckpointInfo, inspect_checkpoint, verify

__all__ = ["main", "build_parser"]


def build_parser(prog: str = "fsdp ckpt") -> argparse.ArgumentParser:
    """The argument parser of the ``ckpt`` commands."""
    parser = argparse.ArgumentParser(prog=prog, description="Inspect, verify and export "
                                     "fsdp-ckpt checkpoints.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("inspect", help="summarise a checkpoint from its index")
    p.add_argument("path")
    p.add_argument("--tensors", action="store_true", help="list every tensor")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p = sub.add_parser("verify", help="check every file's size and checksum")
    p.add_argument("path")
    p = sub.add_parser("export", help="write the model state as one file")
    p.add_argument("path")
    p.add_argument("out", help="output file (.safetensors, .pt) or directory for --format dcp")
    p.add_argument("--format", choices=["safetensors", "torch", "dcp"], default=None,
                   help="default: from the output's suffix")
    p = sub.add_parser("from-dcp", help="convert a torch.distributed.checkpoint directory")
    p.add_argument("dcp_dir")
    p.add_argument("path")
    return parser


def _summary(info: CheckpointInfo) -> dict[str, object]:
    return {"path": info.path, "directory": info.directory, "versions": list(info.versions),
            "world_size": info.world_size, "written_by": f"fsdp-ckpt {info.library_version}",
            "params": info.num_params, "param_elements": info.num_param_elements,
            "buffers": info.num_buffers, "optimizer": info.optimizer,
            "optimizer_states": list(info.optimizer_states), "extra": list(info.extra_keys),
            "files": len(info.files), "bytes": info.total_bytes}


def _print_info(info: CheckpointInfo, *, tensors: bool, as_json: bool) -> None:
    summary = _summary(info)
    listing = {name: {"shape": list(e.shape), "dtype": e.dtype, "pieces": len(e.chunks)}
               for name, e in info.index.entries().items()} if tensors else {}
    if as_json:
        print(json.dumps({**summary, **({"tensors": listing} if tensors else {})}, indent=1))
        return
    for key, value in summary.items():
        print(f"{key:>18}: {value}")
    for name, t in listing.items():
        print(f"  {name}  {t['dtype']}{t['shape']}  ({t['pieces']} pieces)")


def main(argv: Sequence[str] | None = None) -> int:
    """Run one ``ckpt`` command with ``argv`` (the words after ``ckpt``); the exit status."""
    args = build_parser().parse_args(argv)
    try:
        if args.command == "inspect":
            _print_info(inspect_checkpoint(args.path), tensors=args.tensors, as_json=args.json)
        elif args.command == "verify":
            info = verify(args.path)
            print(f"OK {info.directory}: {len(info.files)} files, {info.total_bytes} bytes "
                  "verified")
        elif args.command == "export":
            fmt = args.format
            if fmt == "dcp" or (fmt is None and not args.out.endswith((".safetensors", ".pt",
                                                                       ".pth", ".bin"))):
                print(f"wrote DCP checkpoint {to_dcp(args.path, args.out)}")
            else:
                print(f"wrote {export(args.path, args.out, format=fmt)}")
        elif args.command == "from-dcp":
            print(f"wrote {from_dcp(args.dcp_dir, args.path)}")
    except (CheckpointError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0
