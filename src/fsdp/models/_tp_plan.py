"""Tensor-parallel plans for the built-in GPT (`fsdp.models._gpt`) and Llama (`fsdp.models._llama`).

`parallelize(model, tp_mesh)` cuts every block and the root modules (embeddings, final norm,
output head) over a 1-D tensor-parallel DeviceMesh with ``torch.distributed.tensor.parallel``,
Megatron-style, as torchtitan's Llama plan does; then `fsdp_engine.fully_shard` over the
data-parallel mesh shards what each rank holds::

    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    parallelize(model, mesh["tp"])                 # sequence parallel on by default
    for block in model.blocks:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])

In each block the projections into the heads and into the MLP are column-parallel (each tp
rank computes its heads and its share of the hidden units), the projections back are
row-parallel (partial sums, reduced). With sequence parallelism (the default) the activations
between blocks stay cut along the sequence: norms run on each rank's ``seq / tp`` tokens, an
all-gather of the sequence feeds the column-parallel projections and a reduce-scatter leaves
the row-parallel ones (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models"). Without it the activations between blocks are whole on every rank and
the row-parallel outputs are all-reduced.

Note [fused projections under tensor parallelism]
    The models fuse projections into one Linear: GPT's ``qkv`` and Llama's ``wqkv`` hold
    ``[q; k; v]`` (3 x d rows), Llama's ``w13`` holds ``[gate; up]``. A plain column cut of
    such a weight would give tp rank 0 all of q and part of k. `FusedColwiseParallel` cuts
    each part on its own: tp rank ``t`` holds ``[q_t; k_t; v_t]`` (its heads of each), so
    ``qkv(x).chunk(3, dim=-1)`` on the rank's output yields its heads' q, k and v, exactly as
    the unsplit model's ``chunk`` does at tp 1. To stay a plain ``Shard(0)`` DTensor (which
    the engine, DCP and optimizers handle), the parameter holds its rows in that interleaved
    order: its global value (``full_tensor()``, a checkpoint) is the model's weight with
    rows permuted by a rule that depends on the tp size. The computation is unchanged (the
    tests compare losses with and without tensor parallelism); a checkpoint saved at one tp
    size must be resumed at the same one (``fsdp train`` records the tp size and refuses
    another). `unfuse_rows` undoes the permutation on a gathered tensor.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from ._gpt import GPT, Block, GPTConfig
from ._llama import Llama, LlamaBlock, LlamaConfig

__all__ = [
    "FusedColwiseParallel",
    "parallelize",
    "block_plan",
    "root_plan",
    "check_tp_size",
    "fuse_rows",
    "unfuse_rows",
    "tp_model_problem",
    "device_meshes",
]


def fuse_rows(weight: torch.Tensor, parts: int, tp: int) -> torch.Tensor:
    """``weight``'s rows reordered so that each of ``tp`` contiguous row blocks holds that
    tp rank's share of each of the ``parts`` fused parts (Note [fused projections under tensor
    parallelism]): ``[p0_0; p1_0; ...; p0_1; p1_1; ...]``."""
    rows = weight.shape[0]
    if rows % (parts * tp):
        raise ValueError(
            f"fuse_rows: weight's rows must divide into parts ({parts}) x tp "
            f"({tp}) equal blocks, got {rows} rows"
        )
    tail = weight.shape[1:]
    return (
        weight.reshape(parts, tp, rows // (parts * tp), *tail).transpose(0, 1).reshape(rows, *tail)
    )


def unfuse_rows(weight: torch.Tensor, parts: int, tp: int) -> torch.Tensor:
    """The inverse of `fuse_rows`: the model's own row order from the tp-interleaved one."""
    rows = weight.shape[0]
    if rows % (parts * tp):
        raise ValueError(
            f"unfuse_rows: weight's rows must divide into parts ({parts}) x tp "
            f"({tp}) equal blocks, got {rows} rows"
        )
    tail = weight.shape[1:]
    return (
        weight.reshape(tp, parts, rows // (parts * tp), *tail).transpose(0, 1).reshape(rows, *tail)
    )


class FusedColwiseParallel(ColwiseParallel):
    """`ColwiseParallel` for a Linear whose output is ``parts`` projections side by side
    (``[q; k; v]``: 3, ``[gate; up]``: 2): each tp rank gets its share of every part, so
    ``output.chunk(parts, dim=-1)`` on its local output gives its share of each (Note [fused
    projections under tensor parallelism]). Other arguments as `ColwiseParallel`'s."""

    def __init__(self, parts: int, **kwargs: Any) -> None:
        if isinstance(parts, bool) or not isinstance(parts, int) or parts < 1:
            raise ValueError(
                f"FusedColwiseParallel: parts must be an int >= 1 (the projections "
                f"fused in the Linear), got {parts!r}"
            )
        super().__init__(**kwargs)
        self.parts = parts

    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: Any) -> None:
        tp = device_mesh.size()
        for pname, param in list(module.named_parameters(recurse=False)):
            fused = fuse_rows(param.detach(), self.parts, tp)
            dist = distribute_tensor(
                fused, device_mesh, [Shard(0)], src_data_rank=self.src_data_rank
            )
            module.register_parameter(pname, nn.Parameter(dist, requires_grad=param.requires_grad))

    def __repr__(self) -> str:
        return f"FusedColwiseParallel(parts={self.parts}, {super().__repr__()})"


