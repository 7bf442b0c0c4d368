"""Step-timeline benchmarks (`fsdp_engine.profile_steps`, Note [step timeline]): exposed
communication and the engine's Python per training step, GPT at world size 2 over gloo, so
that a regression in overlap shows in `scripts/bench-regress` as a rise in exposed ms.

Rank functions live in the installed umbrella package (`fsdp.bench.timeline`).
"""

from __future__ import annotations

import os

from fsdp.bench.timeline import run_timeline

# FSDP_BENCH_SMOKE=1 (tests/test_benchmarks_smoke.py) runs every benchmark once, small.
SMOKE = os.environ.get("FSDP_BENCH_SMOKE") == "1"


class StepTimeline:
    """GPT tiny and small, world size 2, gloo, 1 thread per rank; the rank with the most
    exposed communication, mean over the profiled steps (after 2 warm-up steps)."""

    params = (["tiny"] if SMOKE else ["tiny", "small"],)
    param_names = ["model"]
    timeout = 1800
    number = 1
    repeat = 1

    def setup_cache(self):
        steps, warmup = (1, 1) if SMOKE else (4, 2)
        return {
            model: run_timeline(model=model, world_size=2, steps=steps, warmup=warmup)
            for model in self.params[0]
        }

    def track_exposed_comm_ms(self, cache, model):
        """Communication the training thread waited for, ms per step (lower is better)."""
        return cache[model].exposed_ms

    track_exposed_comm_ms.unit = "ms"

    def track_engine_python_ms(self, cache, model):
        """Time in the engine's hooks, not waiting, ms per step."""
        return cache[model].engine_ms

    track_engine_python_ms.unit = "ms"

    def track_exposed_fraction(self, cache, model):
        """Exposed communication over step time."""
        return cache[model].exposed_ms / cache[model].step_ms

    track_exposed_fraction.unit = "ratio"
