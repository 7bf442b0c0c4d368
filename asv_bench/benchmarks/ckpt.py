"""fsdp-ckpt benchmarks: sharded save and load of ~500 MB of model state (parameters and AdamW
moments, fp32) at world size 4, as ratios to torch.distributed.checkpoint (DCP) saving and
loading the same bytes (FSDP2's sharding) and to raw file writes, all in the same run; and the
peak extra memory of `full_state_dict` on rank 0, in units above the CPU copy.

Rank functions live in the installed package (`fsdp_ckpt.bench`): asv cannot hand its own
functions to rank processes. Ratios, not seconds, are the signal on a shared machine.
"""

from __future__ import annotations

import importlib.util
import os
import time
from pathlib import Path

from fsdp_ckpt.bench import CkptBenchConfig, run_bench

# The gate's helpers (gate.py, a sibling module; loaded by path: asv and the smoke test import
# this file under different package names).
_spec = importlib.util.spec_from_file_location(
    "_fsdp_bench_gate", Path(__file__).with_name("gate.py")
)
_gate = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_gate)

# FSDP_BENCH_SMOKE=1 (tests/test_benchmarks_smoke.py) runs every benchmark once, small.
SMOKE = os.environ.get("FSDP_BENCH_SMOKE") == "1"


class SaveLoadVsDCP:
    """World size 4 over gloo, 16 Linear(1600, 1600) units, AdamW state: 492 MB in all."""

    timeout = 1800
    number = 1
    repeat = 1

    def setup_cache(self):
        if SMOKE:
            return run_bench(CkptBenchConfig(world_size=2, state_mb=8, blocks=4, repeats=1))
        return run_bench(CkptBenchConfig(world_size=4, state_mb=500, blocks=16, repeats=3))

    def track_save_ratio_to_dcp(self, result):
        """Target <= 1.0."""
        return result.save_ratio_to_dcp

    track_save_ratio_to_dcp.unit = "ratio"

    def track_load_ratio_to_dcp(self, result):
        """Target <= 1.0."""
        return result.load_ratio_to_dcp

    track_load_ratio_to_dcp.unit = "ratio"

    def track_save_ratio_to_raw_write(self, result):
        """Our save (checksums, fsync, commit, old version deleted) against writing the same
        bytes with fsync and nothing else."""
        return result.save_ratio_to_raw_write

    track_save_ratio_to_raw_write.unit = "ratio"

    def track_save_s(self, result):
        return result.ours_save_s

    track_save_s.unit = "s"

    def track_load_s(self, result):
        return result.ours_load_s

    track_load_s.unit = "s"

    def track_full_state_units_above_copy(self, result):
        """Peak RSS growth of rank 0 during full_state_dict beyond its CPU copy, in units of
        the largest unit (target <= 1)."""
        return result.full_state_units_above_copy

    track_full_state_units_above_copy.unit = "units"


class LoadOverRead:
    """`fsdp_ckpt.load` of a 4 MiB plain model at world size 1 over reading the same bytes with
    their CRC-32 (the gate's method, `gate.paired_ratio`; not in the gate: it moves by ~7%
    between processes on a busy machine)."""

    def track_load_over_read(self):
        with _gate.CkptState() as state:
            state.raw_write()
            return _gate.paired_ratio(state.load, state.raw_read, timer=time.thread_time)

    track_load_over_read.unit = "ratio"
