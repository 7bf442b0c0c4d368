"""What ``torch.distributed.pipelining`` reads of torch's private FSDP state.

Note [pipelining's reduce step]
    A pipeline stage runs each micro-batch's backward without gradient sync and, after the
    last one (its ``REDUCE_GRAD`` action, ``_PipelineStageBase.perform_reduce_grad`` in
    torch 2.13), turns sync back on and reaches into torch's private state:
    ``fully_shard.state(module)._state_ctx.all_states[*]._fsdp_param_groups[*]
    .post_backward()``, then ``._root_post_backward_final_callback()``. Every schedule does
    this (GPipe, 1F1B, interleaved, zero-bubble), so without an answer there every pipeline
    over this engine ended in ``AttributeError: 'NoneType' object has no attribute
    '_state_ctx'``. `fully_shard` therefore registers, where torch's ``fully_shard.state``
    looks (the module's composable-API state dict), a small object with those names: the
    per-group ``post_backward`` does nothing (this engine reduces per unit, not per group),
    and the final callback runs the end of a backward pass once more with sync on: the
    gradients every micro-batch left pending (unreduced accumulations, and the ``.grad``
    that zero-bubble weight passes set on the registered parameters, Note [split backward]
    in ``_unit_views.py``) are reduced, and units reshard as the stage asked. Measured by
    ``tests/integration/test_pipelining.py`` against one process, on every schedule; torch
    2.13's own FSDP2 gives wrong gradients under the zero-bubble schedules there.
"""

from __future__ import annotations

import importlib
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from torch import nn

if TYPE_CHECKING:
    from ._state import FSDPState

__all__ = ["register_for_pipelining"]


class _NoGroupWork:
    """A torch ``FSDPParamGroup`` stand-in: this engine has nothing to do per group."""

    def post_backward(self, *unused: Any) -> None:
        return None


class _PipeliningState:
    """Answers ``fully_shard.state(stage_module)`` for ``torch.distributed.pipelining``."""

    def __init__(self, state: FSDPState) -> None:
        self._state = state
        self._state_ctx = SimpleNamespace(
            all_states=[SimpleNamespace(_fsdp_param_groups=[_NoGroupWork()])]
        )

    def _root_post_backward_final_callback(self) -> None:
        self._state.finish_backward_now()


def _torch_state_slot() -> tuple[str, Any] | None:
    """Where torch's ``fully_shard.state(module)`` looks: (the state dict's attribute name,
    the key in it), or None on a torch that keeps it elsewhere."""
    try:
        # The submodule, not the function the package exports under the same name.
        contract = importlib.import_module("torch.distributed._composable.contract")
        from torch.distributed.fsdp import fully_shard as torch_fully_shard
    except ImportError:
        return None
    key = getattr(contract, "STATE_KEY", None)
    func = getattr(torch_fully_shard, "__wrapped__", None)
    if not isinstance(key, str) or func is None:
        return None
    return key, func


_SLOT = _torch_state_slot()


def register_for_pipelining(module: nn.Module, state: FSDPState) -> None:
    """Make torch's ``fully_shard.state(module)`` answer what pipelining asks (Note
    [pipelining's reduce step])."""
    if _SLOT is None:
        return
    key, func = _SLOT
    module.__dict__.setdefault(key, {})[func] = _PipeliningState(state)
