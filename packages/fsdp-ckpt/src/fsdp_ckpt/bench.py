"""Checkpoint benchmark: sharded save and load against torch.distributed.checkpoint (DCP) and
raw file writes in the same run, and the peak memory of `full_state_dict` on rank 0.

    python -m fsdp_ckpt.bench --world-size 4 --state-mb 500 --repeats 3 [--json] [--out out.json]

The model is a stack of square Linear blocks (one fsdp-engine unit each) with AdamW state, so
parameters plus moments make up ``--state-mb`` of fp32 state across ranks. Each rank times: our
`save` (commit included) to one path, replaced every repeat (rank 0 deletes the superseded
version in a background thread; we wait for that, untimed, before the next job); ``dcp.save``
of the same bytes as FSDP2 holds them (DTensors sharded on dim 0, AdamW state alike; DCP's
default writer, which also fsyncs); raw writes of the same number of bytes to one file per rank
with fsync; our `load` and ``dcp.load`` of those checkpoints. Orders alternate between
repeats; the median of the slowest rank is reported. Rank functions live here because asv
cannot hand its own functions to rank processes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from fsdp_comm import CliHelpFormatter, ReduceOp, launch, size_arg
from fsdp_engine import fully_shard, sharded_layout
from torch import nn

from ._cleanup import wait_for_cleanup
from ._full_state import full_state_dict
from ._load import load
from ._save import save

__all__ = ["CkptBenchConfig", "CkptBenchResult", "run_bench", "main"]


@dataclass(frozen=True)
class CkptBenchConfig:
    """What to measure. ``state_mb``: parameters + AdamW moments, fp32, all ranks together."""

    world_size: int = 4
    state_mb: int = 500
    blocks: int = 16
    repeats: int = 3
    directory: str | None = None  # default: a temporary directory


@dataclass(frozen=True)
class CkptBenchResult:
    """Seconds are medians over repeats of the slowest rank; bytes are per run."""

    state_bytes: int
    ours_save_s: float
    cleanup_after_save_s: float  # rank 0's background deletion of the superseded version
    dcp_save_s: float
    raw_write_s: float
    ours_load_s: float
    dcp_load_s: float
    full_state_copy_bytes: int
    full_state_peak_extra_bytes: int
    largest_unit_bytes: int

    @property
    def save_ratio_to_dcp(self) -> float:
        return self.ours_save_s / self.dcp_save_s

    @property
    def load_ratio_to_dcp(self) -> float:
        return self.ours_load_s / self.dcp_load_s

    @property
    def save_ratio_to_raw_write(self) -> float:
        return self.ours_save_s / self.raw_write_s

    @property
    def full_state_units_above_copy(self) -> float:
        """Peak extra memory of full_state_dict beyond the CPU copy, in units (target <= 1)."""
        over = self.full_state_peak_extra_bytes - self.full_state_copy_bytes
        return max(0, over) / self.largest_unit_bytes

    def summary(self) -> dict[str, float]:
        return {
            **asdict(self),
            "save_ratio_to_dcp": self.save_ratio_to_dcp,
            "load_ratio_to_dcp": self.load_ratio_to_dcp,
            "save_ratio_to_raw_write": self.save_ratio_to_raw_write,
            "full_state_units_above_copy": self.full_state_units_above_copy,
        }


def _width(cfg: CkptBenchConfig) -> int:
    # state = 3 (param, exp_avg, exp_avg_sq) x 4 bytes x blocks x d x (d + 1)
    per_block = cfg.state_mb * 1e6 / (12 * cfg.blocks)
    d = int(per_block**0.5)
    return d - d % 64


def _model(cfg: CkptBenchConfig) -> nn.Sequential:
    torch.manual_seed(0)
    d = _width(cfg)
    return nn.Sequential(*(nn.Linear(d, d) for _ in range(cfg.blocks)))


def _shard(model: nn.Sequential, be: Any) -> nn.Sequential:
    for block in model:
        fully_shard(block, mesh=be)
    fully_shard(model, mesh=be)
    sharded_layout(model)  # lazy initialisation: parameters become local pieces now, so the
    return model  # optimizer's state is made shard-sized


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    opt.zero_grad()
    return opt


def _dtensor_state(full: dict[str, torch.Tensor], be: Any) -> dict[str, Any]:
    """The same model as FSDP2 shards it: dim-0 chunks as DTensors, AdamW state alike."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (be.world_size,))

    def sharded(t: torch.Tensor) -> DTensor:
        local = t.chunk(be.world_size, dim=0)[be.rank].clone()
        return DTensor.from_local(
            local, mesh, [Shard(0)], run_check=False, shape=t.shape, stride=t.stride()
        )

    model = {k: sharded(v) for k, v in full.items()}
    state = {
        k: {
            "step": torch.tensor(1.0),
            "exp_avg": sharded(torch.randn_like(v)),
            "exp_avg_sq": sharded(torch.rand_like(v)),
        }
        for k, v in full.items()
    }
    return {"model": model, "optim": {"state": state}}


