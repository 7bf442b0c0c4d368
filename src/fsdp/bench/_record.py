"""Benchmark records: one JSON file per run of a benchmark command (``--record DIR``).

A record says what was measured, where, with what and how, so that a figure quoted in the
documentation can be traced to the run that produced it (issue #29, "figures as data")::

    {
      "schema": 1,
      "kind": "engines",                      # which benchmark (RECORD_KINDS)
      "date": "2026-11-29T10:12:03Z",         # UTC; a transcribed record may give the day only
      "source": "measured",                   # or "transcribed from docs/measured.md"
      "machine": {"cpu": "...", "cores": 2, "memory_gib": 7.8,
                  "gpu": null},               # or {"name": "NVIDIA H100 80GB HBM3", "count": 1}
      "versions": {"python": "3.11.7", "torch": "2.13.0+cpu", "fsdp": "...",
                   "fsdp-comm": "...", "fsdp-memory": "...", "fsdp-engine": "...",
                   "fsdp-ckpt": "...", "cuda": null, "nccl": null},
      "git": {"commit": "ebbd5f3", "dirty": false},   # null outside a checkout
      "command": "python -m fsdp.bench.engines --world-size 2 --record docs/records",
      "config": {...},                        # every option the run used, defaults included
      "figures": {...},                       # what it measured (by kind)
      "note": "..."                           # optional
    }

``scripts/gen_figures.py`` turns the records kept in ``docs/records/`` into docs/figures.md
and the README's headline table; ``tests/test_figures.py`` validates every record.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

__all__ = [
    "RECORD_KINDS",
    "SCHEMA_VERSION",
    "add_record_argument",
    "git_info",
    "machine_info",
    "make_record",
    "read_record",
    "read_records",
    "run_recorded",
    "validate_record",
    "versions_info",
    "write_record",
]

#: The version of the record layout; a reader refuses others.
SCHEMA_VERSION = 1

#: What a record can be of: a benchmark command (and its mode), or a test-suite result.
RECORD_KINDS = (
    "engines",  # python -m fsdp.bench.engines (fsdp compare): the step comparison, --tp too
    "unit-overhead",  # python -m fsdp.bench.engines --unit-overhead
    "gpu-speed",  # python -m fsdp.bench.gpu speed
    "gpu-offload",  # python -m fsdp.bench.gpu offload
    "gpu-overhead",  # python -m fsdp.bench.gpu overhead
    "traffic",  # python -m fsdp.bench.traffic
    "timeline",  # python -m fsdp.bench.timeline
    "ablations",  # python -m fsdp.bench.ablations
    "comm-bench",  # fsdp comm-bench
    "ckpt-bench",  # fsdp ckpt-bench
    "fault-tolerant",  # python -m fsdp.bench.fault_tolerant
    "conformance",  # PyTorch's own FSDP2 tests run against this engine
)

#: The packages whose versions a record carries, by distribution name.
_PACKAGES = ("fsdp", "fsdp-comm", "fsdp-memory", "fsdp-engine", "fsdp-ckpt")

_TOP_KEYS = frozenset(
    {"schema", "kind", "date", "source", "machine", "versions", "git", "command", "config"}
    | {"figures", "note"}
)
_DATE = re.compile(r"\d{4}-\d{2}-\d{2}(T\d{2}:\d{2}:\d{2}Z)?")
_TRANSCRIBED = "transcribed from "


def add_record_argument(parser: Any) -> None:
    """``--record DIR`` on a benchmark command's parser (an argparse parser or group)."""
    parser.add_argument(
        "--record",
        metavar="DIR",
        help="also write this run as a JSON record to DIR (date, machine, versions, git "
        "commit, command, configuration, figures); scripts/gen_figures.py makes the "
        "docs' tables from the records in docs/records",
    )


def _cpu_model() -> str | None:
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return platform.processor() or None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        # x86 says "model name"; some ARM kernels "Model" or "CPU part" only
        if key.strip() in ("model name", "Model", "Hardware") and value.strip():
            return value.strip()
    return platform.processor() or platform.machine() or None


def _memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text(encoding="utf-8").splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) * 1024 / 2**30, 1)
    except (OSError, ValueError, IndexError):
        pass
    return None


def machine_info() -> dict[str, Any]:
    """This machine: CPU model, cores, memory in GiB, and its GPUs (None without CUDA)."""
    import torch

    gpu = None
    if torch.cuda.is_available():
        gpu = {"name": torch.cuda.get_device_name(0), "count": torch.cuda.device_count()}
    return {"cpu": _cpu_model(), "cores": os.cpu_count(), "memory_gib": _memory_gib(), "gpu": gpu}


def versions_info() -> dict[str, str | None]:
    """Python, torch, fsdp and its four packages, and CUDA and NCCL where torch has them."""
    import importlib.metadata as metadata

    import torch

    out: dict[str, str | None] = {"python": platform.python_version(), "torch": torch.__version__}
    for name in _PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    out["cuda"] = torch.version.cuda
    nccl = None
    if torch.cuda.is_available():
        version = torch.cuda.nccl.version()  # type: ignore[no-untyped-call]  # unannotated in torch
        nccl = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
    out["nccl"] = nccl
    return out


