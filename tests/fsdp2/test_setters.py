"""FSDP2's tuning setters take torch 2.13's signatures on both implementations (keyword names,
``recurse=``) and refuse the same bad values with the same error types."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from fsdp_comm import launch

from .harness import IMPLS


def _setters(backend: Any, impl: str) -> dict[str, str]:
    if impl == "torch":
        from torch.distributed.fsdp import fully_shard
    else:
        from fsdp_engine import fully_shard
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 3))
    fully_shard(model[0])
    fully_shard(model)
    model.set_reduce_scatter_max_input_buffers(max_input_buffers=2, recurse=False)
    model.set_reduce_scatter_max_input_buffers(3)
    model.set_reduce_scatter_unused_params(reduce_scatter_unused_params=True, recurse=False)
    model.set_separate_reduce_scatter_group(enable=False, recurse=True)
    model.set_separate_reduce_scatter_group()
    errors = {}
    for bad in (0, True, 2.0):
        try:
            model.set_reduce_scatter_max_input_buffers(bad)
        except (TypeError, ValueError) as exc:
            errors[repr(bad)] = type(exc).__name__
    model(torch.randn(2, 4)).sum().backward()  # still trains after the setters
    return errors


@pytest.mark.parametrize("impl", IMPLS)
def test_tuning_setters_take_torch_213_signatures(impl: str) -> None:
    have = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    if impl == "torch" and have < (2, 13):
        pytest.skip(f"torch {torch.__version__}'s FSDPModule predates these signatures")
    (errors,) = launch(_setters, 1, backend="torch", args=(impl,), timeout=120)
    assert errors == {"0": "ValueError", "True": "TypeError", "2.0": "TypeError"}
