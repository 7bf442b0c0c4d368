"""`fsdp plan --tp N` against runs of `fsdp.models.parallelize` under the engine, and its exact
figures.

One launch of 4 ranks (dp 2 x tp 2, gloo) builds the tiny GPT (with and without sequence
parallelism, with activation checkpointing) and the tiny Llama (with sequence parallelism, and
without it but with activation checkpointing) as ``fsdp train --tp 2`` does, takes one AdamW
step on a micro-batch of 2 sequences per dp rank, and records (a) the bytes each rank keeps (sharded
parameters, gradients, optimizer state), (b) the engine's collectives over the dp group
(counted at `fsdp_comm.Backend`) and (c) the tensor-parallel collectives torch's DTensor issues
(counted at its functional collectives): calls and bytes of each kind. The plan predicts all
three exactly (2026-11-27, torch 2.13). Then the plan's
figures for a small config are checked number by number, and bad ``--tp`` values are named.
"""

from __future__ import annotations

import functools
from collections import Counter
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from fsdp_comm import launch

from fsdp.plan import PlanError, plan
from fsdp.plan._cli import main

from ..forkserver_preload import warm_forkserver

#: torch 2.11's DTensor cannot run the sequence-parallel plan (as the engine's TP tests find):
#: the runs are checked on torch >= 2.13 only.
needs_torch_2_13 = pytest.mark.skipif(
    tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) < (2, 13),
    reason="tensor parallelism runs need torch >= 2.13 (DTensor's sequence-parallel ops)",
)

VARIANTS = (
    ("tiny", True, False),
    ("tiny", False, False),
    ("llama-tiny", True, False),
    ("tiny", True, True),
    ("llama-tiny", False, True),
)
MICRO_BATCH = 2
KINDS = {
    "all_gather_into_tensor": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "all_reduce": "all_reduce",
}


def _dtensor_counter(counts: Counter[str]) -> Any:
    """A dispatch mode adding up torch's functional collectives (DTensor's): calls and
    full-tensor bytes (an all-gather's output, a reduce-scatter's input, an all-reduce's
    tensor), per kind."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __torch_dispatch__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            out = func(*args, **(kwargs or {}))
            kind = KINDS.get(func.__name__.split(".")[0])
            if kind is not None and func.namespace == "_c10d_functional":
                full = out if kind == "all_gather" else args[0]
                counts[f"tp {kind}.calls"] += 1
                counts[f"tp {kind}.bytes"] += full.numel() * full.element_size()
            return out

    return Count()


def _count_backend(counts: Counter[str]) -> None:
    """Count the engine's collectives (over the dp group) at `fsdp_comm.Backend`."""
    from fsdp_comm import Backend

    def wrap(name: str, full_arg: int) -> None:
        original = getattr(Backend, name)

        def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
            t = args[full_arg]
            counts[f"dp {KINDS[name]}.calls"] += 1
            counts[f"dp {KINDS[name]}.bytes"] += t.numel() * t.element_size()
            return original(self, *args, **kwargs)

        setattr(Backend, name, counted)

    wrap("all_gather_into_tensor", 0)
    wrap("reduce_scatter_tensor", 1)
    wrap("all_reduce", 0)


def _measure(
    model_name: str, sequence_parallel: bool, checkpointing: bool, mesh: Any, counts: Counter[str]
) -> dict[str, Any]:
    from fsdp_engine import fully_shard, sharded_layout
    from torch.distributed.tensor import DTensor

    from fsdp.models import GPT, Llama, parallelize
    from fsdp.train._train import TRAIN_MODELS

    cfg = TRAIN_MODELS[model_name]
    torch.manual_seed(0)
    model = GPT(cfg) if model_name == "tiny" else Llama(cfg)  # type: ignore[arg-type]
    model.activation_checkpointing = checkpointing
    parallelize(model, mesh["tp"], sequence_parallel=sequence_parallel)
    for block in model.blocks:  # the plan's model: every block freed after forward
        fully_shard(block, mesh=mesh["dp"], reshard_after_forward=True)
    fully_shard(model, mesh=mesh["dp"])
    g = torch.Generator().manual_seed(mesh["dp"].get_local_rank())
    x = torch.randint(0, cfg.vocab_size, (MICRO_BATCH, cfg.seq_len + 1), generator=g)
    # The plan is per step: the first step's lazy init also agrees on the shard layout once
    # (Note [layout agreement] in fsdp_engine: one all-reduce of 10 int64), so count the next.
    F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()).backward()
    model.zero_grad(set_to_none=True)
    counts.clear()
    with _dtensor_counter(counts):
        F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()).backward()
    collectives = dict(counts)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt.step()

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if isinstance(t, DTensor) else t

    return {
        "collectives": collectives,
        "params": sum(s.local.numel() * s.local.element_size() for s in sharded_layout(model)),
        "grads": sum(local(p.grad).numel() * 4 for p in model.parameters() if p.grad is not None),
        "optimizer": sum(
            local(t).numel() * t.element_size()
            for st in opt.state.values()
            for t in st.values()
            if t.dim() > 0
        ),
    }


