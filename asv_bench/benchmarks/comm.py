"""fsdp-comm benchmarks: bus bandwidth against raw torch.distributed, per-call overhead,
and the threads backend against memcpy.

Rank functions live in the installed package (`fsdp_comm.bench`): asv's benchmark process
cannot hand its own functions to the ranks.
"""

from __future__ import annotations

import os
import timeit

import torch
from fsdp_comm import TorchBackend
from fsdp_comm.bench import BenchConfig, run_sweep

# FSDP_BENCH_SMOKE=1 (tests/test_benchmarks_smoke.py) runs every benchmark once, small.
SMOKE = os.environ.get("FSDP_BENCH_SMOKE") == "1"
SIZES = [64 << 10] if SMOKE else [1 << 20, 16 << 20, 64 << 20]
COLLECTIVES = ["all_gather", "reduce_scatter"]


class GlooCollectives:
    """Our torch backend and torch.distributed on the same gloo group, in the same run."""

    params = (COLLECTIVES, SIZES, [2] if SMOKE else [2, 4])
    param_names = ["collective", "nbytes", "world_size"]
    timeout = 900
    number = 1
    repeat = 1

    def setup_cache(self):
        results = {}
        for world_size in self.params[2]:
            cfg = BenchConfig(
                collectives=tuple(COLLECTIVES),
                sizes=tuple(SIZES),
                iters=3,
                warmup=1,
                rounds=3,
                compare_raw=True,
            )
            for r in run_sweep(cfg, backend="torch", world_size=world_size):
                results[(r.collective, r.nbytes, world_size)] = r
        return results

    def track_busbw(self, cache, collective, nbytes, world_size):
        return cache[(collective, nbytes, world_size)].busbw_gbs

    track_busbw.unit = "GB/s"

    def track_speedup_vs_torch_distributed(self, cache, collective, nbytes, world_size):
        """torch.distributed's time over ours: >= 0.97 required, > 1 where we pick a faster
        algorithm than gloo's."""
        return cache[(collective, nbytes, world_size)].speedup_vs_raw

    track_speedup_vs_torch_distributed.unit = "ratio"


class ThreadsBandwidth:
    """All-gather of 64 MiB through the threads backend as a fraction of one memcpy."""

    timeout = 300

    def setup_cache(self):
        nbytes = (1 << 20) if SMOKE else (64 << 20)
        cfg = BenchConfig(collectives=("all_gather",), sizes=(nbytes,), iters=3, warmup=1)
        ours = run_sweep(cfg, backend="threads", world_size=2)[0]
        src = torch.ones(nbytes // 4)
        dst = torch.empty_like(src)
        copy_s = min(timeit.repeat(lambda: dst.copy_(src), number=3, repeat=5)) / 3
        return ours.algbw_gbs, nbytes / copy_s / 1e9

    def track_fraction_of_memcpy(self, cache):
        algbw, memcpy = cache
        return algbw / memcpy

    track_fraction_of_memcpy.unit = "ratio"


class CallOverhead:
    """Python time our torch backend adds to a collective call (the collective is a no-op)."""

    def setup(self):
        import fsdp_comm._torch_backend as tb

        self._saved = (tb._ALL_GATHER, tb._REDUCE_SCATTER)
        tb._ALL_GATHER = tb._REDUCE_SCATTER = lambda *a, **k: None
        self.be = TorchBackend()
        self.out, self.inp = torch.empty(256), torch.empty(256)

    def teardown(self):
        import fsdp_comm._torch_backend as tb

        tb._ALL_GATHER, tb._REDUCE_SCATTER = self._saved
        self.be.close()

    def time_all_gather_call(self):
        self.be.all_gather_into_tensor(self.out, self.inp)

    def time_reduce_scatter_call(self):
        self.be.reduce_scatter_tensor(self.inp, self.out)
