"""What ``--fault-tolerant`` costs per step when nothing fails, and that without it nothing
changes (issue #31).

    python -m fsdp.bench.fault_tolerant --rounds 3 --record docs/records
    python -m fsdp.bench.fault_tolerant --baseline /tmp/before   # a checkout to compare with

Runs, interleaved round by round (the order rotating), each ``fsdp train --strategy
hybrid_shard`` on 4 local ranks, 2 replica groups of 2:

* ``hybrid``: the ordinary path, one world of 4 ranks (``--shard-size 2``);
* ``fault-tolerant``: ``--fault-tolerant``, each replica group its own world of 2 ranks as
  under one torchrun per host, meeting at a local ``FSDP_FT_STORE``: a quorum and a commit
  vote through the store around every step;
* ``hybrid@baseline`` (with ``--baseline DIR``): the ordinary path of another checkout (its
  ``src`` and ``packages/*/src`` first on ``PYTHONPATH``), e.g. the commit before issue #31
  (``git worktree add /tmp/before a06f0b0~1``): what "nothing changes" means.

A figure is the mean step time of rank 0 over the steps after ``--warmup``, from its
``--metrics`` lines (a fault-tolerant step is timed from its quorum to its loss, the same
span as an ordinary one plus the quorum and the vote); each run's figure is the median over
the rounds, and ratios are to ``hybrid``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ._record import add_record_argument, make_record, write_record

__all__ = ["main", "run_once"]

RUNS = ("hybrid", "fault-tolerant")
_DEADLINE_S = 600.0  # one run; a run that hangs is killed and named


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _train_args(args: argparse.Namespace, metrics: Path) -> list[str]:
    return [
        "-m", "fsdp", "train", "--model", args.model, "--strategy", "hybrid_shard",
        "--steps", str(args.steps), "--global-batch", str(args.global_batch),
        "--param-dtype", args.param_dtype, "--reduce-dtype", args.reduce_dtype,
        "--threads-per-rank", "1", "--no-progress", "--metrics", str(metrics),
    ]  # fmt: skip


def _env(baseline: str | None) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT"):
        env.pop(name, None)
    if baseline is not None:
        root = Path(baseline)
        paths = [root / "src", *sorted((root / "packages").glob("*/src"))]
        env["PYTHONPATH"] = os.pathsep.join([*map(str, paths), env.get("PYTHONPATH", "")])
    return env


def _wait(procs: list[subprocess.Popen[bytes]], what: str, logs: list[Path]) -> None:
    deadline = time.monotonic() + _DEADLINE_S
    for p in procs:
        try:
            rc = p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise RuntimeError(f"{what}: no result within {_DEADLINE_S:.0f} s") from None
        if rc != 0:
            for q in procs:
                q.kill()
            tail = "".join(log.read_text(errors="replace")[-2000:] for log in logs if log.exists())
            raise RuntimeError(f"{what}: a rank exited with {rc}:\n{tail}")


def run_once(kind: str, args: argparse.Namespace, work: Path) -> float:
    """Run ``kind`` once; rank 0's mean step time (s) over the steps after the warm-up."""
    metrics = work / f"{kind}.jsonl"
    metrics.unlink(missing_ok=True)
    argv = [sys.executable, *_train_args(args, metrics)]
    if kind == "fault-tolerant":
        procs, logs, store = [], [], f"127.0.0.1:{_port()}"
        for replica in range(2):
            port = _port()
            for rank in range(2):
                env = {
                    **_env(None),
                    "RANK": str(rank),
                    "LOCAL_RANK": str(rank),
                    "WORLD_SIZE": "2",
                    "LOCAL_WORLD_SIZE": "2",
                    "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(port),
                    "FSDP_FT_STORE": store,
                    "FSDP_FT_REPLICA": str(replica),
                    "FSDP_FT_REPLICAS": "2",
                }
                cmd = [*argv, "--fault-tolerant"]
                if replica:  # one metrics file: replica 0's
                    at = cmd.index("--metrics")
                    del cmd[at : at + 2]
                log = work / f"{kind}.{replica}.{rank}.err"
                logs.append(log)
                with open(log, "wb") as err:
                    procs.append(
                        subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=err)
                    )
        _wait(procs, kind, logs)
    else:
        baseline = args.baseline if kind.endswith("@baseline") else None
        log = work / f"{kind}.err"
        with open(log, "wb") as err:
            cmd = argv + ["--world-size", "4", "--shard-size", "2"]
            procs = [
                subprocess.Popen(cmd, env=_env(baseline), stdout=subprocess.DEVNULL, stderr=err)
            ]
        _wait(procs, kind, [log])
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    times = [r["step_time_s"] for r in rows if r["step"] >= args.warmup]
    if not times:
        raise RuntimeError(f"{kind}: no step after the warm-up of {args.warmup} in {metrics}")
    return statistics.fmean(times)


