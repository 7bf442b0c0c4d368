"""The collectives a first iteration issues, as PyTorch's own FSDP2 tests count them
(``CommDebugMode``): on a 1-D mesh, all-gathers and reduce-scatters and no all-reduce, on both
implementations. Ours agrees on the shard layout at lazy init (Note [layout agreement]) with
one all-reduce that the count must not see (``test_gradient_accumulation`` of torch's suite
failed on it)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from fsdp_comm import launch

from .harness import IMPLS


def _first_iteration_counts(backend: Any, impl: str) -> dict[str, int]:
    from torch.distributed.tensor.debug import CommDebugMode

    if impl == "torch":
        from torch.distributed.fsdp import fully_shard
    else:
        from fsdp_engine import fully_shard
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(3)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    with CommDebugMode() as mode:
        model(torch.randn(4, 8)).sum().backward()
    c10d = torch.ops.c10d
    counts = mode.get_comm_counts()
    return {
        "all_reduce": counts[c10d.allreduce_],
        "all_gather": counts[c10d._allgather_base_],
        "reduce_scatter": counts[c10d._reduce_scatter_base_],
    }


@pytest.mark.parametrize("impl", IMPLS)
def test_first_iteration_has_no_all_reduce_on_a_1d_mesh(impl: str) -> None:
    for counts in launch(_first_iteration_counts, 2, backend="torch", args=(impl,), timeout=120):
        assert counts["all_reduce"] == 0, counts
        assert counts["all_gather"] > 0 and counts["reduce_scatter"] > 0, counts
