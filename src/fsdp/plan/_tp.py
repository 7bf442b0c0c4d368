"""Tensor parallelism in `fsdp plan` (``--tp N``): what each rank holds, and what the tp
group exchanges per step.

Memory. Tensor parallelism cuts each parameter first (`fsdp.plan._model.TensorCuts`:
column-parallel weights by rows, row-parallel ones by columns, embeddings and the head by
vocabulary rows; norms and row-parallel biases whole on every tp rank), and FSDP then shards
what each rank holds over its data-parallel group, so every FSDP formula applies to the
per-rank pieces (`per_rank`): a unit gathers and reduce-scatters about ``1/N`` of its bytes.
Activations saved per block (Korthikanti et al. 2022, "Reducing Activation Recomputation in
Large Transformer Models", Sections 4.2.2-4.2.3): with sequence parallelism all of the block's
``16`` values of ``d_model`` per token are cut ``N`` ways; without it the norms' and the
projections' inputs stay whole (``4`` of the 16) and the rest is cut: ``4 + 12 / N``.

Communication of the tp group per micro-batch, for ``L`` blocks of ``A = tokens x d_model``
activations in the compute dtype (the counts ``fsdp train --tp`` issues, checked by
``tests/integration/test_plan_tp.py`` against torch's DTensor collectives):

- sequence parallel: per block an all-gather of the sequence before attention and before the
  MLP, and a reduce-scatter after each, in forward; the same again in backward (each one's
  gradient is the other): ``4L`` all-gathers and ``4L`` reduce-scatters of ``A``. The root
  adds one of each (the embedding's output cut by sequence, the head's input gathered), and
  learned positions one of each of ``seq x d_model``. Norm weights are whole on every rank
  but see only its tokens: each one's gradient is all-reduced.
- without it: an all-reduce after each row-parallel projection in forward and before each
  column-parallel one in backward, ``4L`` of ``A``, and the root's two (the embedding's
  output, the head's input gradient), plus learned positions' one.
- the head's logits are gathered whole for the loss: one all-gather of ``tokens x vocab``.
- activation checkpointing recomputes each block's forward up to its last saved activation:
  the collectives before it again (2 all-gathers and a reduce-scatter with sequence
  parallelism, one all-reduce without).
"""

from __future__ import annotations

import math
from dataclasses import replace
from fractions import Fraction
from typing import TYPE_CHECKING

from ._base import ACTIVATION_VALUES_PER_TOKEN, PlanError, Shape, dtype_bytes
from ._model import ModelShape, TensorCuts

if TYPE_CHECKING:
    from ._comm import Collective
    from ._memory import PlanConfig

__all__ = [
    "per_rank",
    "tp_problem",
    "tp_collectives",
    "block_activation_values",
    "REPLICATED_VALUES",
]

#: Of a block's `ACTIVATION_VALUES_PER_TOKEN`, those tensor parallelism without sequence
#: parallelism keeps whole on every rank: the two norms' inputs and the two column-parallel
#: projections' inputs (Korthikanti et al.'s ``10 s b h`` bytes less the two dropout masks).
REPLICATED_VALUES = 4


