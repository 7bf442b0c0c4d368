"""One conformance suite, parametrized over backends and world sizes 1-4.

Each (backend, world size) runs the whole battery of `conformance.py` in one launch; every case
is then reported as its own test. GPU backends are skipped cleanly without a GPU.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from fsdp_comm import launch

from .conformance import CASE_NAMES, run_battery

WORLD_SIZES = (1, 2, 3, 4)

# name -> (registry backend, backend options, marks)
BACKENDS: dict[str, tuple[str, dict[str, Any], list[Any]]] = {
    "threads": ("threads", {}, []),
    "torch": ("torch", {}, []),
    # Thresholds at 0 force the pairwise gloo algorithms (Note [gloo algorithms])
    # on every size, so they pass the same battery as the native paths.
    "torch-fallbacks": (
        "torch",
        {"all_gather_pairwise_min_bytes": 0, "reduce_scatter_pairwise_min_bytes": 0},
        [],
    ),
    # Every all-gather through shared memory (Note [shared-memory all-gather]).
    "torch-shm": ("torch", {"all_gather_shm_min_bytes": 0}, []),
    "cupy-nccl": ("cupy-nccl", {}, [pytest.mark.gpu]),
}


def _gpu_world_ok(backend: str, world_size: int) -> bool:
    if backend != "cupy-nccl":
        return True
    return torch.cuda.is_available() and torch.cuda.device_count() >= world_size


@functools.cache
def _reports(variant: str, world_size: int) -> list[dict[str, str | None]]:
    backend, options, _ = BACKENDS[variant]
    return launch(run_battery, world_size, backend=backend, backend_options=options, timeout=120)


@pytest.mark.parametrize("case", CASE_NAMES)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize(
    "variant", [pytest.param(name, marks=marks) for name, (_, _, marks) in BACKENDS.items()]
)
def test_conformance(variant: str, world_size: int, case: str) -> None:
    if not _gpu_world_ok(BACKENDS[variant][0], world_size):
        pytest.skip(f"needs {world_size} CUDA devices")
    reports = _reports(variant, world_size)
    problems = {rank: rep[case] for rank, rep in enumerate(reports) if rep[case] is not None}
    assert not problems, f"{case} failed on ranks {sorted(problems)}: {problems}"