def git_info(where: str | Path | None = None) -> dict[str, Any] | None:
    """The checkout ``where`` (default: the one fsdp is imported from) is at: its short commit
    and whether tracked files differ from it; None outside a checkout or without git."""
    folder = Path(where) if where is not None else Path(__file__).resolve().parent

    def git(*args: str) -> str:
        done = subprocess.run(
            ["git", "-C", str(folder), *args], capture_output=True, text=True, timeout=30
        )
        if done.returncode:
            raise OSError(done.stderr.strip())
        return done.stdout.strip()

    try:
        commit = git("rev-parse", "--short", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": commit, "dirty": dirty}


def make_record(
    kind: str,
    config: Mapping[str, Any],
    figures: Mapping[str, Any],
    *,
    prog: str,
    argv: Sequence[str] | None = None,
    note: str | None = None,
) -> dict[str, Any]:
    """A record of a run measured now, on this machine. ``prog`` is the command as typed
    (``python -m fsdp.bench.engines``, ``fsdp compare``); ``argv`` its arguments (default:
    ``sys.argv[1:]``), together the exact command line."""
    args = list(sys.argv[1:] if argv is None else argv)
    record: dict[str, Any] = {
        "schema": SCHEMA_VERSION,
        "kind": kind,
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "source": "measured",
        "machine": machine_info(),
        "versions": versions_info(),
        "git": git_info(),
        "command": " ".join([prog, *map(shlex.quote, args)]),
        "config": dict(config),
        "figures": dict(figures),
    }
    if note is not None:
        record["note"] = note
    # through JSON and back: what is written is what a reader gets (tuples become lists)
    record = json.loads(json.dumps(record))
    validate_record(record)
    return record


def write_record(record: Mapping[str, Any], directory: str | Path) -> Path:
    """Validate ``record`` and write it to ``directory`` (created if missing) as
    ``<date>-<kind>.json``, never over an existing file; the path written."""
    validate_record(record)
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    stem = f"{record['date'].replace(':', '').replace('-', '')}-{record['kind']}"
    path, n = folder / f"{stem}.json", 1
    while path.exists():
        n += 1
        path = folder / f"{stem}-{n}.json"
    text = json.dumps(record, indent=1, sort_keys=False, allow_nan=False) + "\n"
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)  # a reader never sees half a record
    return path