def _piece(shape: Shape, cut: str, tp: int) -> Shape:
    """The largest tp rank's piece of a parameter (torch.chunk's rule: ``ceil(n / tp)``)."""
    dim = {"rows": 0, "cols": 1}.get(cut)
    if dim is None or tp == 1:
        return shape
    if dim >= len(shape):
        dim = 0
    return (*shape[:dim], -(-shape[dim] // tp), *shape[dim + 1 :])


def per_rank(model: ModelShape, tp: int) -> ModelShape:
    """``model`` as one tp rank holds it: every parameter its tp piece (the largest rank's,
    for a count that does not divide), which FSDP then shards. Without `TensorCuts` (a bare
    parameter count) every parameter is cut ``tp`` ways."""
    if tp == 1:
        return model
    cuts = model.cuts or TensorCuts(
        ("rows",) * len(model.block_params), ("rows",) * len(model.root_params)
    )
    block = tuple(_piece(s, c, tp) for s, c in zip(model.block_params, cuts.block))
    root = tuple(_piece(s, c, tp) for s, c in zip(model.root_params, cuts.root))
    largest = None if model.largest_unit is None else -(-model.largest_unit // tp)
    return replace(model, block_params=block, root_params=root, largest_unit=largest)


def tp_problem(
    model: ModelShape, tp: int, sequence_parallel: bool, seq_len: int
) -> PlanError | None:
    """The error for a tp size that does not divide the model's heads or FFN width (or, with
    sequence parallelism, the sequence), naming ``tp``, the rule and the value; or None."""
    if tp == 1:
        return None
    for what, count in model.cuts.counts if model.cuts else ():
        if count % tp:
            return PlanError(
                "tp",
                f"must divide the model's {what} ({count}): each tp rank "
                f"computes {what} / tp of them, got {tp}",
            )
    if sequence_parallel and seq_len % tp:
        return PlanError(
            "tp",
            f"must divide the sequence length ({seq_len}) under sequence "
            f"parallelism (each tp rank holds seq_len / tp tokens between blocks), "
            f"got {tp}",
        )
    return None


def block_activation_values(tp: int, sequence_parallel: bool) -> Fraction:
    """Values of ``d_model`` per token one block saves on one rank (see the module)."""
    full = ACTIVATION_VALUES_PER_TOKEN
    if sequence_parallel:
        return Fraction(full, tp)
    return REPLICATED_VALUES + Fraction(full - REPLICATED_VALUES, tp)


def _norm_params(model: ModelShape) -> tuple[int, int]:
    """(norm parameters per block, in the root) and their elements in all."""
    if model.cuts is None:
        return 0, 0
    block = [math.prod(s) for s, c in zip(model.block_params, model.cuts.block) if c == "norm"]
    root = [math.prod(s) for s, c in zip(model.root_params, model.cuts.root) if c == "norm"]
    return len(block) * model.n_layers + len(root), sum(block) * model.n_layers + sum(root)


def tp_collectives(model: ModelShape, config: PlanConfig, tokens: int) -> list[Collective]:
    """The tp group's collectives of one step of ``tokens`` tokens per rank (see the module);
    none at ``tp == 1``."""
    from ._comm import Collective

    tp = config.tp
    if tp == 1:
        return []
    e = dtype_bytes(config.gather_dtype)
    act = tokens * model.d_model * e
    layers = model.n_layers
    positions = int(model.cuts is not None and model.cuts.positions)
    pos = tokens // config.micro_batch * model.d_model * e  # one sequence's positions
    cross = _tp_spans_nodes(config)
    ac = config.activation_checkpointing
    out: list[Collective] = []
    if config.sequence_parallel:
        gathers = 4 * layers + 2 + (2 * layers if ac else 0)
        scatters = 4 * layers + 2 + (layers if ac else 0)
        out += [
            Collective(
                "tp all-gather (act.)",
                "all_gather",
                gathers + positions,
                gathers * act + positions * pos,
                tp,
                cross,
                "tp",
            ),
            Collective(
                "tp reduce-scatter",
                "reduce_scatter",
                scatters + positions,
                scatters * act + positions * pos,
                tp,
                cross,
                "tp",
            ),
        ]
        calls, numel = _norm_params(model)
        if calls:
            out.append(
                Collective("tp all-reduce (norms)", "all_reduce", calls, numel * e, tp, cross, "tp")
            )
    else:
        reduces = 4 * layers + 2 + (layers if ac else 0)
        out.append(
            Collective(
                "tp all-reduce (act.)",
                "all_reduce",
                reduces + positions,
                reduces * act + positions * pos,
                tp,
                cross,
                "tp",
            )
        )
    out.append(
        Collective(
            "tp all-gather (logits)",
            "all_gather",
            1,
            tokens * model.vocab_size * e,
            tp,
            cross,
            "tp",
        )
    )
    return out


def _tp_spans_nodes(config: PlanConfig) -> bool:
    """A tp group is ``tp`` consecutive ranks: inside a node when ``tp`` divides the GPUs per
    node."""
    g = config.gpus_per_node
    return config.tp > g or g % config.tp != 0
