"""Every asv benchmark runs once, small (FSDP_BENCH_SMOKE=1), so a broken benchmark fails CI
while full benchmark runs stay manual (docs/benchmarks-commands.md); and the fast pieces of
`scripts/bench-regress --self-test` (docs/benchmarks.md): each slowdown it commits still finds
its function and compiles, each benchmark it expects to flag exists, asv's tables parse."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import inspect
import itertools
import os
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH_DIR = ROOT / "asv_bench" / "benchmarks"
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


def _bench_regress():
    loader = importlib.machinery.SourceFileLoader(
        "bench_regress", str(ROOT / "scripts" / "bench-regress")
    )
    spec = importlib.util.spec_from_loader("bench_regress", loader)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_regress"] = module  # dataclasses look their module up
    try:
        loader.exec_module(module)
    finally:
        del sys.modules["bench_regress"]
    return module


def test_gate_directory_links_the_gate_module() -> None:
    """asv.gate.conf.json's benchmark directory holds the very file the full suite runs."""
    assert (ROOT / "asv_bench" / "gate" / "gate.py").resolve() == BENCH_DIR / "gate.py"


@pytest.mark.parametrize("layer", ["engine", "comm", "memory", "ckpt"])
def test_self_test_slowdown_applies(layer: str, tmp_path: Path) -> None:
    """The busy-wait --self-test commits into this layer finds its function in today's source,
    compiles, and the benchmark that must flag it exists in the gate."""
    br = _bench_regress()
    (s,) = [s for s in br.SLOWDOWNS if s.layer == layer]
    copy = tmp_path / Path(s.path).name
    shutil.copy(ROOT / s.path, copy)
    try:
        br._insert_busy_wait(copy, s.function, 2e-6)
    except LookupError:
        assert s.fallback, f"{s.path}: no {s.function}"
        br._insert_busy_wait(copy, s.fallback, 2e-6)
    _check_edit(copy, "_selftest_time.perf_counter()", 2, s.benchmark)


def _check_edit(copy: Path, marker: str, count: int, benchmark: str) -> None:
    """The edited copy compiles, holds the edit, and ``benchmark`` exists in the gate."""
    text = copy.read_text()
    compile(text, str(copy), "exec")
    assert text.count(marker) == count
    gate = _load(BENCH_DIR / "gate.py")
    _, cls, method = benchmark.split(".")
    assert callable(getattr(getattr(gate, cls), method, None)), benchmark


def test_self_test_overlap_loss_applies(tmp_path: Path) -> None:
    """The overlap loss --self-test commits finds its function and compiles, and the gate
    benchmark that must flag it exists."""
    br = _bench_regress()
    for loss in br.OVERLAP_LOSSES:
        copy = tmp_path / Path(loss.path).name
        shutil.copy(ROOT / loss.path, copy)
        br._insert_early_return(copy, loss.function)
        _check_edit(copy, "return  # bench-regress --self-test", 1, loss.benchmark)


def test_exposed_comm_counts_a_lost_prefetch(monkeypatch) -> None:
    """gate.ExposedComm: one exposed wait per step with prefetching, one more per block once
    the forward prefetch is gone (what the self-test's overlap loss commits)."""
    from fsdp_engine._state import FSDPState

    monkeypatch.delenv("FSDP_BENCH_SMOKE", raising=False)
    gate = _load(BENCH_DIR / "gate.py")
    assert gate.exposed_waits(steps=2) == 1
    monkeypatch.setattr(FSDPState, "_prefetch_forward", lambda self, root: None)
    assert gate.exposed_waits(steps=2) >= gate.UNITS


def test_bf16_gathered_units_run_the_users_path() -> None:
    """gate.EngineUnitsBf16Gathered measures what its name says: at world size 2 every unit
    but the last of forward gathers its bf16 shard in forward and again in backward, and
    every unit reduce-scatters fp32 gradients, each step."""
    from fsdp_comm import FakeTraffic

    gate = _load(BENCH_DIR / "gate.py")
    traffic = FakeTraffic()
    sharded, reference = gate.engine_units_bf16_gathered(traffic)
    sharded()  # the first step builds the units
    reference()
    traffic.calls.clear()
    traffic.bytes.clear()
    sharded()
    units = gate.UNITS
    gathers, reduces = (
        traffic.calls["all_gather_into_tensor"],
        traffic.calls["reduce_scatter_tensor"],
    )
    assert 2 * (units - 1) <= gathers <= 2 * units + 1, traffic.calls
    assert reduces == units, traffic.calls
    shard = (8 * 8 + 8) // gate.GATHERED_WORLD  # elements of one Linear(8, 8)'s shard
    assert traffic.bytes["all_gather_into_tensor"] == gathers * shard * 2  # bf16
    assert traffic.bytes["reduce_scatter_tensor"] == reduces * shard * 4 * gate.GATHERED_WORLD


def test_asv_tables_parse() -> None:
    br = _bench_regress()
    text = """
| Change   | Before [76c367bd] <main~1>   | After [472fe8d6] <main>   |   Ratio | Benchmark (Parameter)   |
|----------|------------------------------|---------------------------|---------|-------------------------|
| +        | 111±10μs                     | 145±10μs                  |    1.31 | gate.CommCall.track_all_gather_call |
|          | 2.19±0.01ms                  | 2.20±0.01ms               |   ~1.01 | gate.MemoryCycle.track_limiter |
| -        | 9.5±0.1ms                    | 4.7±0.1ms                 |    0.49 | gate.CkptSaveLoad.track_save |
"""  # noqa: E501
    assert br._rows(text) == [
        ("+", 1.31, "gate.CommCall.track_all_gather_call"),
        ("", 1.01, "gate.MemoryCycle.track_limiter"),
        ("-", 0.49, "gate.CkptSaveLoad.track_save"),
    ]
