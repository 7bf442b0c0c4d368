"""torch.compile of each block before fully_shard keeps the one-process reference losses
(aot_eager, both spellings; inductor where a C++ compiler works). Small: compiling is slow on
2 cores."""

from __future__ import annotations

import functools
import os
import subprocess
import sysconfig
import tempfile

import pytest

from .ranks import IMPLS, launched_many, results_of
from .test_activation_checkpointing import assert_matches_reference

WORLD = 2

_PROBE_SRC = """
#include <Python.h>
#include <omp.h>
extern "C" int probe(void) { int n = 0;
#pragma omp parallel reduction(+:n)
  n += 1;
  return n; }
"""


@functools.cache
def cxx_problem() -> str | None:
    """None when the C++ compiler inductor would use builds an OpenMP + Python.h shared
    library; else why not. Probed once per session."""
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        cxx = get_cpp_compiler()
    except Exception as exc:  # no compiler found, or torch's lookup changed
        return f"no C++ compiler for inductor: {type(exc).__name__}: {exc}"
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "probe.cpp")
        with open(src, "w") as f:
            f.write(_PROBE_SRC)
        cmd = [
            cxx,
            "-shared",
            "-fPIC",
            "-fopenmp",
            f"-I{sysconfig.get_paths()['include']}",
            src,
            "-o",
            os.path.join(tmp, "probe.so"),
        ]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"{cxx} does not run: {exc}"
    if proc.returncode != 0:
        return f"{' '.join(cmd)} failed: {proc.stderr.strip()[-500:]}"
    return None


_LAUNCHED: dict = {}


def _modes() -> tuple[str, ...]:
    """The modes one launched group runs per implementation: the aot_eager spellings, and
    inductor where a C++ compiler works (each resets dynamo; see ranks.run_many)."""
    extra = ("inductor-method",) if cxx_problem() is None else ()
    return ("aot_eager-method", "aot_eager-assigned", *extra)


def _check(impl: str, mode: str) -> None:
    group = launched_many("compile_rank", impl, WORLD, _modes(), _LAUNCHED)
    results = results_of(group[mode], f"{impl} {mode}")
    for r in results:  # dynamo really compiled something (graph breaks are allowed, and shown)
        print(f"{impl} {mode}: dynamo {r['dynamo_stats']}, graph breaks {r['graph_breaks']}")
        assert r["dynamo_stats"].get("unique_graphs", 0) >= 1, r["dynamo_stats"]
    assert_matches_reference(results, WORLD)


@pytest.mark.slow
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("mode", ["aot_eager-method", "aot_eager-assigned"])
def test_compiled_blocks_aot_eager_match_reference(impl: str, mode: str) -> None:
    _check(impl, mode)


@pytest.mark.slow
@pytest.mark.parametrize("impl", IMPLS)
def test_compiled_blocks_inductor_match_reference(impl: str) -> None:
    problem = cxx_problem()
    if problem is not None:
        pytest.skip(problem)
    _check(impl, "inductor-method")