def _rank(backend: Any) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    del backend
    torch.set_num_threads(1)
    counts: Counter[str] = Counter()
    _count_backend(counts)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    return {f"{m}-{sp}-{ac}": _measure(m, sp, ac, mesh, counts) for m, sp, ac in VARIANTS}


@functools.cache
def _measured() -> list[dict[str, Any]]:
    warm_forkserver()
    return launch(_rank, 4, backend="torch", timeout=300)


def _planned(model_name: str, sequence_parallel: bool, checkpointing: bool) -> dict[str, Any]:
    p = plan(
        model_name,
        gpus=4,
        gpus_per_node=4,
        tp=2,
        sequence_parallel=sequence_parallel,
        micro_batch=MICRO_BATCH,
        activation_checkpointing=checkpointing,
    )
    want: Counter[str] = Counter()
    for c in p.comm.collectives:
        dim = "tp" if c.dim == "tp" else "dp"
        want[f"{dim} {c.kind}.calls"] += c.calls
        want[f"{dim} {c.kind}.bytes"] += c.buffer_bytes
    return {
        "collectives": dict(want),
        "params": p.memory.sharded_params,
        "grads": p.memory.gradients,
        "optimizer": p.memory.optimizer_state,
    }


@needs_torch_2_13
@pytest.mark.parametrize(
    "model_name, sequence_parallel, checkpointing",
    VARIANTS,
    ids=[f"{m}-{'sp' if sp else 'nosp'}{'-ac' if ac else ''}" for m, sp, ac in VARIANTS],
)
def test_plan_matches_a_tp_run(
    model_name: str, sequence_parallel: bool, checkpointing: bool
) -> None:
    want = _planned(model_name, sequence_parallel, checkpointing)
    for rank, every in enumerate(_measured()):
        got = every[f"{model_name}-{sequence_parallel}-{checkpointing}"]
        assert got["collectives"] == want["collectives"], rank
        for key in ("params", "grads", "optimizer"):
            assert got[key] == want[key], (rank, key, got[key], want[key])


