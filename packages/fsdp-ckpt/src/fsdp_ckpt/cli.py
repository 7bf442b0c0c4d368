"""``fsdp ckpt inspect|verify|export|from-dcp``: checkpoints from the command line.

`main(argv)` takes the arguments after ``ckpt`` and returns an exit status: 0 on success,
1 when a checkpoint is missing, damaged, refused or does not verify, or a file cannot be
written (the message names the file), 2 for usage errors (argparse's convention), such as an
output whose format cannot be told from its name.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from fsdp_comm import CliHelpFormatter

from ._dcp import from_dcp, to_dcp
from ._errors import CheckpointError
from ._export import export, format_from_suffix
from ._inspect import CheckpointInfo, inspect_checkpoint, verify

__all__ = ["main", "build_parser"]

_FROM_DCP_HELP = """\
Convert a torch.distributed.checkpoint (DCP) directory into an fsdp-ckpt checkpoint.

Security: DCP stores its .metadata (and non-tensor values such as learning rates) with
Python's pickle, and unpickling an untrusted file can run arbitrary code. By default
this command never does that: .metadata is read with a restricted unpickler that accepts
only DCP's own metadata classes (torch.Size, dtypes, ...), values are read with
torch.load(weights_only=True), and the data files must be regular files inside DCP_DIR.
A checkpoint that needs anything else is refused (exit status 1).

--trust reads with plain pickle instead (needed only for checkpoints written with custom
DCP planners or storage extensions). Use it only for checkpoints whose origin you trust:
a crafted checkpoint can then run any code as you.
"""


def build_parser(prog: str = "fsdp ckpt") -> argparse.ArgumentParser:
    """The argument parser of the ``ckpt`` commands."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Inspect, verify and export fsdp-ckpt checkpoints.",
        formatter_class=CliHelpFormatter,
    )
    sub = parser.add_subparsers(
        dest="command",
        required=True,
        metavar="COMMAND",
        help=f"what to do ({prog} COMMAND --help for its options)",
    )
    _add_inspect(sub)
    p = sub.add_parser(
        "verify", help="check every file's size and checksum", formatter_class=CliHelpFormatter
    )
    p.add_argument("path", help="the checkpoint: the path it was saved to")
    _add_export(sub)
    _add_from_dcp(sub)
    return parser


def _add_inspect(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "inspect", help="summarise a checkpoint from its index", formatter_class=CliHelpFormatter
    )
    p.add_argument("path", help="the checkpoint: the path it was saved to")
    p.add_argument("--tensors", action="store_true", help="list every tensor")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")


def _add_export(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "export", help="write the model state as one file", formatter_class=CliHelpFormatter
    )
    p.add_argument("path", help="the checkpoint: the path it was saved to")
    p.add_argument(
        "out",
        help="output file (.safetensors, or .pt/.pth/.bin for torch.save), "
        "or a directory with --format dcp",
    )
    p.add_argument(
        "--format",
        choices=["safetensors", "torch", "dcp"],
        default=None,
        help="default: from the output's suffix (another suffix needs --format)",
    )


def _add_from_dcp(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "from-dcp",
        help="convert a torch.distributed.checkpoint directory "
        "(read without unpickling code; see --help)",
        description=_FROM_DCP_HELP,
        formatter_class=CliHelpFormatter,
    )
    p.add_argument("dcp_dir", help="the DCP checkpoint directory (holds .metadata)")
    p.add_argument("path", help="the fsdp-ckpt checkpoint path to write")
    p.add_argument(
        "--trust",
        action="store_true",
        help="unpickle DCP's files with plain "
        "pickle, which can run code: only for checkpoints you trust",
    )


def _summary(info: CheckpointInfo) -> dict[str, object]:
    return {
        "path": info.path,
        "directory": info.directory,
        "versions": list(info.versions),
        "world_size": info.world_size,
        "written_by": f"fsdp-ckpt {info.library_version}",
        "params": info.num_params,
        "param_elements": info.num_param_elements,
        "buffers": info.num_buffers,
        "optimizer": info.optimizer,
        "optimizer_states": list(info.optimizer_states),
        "extra": list(info.extra_keys),
        "files": len(info.files),
        "bytes": info.total_bytes,
    }


def _print_info(info: CheckpointInfo, *, tensors: bool, as_json: bool) -> None:
    summary = _summary(info)
    listing = (
        {
            name: {"shape": list(e.shape), "dtype": e.dtype, "pieces": len(e.chunks)}
            for name, e in info.index.entries().items()
        }
        if tensors
        else {}
    )
    if as_json:
        print(json.dumps({**summary, **({"tensors": listing} if tensors else {})}, indent=1))
        return
    for key, value in summary.items():
        print(f"{key:>18}: {value}")
    for name, t in listing.items():
        print(f"  {name}  {t['dtype']}{t['shape']}  ({t['pieces']} pieces)")


class _UsageError(Exception):
    """A command line that names no valid action (exit status 2)."""


def _export(path: str, out: str, fmt: str | None) -> None:
    if fmt is None:
        fmt = format_from_suffix(out)
        if fmt is None:
            raise _UsageError(
                f"cannot tell the format of {out!r} from its suffix: name a "
                ".safetensors, .pt, .pth or .bin file, or pass --format "
                "safetensors|torch|dcp"
            )
    if fmt == "dcp":
        print(f"wrote DCP checkpoint {to_dcp(path, out)}")
    else:
        print(f"wrote {export(path, out, format=fmt)}")


def _run(args: argparse.Namespace) -> None:
    if args.command == "inspect":
        _print_info(inspect_checkpoint(args.path), tensors=args.tensors, as_json=args.json)
    elif args.command == "verify":
        info = verify(args.path)
        print(f"OK {info.directory}: {len(info.files)} files, {info.total_bytes} bytes verified")
    elif args.command == "export":
        _export(args.path, args.out, args.format)
    elif args.command == "from-dcp":
        print(f"wrote {from_dcp(args.dcp_dir, args.path, trust=args.trust)}")


def main(argv: Sequence[str] | None = None, prog: str = "python -m fsdp_ckpt") -> int:
    """Run one ``ckpt`` command with ``argv`` (the words after ``ckpt``); the exit status.
    ``prog`` names the command in usage lines and errors."""
    args = build_parser(prog).parse_args(argv)
    try:
        _run(args)
    except (CheckpointError, OSError) as exc:  # a checkpoint or a file: named in the message
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except (_UsageError, ValueError) as exc:  # arguments: an output directory, a bad key
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0
