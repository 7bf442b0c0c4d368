"""fsdp-engine benchmarks: training-step time against torch FSDP2 and DDP on the same GPT in
the same run (ratios tracked, so a regression of a ratio shows), peak RSS per rank, and the
Python time each unit adds per forward+backward.

Rank functions live in the installed umbrella package (`fsdp.bench_engines`).
"""

from __future__ import annotations

import os

from fsdp.bench_engines import EngineBenchConfig, run_engine, unit_overhead

# FSDP_BENCH_SMOKE=1 (tests/test_benchmarks_smoke.py) runs every benchmark once, small.
SMOKE = os.environ.get("FSDP_BENCH_SMOKE") == "1"
MODEL = "tiny" if SMOKE else "8x512"


class StepVsTorch:
    """GPT 8x512 (33.7 M parameters), global batch 8 x 128 tokens, AdamW, gloo, 1 thread/rank."""

    params = ([2] if SMOKE else [2, 4],)
    param_names = ["world_size"]
    timeout = 1800
    number = 1
    repeat = 1

    def setup_cache(self):
        out = {}
        for world in self.params[0]:
            for engine in ("ours", "fsdp2", "ddp"):
                cfg = EngineBenchConfig(engine=engine, model=MODEL, steps=1 if SMOKE else 4,
                                        warmup=1)
                out[(engine, world)] = run_engine(cfg, world)
        return out

    def track_step_s(self, cache, world_size):
        return cache[("ours", world_size)].step_s

    track_step_s.unit = "s"

    def track_step_ratio_to_fsdp2(self, cache, world_size):
        """Target <= 0.9."""
        return cache[("ours", world_size)].step_s / cache[("fsdp2", world_size)].step_s

    track_step_ratio_to_fsdp2.unit = "ratio"

    def track_step_ratio_to_ddp(self, cache, world_size):
        """Target <= 1.15."""
        return cache[("ours", world_size)].step_s / cache[("ddp", world_size)].step_s

    track_step_ratio_to_ddp.unit = "ratio"

    def track_peak_rss_ratio_to_ddp(self, cache, world_size):
        """Per-rank peak RSS against DDP's (target <= 1.0 at this size)."""
        return cache[("ours", world_size)].peak_rss_mib / cache[("ddp", world_size)].peak_rss_mib

    track_peak_rss_ratio_to_ddp.unit = "ratio"


class UnitOverhead:
    """64 units of tiny layers, world size 1: what each unit costs per forward+backward."""

    timeout = 600

    def setup_cache(self):
        iters = 2 if SMOKE else 30
        return {"ours": unit_overhead("ours", iters=iters),
                "fsdp2": unit_overhead("fsdp2", iters=iters)}

    def track_us_per_unit(self, cache):
        return cache["ours"]

    track_us_per_unit.unit = "us"

    def track_ratio_to_fsdp2(self, cache):
        return cache["ours"] / cache["fsdp2"]

    track_ratio_to_fsdp2.unit = "ratio"


class StepTime:
    """Our engine alone: a quick step-time benchmark for `asv continuous` (threads backend,
    world size 2, the small GPT), where regressions of the engine itself show."""

    timeout = 300

    def setup(self):
        from fsdp_comm import ThreadsBackend

        from fsdp.bench_engines import EngineBenchConfig

        self.cfg = EngineBenchConfig(model="tiny" if SMOKE else "small", steps=1, warmup=0)
        self.backends = ThreadsBackend.create(1)

    def time_engine_step(self):
        from fsdp.bench_engines import engine_rank

        engine_rank(self.backends[0], self.cfg)