def read_record(path: str | Path) -> dict[str, Any]:
    """The record in ``path``, validated (ValueError naming the file and the field)."""
    try:
        record = json.loads(Path(path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not JSON: {exc}") from None
    try:
        validate_record(record)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
    assert isinstance(record, dict)  # validate_record checked it
    return record


def read_records(directory: str | Path) -> list[tuple[Path, dict[str, Any]]]:
    """Every ``*.json`` record in ``directory``, validated, newest first (by date, then by
    `write_record`'s ``-N`` suffix of records of the same second, then by name)."""
    found = [(p, read_record(p)) for p in sorted(Path(directory).glob("*.json"))]
    found.sort(key=lambda pr: _order(pr[0], pr[1]["date"]), reverse=True)
    return found


def _order(path: Path, date: str) -> tuple[str, int, str]:
    suffix = re.search(r"-(\d+)$", path.stem)
    return (
        date if "T" in date else f"{date}T00:00:00Z",
        int(suffix[1]) if suffix else 1,
        path.name,
    )


def _need(cond: bool, field: str, rule: str, value: Any) -> None:
    if not cond:
        raise ValueError(f"record field {field!r} must be {rule}, got {value!r}")


def _optional(value: Any, kind: type | tuple[type, ...]) -> bool:
    return value is None or (isinstance(value, kind) and not isinstance(value, bool))


def _finite_json(value: Any, field: str) -> None:
    """Only JSON's own types, and no NaN or infinity (JSON has none)."""
    if isinstance(value, float):
        _need(math.isfinite(value), field, "finite", value)
    elif isinstance(value, Mapping):
        for k, v in value.items():
            _need(isinstance(k, str), field, "keyed by strings", k)
            _finite_json(v, f"{field}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _finite_json(v, f"{field}[{i}]")
    else:
        _need(value is None or isinstance(value, (str, int, bool)), field, "JSON", value)


def validate_record(record: Any) -> None:
    """Raise ValueError naming the field, the rule and the value if ``record`` is not a
    record of this schema (the module docstring)."""
    _need(isinstance(record, Mapping), "record", "a JSON object", type(record).__name__)
    unknown = sorted(set(record) - _TOP_KEYS)
    _need(not unknown, "record", f"keys from {sorted(_TOP_KEYS)}", unknown)
    missing = sorted(_TOP_KEYS - {"note"} - set(record))
    _need(not missing, "record", "complete", f"missing {missing}")
    _need(record["schema"] == SCHEMA_VERSION, "schema", str(SCHEMA_VERSION), record["schema"])
    _need(record["kind"] in RECORD_KINDS, "kind", f"one of {RECORD_KINDS}", record["kind"])
    date = record["date"]
    ok = isinstance(date, str) and _DATE.fullmatch(date) is not None
    if ok:
        try:
            datetime.strptime(date[:10], "%Y-%m-%d")
        except ValueError:
            ok = False
    _need(ok, "date", "UTC ISO 8601 (YYYY-MM-DDTHH:MM:SSZ, or YYYY-MM-DD)", date)
    source = record["source"]
    transcribed = isinstance(source, str) and source.startswith(_TRANSCRIBED)
    _need(
        source == "measured" or (transcribed and len(source) > len(_TRANSCRIBED)),
        "source",
        f"'measured' or '{_TRANSCRIBED}<where>'",
        source,
    )
    _need(transcribed or "T" in date, "date", "a time of day for a measured record", date)
    machine = record["machine"]
    _need(isinstance(machine, Mapping), "machine", "an object", machine)
    _need(set(machine) == {"cpu", "cores", "memory_gib", "gpu"}, "machine", "4 keys", machine)
    _need(_optional(machine["cpu"], str), "machine.cpu", "a string or null", machine["cpu"])
    _need(_optional(machine["cores"], int), "machine.cores", "an int or null", machine["cores"])
    mem = machine["memory_gib"]
    _need(_optional(mem, (int, float)), "machine.memory_gib", "a number or null", mem)
    gpu = machine["gpu"]
    _need(
        gpu is None
        or (
            isinstance(gpu, Mapping)
            and set(gpu) == {"name", "count"}
            and isinstance(gpu["name"], str)
            and isinstance(gpu["count"], int)
            and gpu["count"] >= 1
        ),
        "machine.gpu",
        'null or {"name": str, "count": int >= 1}',
        gpu,
    )
    versions = record["versions"]
    _need(isinstance(versions, Mapping), "versions", "an object", versions)
    want = {"python", "torch", *_PACKAGES, "cuda", "nccl"}
    _need(set(versions) == want, "versions", f"the keys {sorted(want)}", sorted(versions))
    for key, value in versions.items():
        _need(_optional(value, str), f"versions.{key}", "a string or null", value)
    _need(transcribed or versions["torch"] is not None, "versions.torch", "known", None)
    git = record["git"]
    _need(
        git is None
        or (
            isinstance(git, Mapping)
            and set(git) == {"commit", "dirty"}
            and isinstance(git["commit"], str)
            and re.fullmatch(r"[0-9a-f]{7,40}", git["commit"]) is not None
            and isinstance(git["dirty"], bool)
        ),
        "git",
        'null or {"commit": hex, "dirty": bool}',
        git,
    )
    command = record["command"]
    _need(isinstance(command, str) and command.strip() != "", "command", "a command", command)
    _need(isinstance(record["config"], Mapping), "config", "an object", record["config"])
    figures = record["figures"]
    _need(isinstance(figures, Mapping) and len(figures) > 0, "figures", "an object", figures)
    if "note" in record:
        _need(isinstance(record["note"], str), "note", "a string", record["note"])
    _finite_json(record["config"], "config")
    _finite_json(figures, "figures")


def run_recorded(
    main: Callable[..., int],
    parser_of: Callable[[str], argparse.ArgumentParser],
    figures_of: Callable[[Any], tuple[dict[str, Any], dict[str, Any]]],
    argv: Sequence[str],
    *,
    prog: str,
    kind: str,
) -> int:
    """Run a lower package's benchmark command (``main(argv, prog=prog)``, which must not
    import the umbrella) with ``--record DIR`` added: ``parser_of(prog)`` plus ``--record``
    parses ``argv`` (so ``--help`` lists it and errors come before any rank starts); the
    command writes its JSON (``--out PATH``, a temporary file unless given), and
    ``figures_of(that JSON)`` gives the record's ``(config, figures)``; the configuration
    also holds every option parsed."""
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--record", metavar="DIR")
    known, rest = pre.parse_known_args(list(argv))
    parser = parser_of(prog)
    add_record_argument(parser)
    options = parser.parse_args(rest)  # --help exits here, listing --record
    if known.record is None:
        return main(rest, prog=prog)
    with tempfile.TemporaryDirectory(prefix="fsdp-record-") as tmp:
        out = options.out or str(Path(tmp, "out.json"))
        code = main([*rest, "--out", out] if options.out is None else rest, prog=prog)
        if code:
            return code
        config, figures = figures_of(json.loads(Path(out).read_text(encoding="utf-8")))
    parsed = {k: v for k, v in vars(options).items() if k not in ("record", "out", "json")}
    record = make_record(kind, {**parsed, **config}, figures, prog=prog, argv=argv)
    print(f"record: {write_record(record, known.record)}")
    return 0