def _rule(owner: str, argument: str, value: int, tp: int, why: str) -> str | None:
    if value % tp:
        return (
            f"{owner}.{argument} must be divisible by the tensor-parallel size {tp} "
            f"({why}), got {value}"
        )
    return None


def tp_model_problem(
    config: GPTConfig | LlamaConfig,
    tp: int,
    *,
    seq_len: int | None = None,
    sequence_parallel: bool = True,
) -> str | None:
    """Why ``config`` cannot be cut over ``tp`` ranks (the argument, the rule and the value),
    or None. ``seq_len``: the sequence length trained on (sequence parallelism cuts it)."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        return f"tp must be an int >= 1 (ranks per tensor-parallel group), got {tp!r}"
    # The widths follow: d_model (dim) = n_heads x head_dim, and the MLP's 4 x d_model.
    if isinstance(config, GPTConfig):
        owner = "GPTConfig"
        checks = [
            ("n_heads", config.n_heads, "each rank computes n_heads / tp heads"),
            (
                "vocab_size",
                config.vocab_size,
                "the embedding and output head are cut by vocabulary rows",
            ),
        ]
        if config.tie_embeddings:
            return (
                "GPTConfig.tie_embeddings must be False under tensor parallelism (the "
                "embedding is cut by rows for lookups and the head by rows for outputs, "
                "each its own DTensor), got True"
            )
        if sequence_parallel:
            checks.append(
                (
                    "seq_len",
                    config.seq_len,
                    "the position table is cut by sequence positions under sequence parallelism",
                )
            )
    elif isinstance(config, LlamaConfig):
        owner = "LlamaConfig"
        checks = [
            ("n_heads", config.n_heads, "each rank computes n_heads / tp heads"),
            ("ffn_dim", config.ffn_dim, "each rank computes ffn_dim / tp hidden units"),
            (
                "vocab_size",
                config.vocab_size,
                "the embedding and output head are cut by vocabulary rows",
            ),
        ]
    else:
        raise TypeError(f"config must be a GPTConfig or a LlamaConfig, got {type(config).__name__}")
    for argument, value, why in checks:
        problem = _rule(owner, argument, value, tp, why)
        if problem is not None:
            return problem
    if sequence_parallel and seq_len is not None and seq_len % tp:
        return (
            f"seq_len must be divisible by the tensor-parallel size {tp} under sequence "
            f"parallelism (each rank holds seq_len / tp tokens between blocks), got "
            f"{seq_len}"
        )
    return None


def check_tp_size(
    config: GPTConfig | LlamaConfig,
    tp: int,
    *,
    seq_len: int | None = None,
    sequence_parallel: bool = True,
) -> None:
    """Raise ValueError (naming the argument, the rule and the value) if ``config`` cannot be
    cut over ``tp`` tensor-parallel ranks; see `tp_model_problem`."""
    problem = tp_model_problem(config, tp, seq_len=seq_len, sequence_parallel=sequence_parallel)
    if problem is not None:
        raise ValueError(problem)


def block_plan(block: nn.Module, *, sequence_parallel: bool = True) -> dict[str, Any]:
    """The plan of one GPT `Block` or `LlamaBlock` (module name -> ParallelStyle), for
    ``parallelize_module(block, tp_mesh, plan)``.

    Input and output of the block: each rank's ``seq / tp`` tokens with sequence parallelism
    (a local tensor, ``Shard(1)`` of the sequence), the whole activation otherwise."""
    seq = Shard(1) if sequence_parallel else None
    row_out = Shard(1) if sequence_parallel else None

    def col(parts: int = 1) -> Any:
        if parts == 1:
            return ColwiseParallel(input_layouts=seq)
        return FusedColwiseParallel(parts, input_layouts=seq)

    if isinstance(block, Block):
        plan = {
            "qkv": col(3),
            "proj": RowwiseParallel(output_layouts=row_out),
            "fc": col(),
            "out": RowwiseParallel(output_layouts=row_out),
        }
        norms = ("ln1", "ln2")
    elif isinstance(block, LlamaBlock):
        plan = {
            "wqkv": col(3),
            "wo": RowwiseParallel(output_layouts=row_out),
            "w13": col(2),
            "w2": RowwiseParallel(output_layouts=row_out),
        }
        norms = ("attn_norm", "mlp_norm")
    else:
        raise TypeError(f"block must be a fsdp GPT Block or LlamaBlock, got {type(block).__name__}")
    if sequence_parallel:
        plan.update({n: SequenceParallel() for n in norms})
    return plan


def root_plan(model: nn.Module, *, sequence_parallel: bool = True) -> dict[str, Any]:
    """The plan of a `GPT`'s or `Llama`'s own modules: embeddings cut by vocabulary rows
    (their outputs ``Shard(1)`` of the sequence with sequence parallelism; GPT's position
    table cut by positions to match), the final norm sequence-parallel, the output head
    column-parallel with its logits gathered whole on every rank (``Replicate``)."""
    seq = Shard(1) if sequence_parallel else Replicate()
    head = ColwiseParallel(input_layouts=seq, output_layouts=Replicate())
    embed = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
    if isinstance(model, GPT):
        plan: dict[str, Any] = {
            "tok": embed,
            "head": head,
            # arange(t) -> (t, d): its rows are the sequence, cut as the tokens' are
            "pos": RowwiseParallel(
                input_layouts=Replicate(),
                output_layouts=Shard(0) if sequence_parallel else Replicate(),
            ),
        }
        norm = "ln_f"
    elif isinstance(model, Llama):
        plan = {"embed": embed, "head": head}
        norm = "norm"
    else:
        raise TypeError(f"model must be a fsdp GPT or Llama, got {type(model).__name__}")
    if sequence_parallel:
        plan[norm] = SequenceParallel()
    return plan


def parallelize(
    model: GPT | Llama, tp_mesh: Any, *, sequence_parallel: bool = True, seq_len: int | None = None
) -> GPT | Llama:
    """Cut ``model`` (a `GPT` or `Llama`, unsharded, on the mesh's device) over ``tp_mesh``
    (a 1-D DeviceMesh, ``mesh["tp"]``): every block by `block_plan`, the root by `root_plan`.
    In place; returns ``model``. Checks sizes first (`check_tp_size`; ``seq_len``: the length
    trained on, default the model's). Every rank must start from the same weights: each takes
    rank 0's (``distribute_tensor``'s ``src_data_rank``)."""
    if not isinstance(model, (GPT, Llama)):
        raise TypeError(f"model must be a fsdp GPT or Llama, got {type(model).__name__}")
    if getattr(tp_mesh, "ndim", None) != 1:
        raise ValueError(f"tp_mesh must be a 1-D DeviceMesh (mesh['tp']), got {tp_mesh!r}")
    check_tp_size(
        model.cfg,
        tp_mesh.size(),
        seq_len=seq_len or model.cfg.seq_len,
        sequence_parallel=sequence_parallel,
    )
    for block in model.blocks:
        parallelize_module(block, tp_mesh, block_plan(block, sequence_parallel=sequence_parallel))
    parallelize_module(model, tp_mesh, root_plan(model, sequence_parallel=sequence_parallel))
    return model


def device_meshes(
    device_type: str,
    world_size: int,
    tp: int,
    strategy: str = "full_shard",
    *,
    shard_size: int | None = None,
) -> tuple[Any, Any]:
    """The DeviceMeshes of FSDP x TP over the default process group: ``(fsdp_mesh,
    tp_mesh)`` to pass as ``fully_shard(..., mesh=fsdp_mesh)`` and ``parallelize(model,
    tp_mesh)``. Collective: every rank calls it alike.

    The ``world_size // tp`` data-parallel ranks are laid out as ``strategy`` lays out a
    world (`fsdp_engine.strategy_mesh_shape`): ``(dp, tp)`` named ``("dp", "tp")`` for
    full_shard and shard_grad_op (``fsdp_mesh = mesh["dp"]``); ``(replicate, shard, tp)``
    named ``("replicate", "shard", "tp")`` for hybrid_shard and no_shard (``fsdp_mesh =
    mesh["replicate", "shard"]``). A tp group is ``tp`` consecutive ranks, so on GPUs it stays
    inside a node when ``tp`` divides the GPUs per node."""
    from fsdp_engine import strategy_mesh_shape
    from torch.distributed.device_mesh import init_device_mesh

    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp must be an int >= 1 (ranks per tensor-parallel group), got {tp!r}")
    if world_size % tp:
        raise ValueError(
            f"tp ({tp}) must divide the world size {world_size} (dp = world size "
            f"/ tp), got world size {world_size}"
        )
    dp = world_size // tp
    shape = strategy_mesh_shape(strategy, dp, shard_size=shard_size)
    if strategy in ("hybrid_shard", "no_shard"):
        mesh = init_device_mesh(
            device_type,
            (shape.replicate, shape.shard, tp),
            mesh_dim_names=("replicate", "shard", "tp"),
        )
        return mesh["replicate", "shard"], mesh["tp"]
    mesh = init_device_mesh(device_type, (dp, tp), mesh_dim_names=("dp", "tp"))
    return mesh["dp"], mesh["tp"]
