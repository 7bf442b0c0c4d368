"""fsdp-engine benchmarks: training-step time against torch FSDP2 and DDP on the same GPT in
the same run (ratios tracked, so a regression of a ratio shows), peak RSS per rank, and the
Python time each unit adds per forward+backward.

Rank functions live in the installed umbrella package (`fsdp.bench_engines`).
"""

from __future__ import annotations

from fsdp.bench_engines import EngineBenchConfig, run_engine, unit_overhead


class StepVsTorch:
    """GPT 8x512 (33.7 M parameters), global batch 8 x 128 tokens, AdamW, gloo, 1 thread/rank."""

    params = ([2, 4],)
    param_names = ["world_size"]
    timeout = 1800
    number = 1
    repeat = 1

    def setup_cache(self):
        out = {}
        for world in self.params[0]:
            for engine in ("ours", "fsdp2", "ddp"):
                cfg = EngineBenchConfig(engine=engine, steps=4, warmup=1)
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
        return {"ours": unit_overhead("ours"), "fsdp2": unit_overhead("fsdp2")}

    def track_us_per_unit(self, cache):
        return cache["ours"]

    track_us_per_unit.unit = "us"

    def track_ratio_to_fsdp2(self, cache):
        return cache["ours"] / cache["fsdp2"]

    track_ratio_to_fsdp2.unit = "ratio"