def test_plan_figures_for_a_small_config(capsys: pytest.CaptureFixture[str]) -> None:
    """The tiny GPT (2 blocks, d 64, 4 heads, vocab 256, 64 tokens) on 8 GPUs of one node:
    tp 2 x dp 4 with sequence parallelism, fp32, micro-batch 2 (128 tokens per rank)."""
    p = plan("tiny", gpus=8, tp=2, micro_batch=2)
    assert (p.config.dp, p.shard_group, p.replicas) == (4, 4, 1)
    tokens, d, e = 128, 64, 4
    act = tokens * d * e  # 32 KiB: one activation of a rank's micro-batch
    comm = {c.name: (c.calls, c.buffer_bytes, c.group_size, c.dim) for c in p.comm.collectives}
    # per block 2 gathers and 2 scatters forward, as many backward; the root's one of each;
    # the position table's one of each (64 positions x d)
    assert comm["tp all-gather (act.)"] == (4 * 2 + 2 + 1, 10 * act + 64 * d * e, 2, "tp")
    assert comm["tp reduce-scatter"] == (11, 10 * act + 64 * d * e, 2, "tp")
    assert comm["tp all-reduce (norms)"] == (10, 10 * d * e, 2, "tp")  # 4 per block, ln_f's 2
    assert comm["tp all-gather (logits)"] == (1, tokens * 256 * e, 2, "tp")
    # A block's tp pieces: ln1 and ln2 whole (2 x 128), qkv rows cut (96 x 64 + 96), proj
    # columns cut (64 x 32, bias 64 whole), fc rows cut (128 x 64 + 128), out columns cut
    # (64 x 128, bias 64): 25,184 elements, no padding over 4 dp ranks.
    block = 2 * 128 + 96 * 64 + 96 + 64 * 32 + 64 + 128 * 64 + 128 + 64 * 128 + 64
    root = 128 * 64 + 32 * 64 + 128 + 128 * 64  # tok, pos (rows cut), ln_f, head: 18,560
    assert (block, root) == (25_184, 18_560)
    assert comm["all-gather (forward)"] == (3, (block * 2 + root) * e, 4, "shard")
    assert comm["all-gather (backward)"] == (2, block * 2 * e, 4, "shard")
    assert comm["reduce-scatter"] == (3, (block * 2 + root) * e, 4, "shard")
    assert p.comm.dim_bytes("shard") == (2 * (2 * block + root) + 2 * block) * e * 3 // 4
    assert p.comm.dim_bytes("tp") == (2 * 344_064 + 2 * 2_560 + 131_072) // 2 == 412_160
    mem = p.memory
    assert mem.sharded_params == mem.gradients == (2 * block + root) * e // 4 == 68_928
    assert mem.optimizer_state == 8 * (2 * block + root) // 4 == 137_856
    # blocks: 16 / tp values of d per token each; root: 3 d cut by tp, logits whole + fp32
    assert mem.activations == 2 * 8 * tokens * d * e + tokens * (3 * d * e // 2 + 256 * 8)
    assert main(["--model", "tiny", "--gpus", "8", "--tp", "2", "--micro-batch", "2"]) == 0
    out = capsys.readouterr().out
    assert "tensor parallel tp=2 (sequence parallel) x dp=4" in out
    assert "  tp all-gather (act.)        11      2       0.16  intra-node" in out
    assert "by mesh dimension" in out and "shard 551.44 KiB, tp 402.5 KiB" in out


def test_without_sequence_parallelism() -> None:
    p = plan("llama-tiny", gpus=2, tp=2, sequence_parallel=False, activation_checkpointing=True)
    (ar,) = [c for c in p.comm.collectives if c.name == "tp all-reduce (act.)"]
    act = 64 * 64 * 4  # one 64-token sequence, d 64, fp32
    # 4 per block, the embedding's and the head input's, one more per block recomputed
    assert (ar.calls, ar.buffer_bytes) == (4 * 2 + 2 + 2, 12 * act)
    assert not [c for c in p.comm.collectives if c.dim == "shard"]  # dp 1: nothing to gather
    sp = plan("llama-tiny", gpus=2, tp=2, activation_checkpointing=True)
    assert sp.memory.activations < p.memory.activations


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"gpus": 4, "tp": 3},
            "tp: must divide gpus (4): the data-parallel size is gpus / tp, got 3",
        ),
        (
            {"gpus": 8, "tp": 8},
            "tp: must divide the model's attention heads (4): each tp rank "
            "computes attention heads / tp of them, got 8",
        ),
        (
            {"gpus": 6, "tp": 3, "model": "llama-tiny"},
            "tp: must divide the model's attention heads (4)",
        ),
        ({"gpus": 4, "tp": 0}, "tp: must be an int >= 1, got 0"),
        (
            {"gpus": 4, "tp": 2, "seq_len": 63},
            "tp: must divide the sequence length (63) under sequence parallelism",
        ),
    ],
)
def test_bad_tp_is_named(kwargs: dict[str, Any], message: str) -> None:
    model = kwargs.pop("model", "tiny")
    with pytest.raises(PlanError) as info:
        plan(model, **kwargs)
    assert str(info.value).startswith(message), str(info.value)


def test_cli_tp_errors(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--model", "tiny", "--gpus", "4", "--tp", "3"])
    assert "argument --tp: must divide gpus (4)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--model", "tiny", "--gpus", "4", "--no-sequence-parallel"])
    assert "--no-sequence-parallel: applies with --tp N >= 2 only" in capsys.readouterr().err


def test_large_preset_divides_by_tp() -> None:
    """Llama 3 70B at tp 8: each rank holds about an eighth of every block (norms whole)."""
    full = plan("llama3-70b", gpus=64, strategy="full_shard")
    tp8 = plan("llama3-70b", gpus=64, tp=8)
    # F = 64 without tp, F = 8 x (1/8 of each unit) with it: the same sharded bytes per GPU,
    # give or take the norms every tp rank keeps and the padding
    assert (
        abs(tp8.memory.sharded_params - full.memory.sharded_params)
        < 0.001 * full.memory.sharded_params
    )
    assert tp8.memory.unsharded_params < full.memory.unsharded_params / 7
    assert tp8.comm.dim_bytes("tp") > 0 and not tp8.comm.cross_node_bytes == 0
