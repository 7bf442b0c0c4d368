"""Every asv benchmark runs once, small (FSDP_BENCH_SMOKE=1), so a broken benchmark fails CI
while full benchmark runs stay manual (README "Benchmarks")."""

from __future__ import annotations

import importlib.util
import inspect
import itertools
import os
from pathlib import Path

import pytest

BENCH_DIR = Path(__file__).resolve().parents[1] / "asv_bench" / "benchmarks"
MODULES = sorted(p for p in BENCH_DIR.glob("*.py") if p.name != "__init__.py")


def _load(path: Path):
    spec = importlib.util.spec_from_file_location(f"asv_smoke_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _benchmarks(module):
    for name, cls in inspect.getmembers(module, inspect.isclass):
        if cls.__module__ != module.__name__:
            continue
        methods = [m for m in dir(cls) if m.startswith(("time_", "track_", "peakmem_", "mem_"))]
        if methods:
            yield name, cls, methods


def _param_sets(cls):
    params = getattr(cls, "params", None)
    if not params:
        return [()]
    if not isinstance(params[0], (list, tuple)):
        params = (params,)
    return list(itertools.product(*params))


@pytest.mark.slow
@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.stem)
def test_benchmark_module_runs(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FSDP_BENCH_SMOKE", "1")
    module = _load(path)
    ran = 0
    for _, cls, methods in _benchmarks(module):
        bench = cls()
        cache = bench.setup_cache() if hasattr(bench, "setup_cache") else None
        for args in _param_sets(cls):
            full_args = ((cache,) if cache is not None else ()) + tuple(args)
            if hasattr(bench, "setup"):
                bench.setup(*full_args)
            try:
                for m in methods:
                    getattr(bench, m)(*full_args)
                    ran += 1
            finally:
                if hasattr(bench, "teardown"):
                    bench.teardown(*full_args)
    assert ran > 0, f"{path.name} defines no benchmark"
    assert os.environ["FSDP_BENCH_SMOKE"] == "1"
