"""The paper's ablations at small scale (see `fsdp.bench.ablations` for what each shows):
tracked as off/on ratios, so a feature that stops helping shows as a regression."""

from __future__ import annotations

import os

from fsdp.bench.ablations import ABLATIONS, collective_granularity, run_ablation
from fsdp.bench.engines import EngineBenchConfig

SMOKE = os.environ.get("FSDP_BENCH_SMOKE") == "1"


class Ablations:
    params = (["flat_parameter", *ABLATIONS],)
    param_names = ["ablation"]
    timeout = 1800

    def setup_cache(self):
        base = EngineBenchConfig(
            model="tiny" if SMOKE else "8x512", steps=1 if SMOKE else 3, warmup=1
        )
        rows = {"flat_parameter": collective_granularity(2, iters=1 if SMOKE else 5)}
        for name in ABLATIONS:
            rows[name] = run_ablation(name, base, 2)
        return rows

    def track_off_over_on(self, rows, ablation):
        return rows[ablation].ratio

    track_off_over_on.unit = "ratio"