def _timed(be: Any, fn: Callable[[], Any]) -> float:
    """Seconds from a barrier to a barrier, the slowest rank's."""
    be.barrier()
    t0 = time.perf_counter()
    fn()
    elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    be.all_reduce(elapsed, op=ReduceOp.MAX)
    be.barrier()
    return float(elapsed.item())


def _raw_write(path: str, nbytes: int) -> None:
    block = memoryview(bytearray(os.urandom(1 << 20)))
    with open(path, "wb") as f:
        left = nbytes
        while left > 0:
            left -= f.write(block[: min(left, len(block))])
        f.flush()
        os.fsync(f.fileno())


def _local_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> int:
    n = sum(p.numel() * p.element_size() for p in model.parameters())
    state = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    return n + sum(t.numel() * t.element_size() for t in state)


def _one_repeat(
    be: Any,
    rep: int,
    model: nn.Module,
    opt: torch.optim.Optimizer,
    dstate: dict[str, Any],
    root: str,
) -> dict[str, float]:
    # the submodules: torch.distributed.checkpoint re-exports them without declaring it
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    ours, theirs = os.path.join(root, "ours"), os.path.join(root, f"dcp-{rep}")
    raw = os.path.join(root, f"raw-{be.rank}-{rep}")
    nbytes = _local_bytes(model, opt)
    jobs = {
        "ours_save_s": lambda: save(ours, model, opt),
        "dcp_save_s": lambda: dcp_save(dstate, checkpoint_id=theirs),
        "raw_write_s": lambda: _raw_write(raw, nbytes),
    }
    order = list(jobs) if rep % 2 == 0 else list(reversed(jobs))
    out = {}
    for name in order:
        out[name] = _timed(be, jobs[name])
        if name == "ours_save_s":  # the superseded version is deleted in the background:
            t0 = time.perf_counter()  # let it finish before timing anything else
            wait_for_cleanup()
            out["cleanup_after_save_s"] = time.perf_counter() - t0
            be.barrier()
    loads = {
        "ours_load_s": lambda: load(ours, model, opt),
        "dcp_load_s": lambda: dcp_load(dstate, checkpoint_id=theirs),
    }
    order = list(loads) if rep % 2 == 0 else list(reversed(loads))
    out.update({name: _timed(be, loads[name]) for name in order})
    be.barrier()
    if be.rank == 0:
        shutil.rmtree(theirs, ignore_errors=True)
    os.remove(raw)
    return out


