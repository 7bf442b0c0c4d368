"""`ViewsNode`: the autograd node between a unit's gathered buffer and the parameter views
one forward application computes with (Note [parameter views] in ``_unit_views.py``).

Note [one node per application]
    Each forward application of a unit cuts its parameter views from the group's autograd
    leaf with one custom autograd function. In backward that node receives every
    parameter's gradient (None for a parameter this application did not reach) and hands
    them to the unit (`ReducePart.on_param_grads`), returning nothing to the leaf. Before,
    the views came from ``split_with_sizes`` on the leaf: autograd concatenated the
    per-parameter gradients into a flat gradient in the parameter dtype, the leaf's
    post-accumulate hook took it, and the reduction then copied (and cast) it again into
    rank-major order. Now the unit writes the per-parameter gradients straight into the
    rank-major reduce-scatter input, cast on the way (Note [one gradient pass] in
    ``_unit_reduce.py``): the flat gradient (its bytes written and read again, 4 per bf16
    parameter) is gone.

    The node also decides where gradients go in pipelining's weight pass (Note [split
    backward]): when the unit stays gathered, the parameters registered after the forward
    are inputs of the node too, and a backward in which autograd will not run the leaf's
    accumulator (a pass that asks only for the registered parameters) gets their gradients.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from ._unit_gather import GroupRuntime

__all__ = ["Application", "ViewsNode"]


class Application:
    """One forward application of a group: what its node needs in backward."""

    __slots__ = ("index", "group", "uses", "leaf", "counted", "registered", "owner")

    def __init__(
        self,
        index: int,
        group: GroupRuntime,
        uses: list[int],
        leaf: torch.Tensor,
        counted: bool,
        registered: bool,
        owner: Any,
    ) -> None:
        self.index = index
        self.group = group
        self.uses = uses  # the leaf's count of applications not yet delivered
        self.leaf = leaf
        # False for a recompute inside backward of an application still pending (activation
        # checkpointing): it is the same application, counted once.
        self.counted = counted
        self.registered = registered  # the registered parameters are inputs too
        self.owner = owner  # the unit: `on_param_grads`, `registered_grads_arrived`


class ViewsNode(torch.autograd.Function):
    """Cuts the parameter views from the leaf; in backward hands their gradients to the unit
    (Note [one node per application])."""

    @staticmethod
    def forward(
        ctx: Any, app: Application, leaf: torch.Tensor, *registered: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        ctx.app = app
        ctx.set_materialize_grads(False)  # None stays None: Note [unused parameters]
        layout = app.group.flat.layout
        pieces = leaf.split_with_sizes(layout.split_sizes)
        return tuple(
            pieces[i] if len(shape) == 1 else pieces[i].view(shape)
            for i, shape in zip(layout.param_pieces, layout.shapes)
        )

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        app = ctx.app
        if app.registered and not torch._C._will_engine_execute_node(ctx.next_functions[0][0]):
            # A pass toward the registered parameters only (Note [split backward]).
            app.owner.registered_grads_arrived(app.group)
            return (None, None, *grads)
        app.owner.on_param_grads(app, grads)
        if app.registered:
            return (None, None, *((None,) * len(grads)))
        return (None, None)