def _parser() -> argparse.ArgumentParser:
    from fsdp_comm import CliHelpFormatter

    p = argparse.ArgumentParser(
        prog="python -m fsdp.bench.fault_tolerant",
        description=__doc__,
        formatter_class=CliHelpFormatter,
    )
    p.add_argument("--model", default="small", help="fsdp train --model")
    p.add_argument("--steps", type=int, default=40, help="steps per run")
    p.add_argument("--warmup", type=int, default=10, help="first steps left out of the mean")
    p.add_argument("--rounds", type=int, default=3, help="runs of each kind, interleaved")
    p.add_argument("--global-batch", type=int, default=8, help="fsdp train --global-batch")
    p.add_argument("--param-dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    p.add_argument("--reduce-dtype", default="fp32", choices=("bf16", "fp16", "fp32"))
    p.add_argument(
        "--baseline",
        metavar="DIR",
        help="also run the ordinary path from this checkout (e.g. the commit before #31)",
    )
    add_record_argument(p)
    return p


def _check(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    for name in ("steps", "rounds", "global_batch"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if not 0 <= args.warmup < args.steps:
        p.error(f"--warmup must be in [0, --steps), got {args.warmup} with --steps {args.steps}")
    if args.global_batch % 4:
        p.error(f"--global-batch must be a multiple of the 4 ranks, got {args.global_batch}")
    if args.baseline is not None and not (Path(args.baseline) / "src" / "fsdp").is_dir():
        p.error(f"--baseline must be a checkout of this repository, got {args.baseline!r}")


def main(argv: Sequence[str] | None = None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    _check(p, args)
    kinds = [*RUNS, *(["hybrid@baseline"] if args.baseline else [])]
    times: dict[str, list[float]] = {k: [] for k in kinds}
    with tempfile.TemporaryDirectory(prefix="fsdp-bench-ft-") as tmp:
        for r in range(args.rounds):
            for kind in kinds[r % len(kinds) :] + kinds[: r % len(kinds)]:
                times[kind].append(run_once(kind, args, Path(tmp)))
                print(f"round {r}: {kind} {1e3 * times[kind][-1]:.1f} ms/step", flush=True)
    median = {k: statistics.median(v) for k, v in times.items()}
    print(f"# model={args.model} 4 ranks (2 replicas x 2 shards) {args.param_dtype} params, "
          f"{args.reduce_dtype} reduction, {args.steps} steps (warm-up {args.warmup}), "
          f"{args.rounds} rounds")  # fmt: skip
    for k in kinds:
        print(f"{k:<18}{1e3 * median[k]:9.1f} ms/step  {median[k] / median['hybrid']:.3f}x hybrid")
    if args.record:
        config: dict[str, Any] = {
            k: getattr(args, k)
            for k in ("model", "steps", "warmup", "rounds", "global_batch", "param_dtype")
        }
        config |= {"reduce_dtype": args.reduce_dtype, "ranks": 4, "replicas": 2}
        config["baseline"] = args.baseline
        ratio = {k: median[k] / median["hybrid"] for k in kinds}
        figures = {
            k: {"step_s": median[k], "rounds_s": times[k], "ratio_to_hybrid": ratio[k]}
            for k in kinds
        }
        record = make_record("fault-tolerant", config, figures, prog=p.prog, argv=argv)
        print(f"record: {write_record(record, args.record)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