def _io_rank(be: Any, cfg: CkptBenchConfig, root: str) -> dict[str, float]:
    warnings.filterwarnings("ignore", category=FutureWarning)
    model = _model(cfg)
    dstate = _dtensor_state({k: v.detach() for k, v in model.state_dict().items()}, be)
    model = _shard(model, be)
    opt = _adamw(model)
    runs = [_one_repeat(be, rep, model, opt, dstate, root) for rep in range(cfg.repeats)]
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def _rss(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _memory_rank(be: Any, cfg: CkptBenchConfig) -> dict[str, int]:
    """Peak RSS growth of rank 0 over full_state_dict (VmHWM reset just before)."""
    model = _shard(_model(cfg), be)
    be.barrier()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    before = _rss("VmRSS:")
    state = full_state_dict(model)
    peak = _rss("VmHWM:")
    copy = sum(t.numel() * t.element_size() for t in state.values())
    d = _width(cfg)
    unit = d * (d + 1) * 4  # one block, unsharded: the most one gather holds
    return {"copy": copy, "peak_extra": peak - before, "unit": unit}


def run_bench(cfg: CkptBenchConfig) -> CkptBenchResult:
    """Run both measurements with ``cfg.world_size`` process ranks over gloo."""
    # Large allocations come straight from mmap and go back when freed, so RSS follows what
    # is live rather than what glibc keeps cached (see NOTES: "Peak RSS depends on glibc").
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")
    root = tempfile.mkdtemp(prefix="fsdp-ckpt-bench-", dir=cfg.directory)
    try:
        io = launch(
            _io_rank,
            cfg.world_size,
            backend="torch",
            args=(cfg, root),
            timeout=1800,
            threads_per_rank=1,
        )[0]
        mem = launch(
            _memory_rank,
            cfg.world_size,
            backend="torch",
            args=(cfg,),
            timeout=600,
            threads_per_rank=1,
        )[0]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    d = _width(cfg)
    state_bytes = 12 * cfg.blocks * d * (d + 1)
    return CkptBenchResult(
        state_bytes,
        io["ours_save_s"],
        io["cleanup_after_save_s"],
        io["dcp_save_s"],
        io["raw_write_s"],
        io["ours_load_s"],
        io["dcp_load_s"],
        mem["copy"],
        mem["peak_extra"],
        mem["unit"],
    )


def _parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=CliHelpFormatter)
    p.add_argument("--world-size", type=int, default=4, help="process ranks over gloo")
    size = p.add_mutually_exclusive_group()
    size.add_argument(
        "--state-mb",
        type=int,
        default=500,
        help="parameters plus AdamW moments, fp32, all ranks together, in MB (10^6 bytes)",
    )
    size.add_argument(
        "--state-size",
        type=size_arg("--state-size"),
        metavar="SIZE",
        help="the same as a size of the shared rule (512M, 2G: powers of 1024)",
    )
    p.add_argument(
        "--blocks", type=int, default=16, help="square Linear blocks of the model, one unit each"
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="runs of every measurement, orders alternating; the median is reported",
    )
    p.add_argument("--dir", default=None, help="where checkpoints are written (default: $TMPDIR)")
    p.add_argument(
        "--json", action="store_true", help="print the figures as JSON instead of the list"
    )
    p.add_argument("--out", metavar="PATH", help="also write the figures as JSON to PATH")
    return p


def main(argv: Sequence[str] | None = None, prog: str = "python -m fsdp_ckpt.bench") -> int:
    """Command line: run the benchmark and print (or write) the figures."""
    p = _parser(prog)
    a = p.parse_args(argv)
    state_mb = a.state_mb if a.state_size is None else max(1, round(a.state_size / 1e6))
    cfg = CkptBenchConfig(a.world_size, state_mb, a.blocks, a.repeats, a.dir)
    summary = run_bench(cfg).summary()
    record = {"config": asdict(cfg), "result": summary}
    if a.json:
        print(json.dumps(record, indent=1))
    for key, value in summary.items() if not a.json else ():
        print(f"{key:>28}: {value:.4g}" if isinstance(value, float) else f"{key:>28}: {value}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(record, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
