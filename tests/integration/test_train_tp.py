"""`fsdp train --tp N`: tensor parallelism (fsdp.models._tp_plan) under FSDP, against plain FSDP.

The tiny GPT and Llama at ``--tp 2`` over 4 ranks (dp 2) and 2 ranks (dp 1), with sequence
parallelism (the default) and without, on a 3-D hybrid mesh, with gradient accumulation and
with activation checkpointing and CPU offload: the losses of the first
steps equal those of ``fsdp train`` without ``--tp`` on the same global batch (one rank) within
`TOL`. Checkpoints resume exactly at the same tp size and at another dp size, and are refused
at another tp size. Bad combinations are refused before any rank starts, naming the flag, the
rule and the value.

Tolerance: fp32 throughout, so the runs differ only in the order of additions: a row-parallel
projection sums its tp ranks' partial products in a collective instead of inside one matmul,
and gradients are summed over dp ranks in another order. Each such difference is a few ulps
(~1e-7 relative); the losses of 4 steps agreed within 1e-6 in every run on this machine. AdamW
amplifies rounding only for gradient entries near zero (its first updates are about
``lr * sign(g)``), which moves a 3e-3 learning rate's step in a handful of the entries. `TOL`
= 1e-4 on losses near 5.5 leaves 100x margin, while a wrong cut (heads paired across ranks, a
missing reduction, ranks of one tp group reading different batches) moves the first or second
loss by 1e-3 or more.
"""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from fsdp._cli import main as fsdp_main
from fsdp.models import (
    LLAMA_SIZES,
    MODEL_SIZES,
    GPTConfig,
    check_tp_size,
    fuse_rows,
    tp_model_problem,
    unfuse_rows,
)
from fsdp.train import TrainConfig, run_training

from ..forkserver_preload import warm_forkserver
from ._corpus import write_corpus

#: torch 2.11's DTensor cannot run the sequence-parallel plan (as the engine's TP tests find):
#: the runs are checked on torch >= 2.13 only.
needs_torch_2_13 = pytest.mark.skipif(
    tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) < (2, 13),
    reason="tensor parallelism runs need torch >= 2.13 (DTensor's sequence-parallel ops)",
)

TOL = 1e-4
STEPS = 4
BASE = TrainConfig(
    model="tiny",
    steps=STEPS,
    global_batch=4,
    progress=False,
    lr=3e-3,
    threads_per_rank=1,
    backend="torch",
)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_corpus(tmp_path_factory.mktemp("corpus") / "stdlib.txt")


@pytest.fixture(scope="module")
def reference(corpus: str) -> dict[str, list[float]]:
    """Plain FSDP's losses (no --tp), one rank, the same global batch, per model."""
    cfg = replace(BASE, data=corpus, world_size=1, backend="threads")
    return {m: run_training(replace(cfg, model=m)).losses for m in ("tiny", "llama-tiny")}


def _close(got: list[float], want: list[float]) -> bool:
    return len(got) == len(want) and all(abs(a - b) <= TOL for a, b in zip(got, want))


@needs_torch_2_13
@pytest.mark.parametrize("model", ["tiny", "llama-tiny"])
@pytest.mark.parametrize("world", [4, 2])
def test_tp_matches_plain_fsdp(
    model: str, world: int, corpus: str, reference: dict[str, list[float]]
) -> None:
    warm_forkserver()
    got = run_training(replace(BASE, data=corpus, model=model, world_size=world, tp=2)).losses
    assert _close(got, reference[model]), (got, reference[model])
    assert got[-1] < got[0]


@needs_torch_2_13
@pytest.mark.parametrize(
    "options",
    [
        {"sequence_parallel": False},
        {"strategy": "hybrid_shard", "shard_size": 1},  # a (replicate 2, shard 1, tp 2) mesh
        {"sequence_parallel": False, "grad_accum": 2, "global_batch": 2},
        {"activation_checkpointing": True, "cpu_offload": True},
    ],
    ids=["no-sp", "hybrid-3d", "no-sp-accum", "checkpointing-offload"],
)
def test_tp_variants_match(
    options: dict[str, object], corpus: str, reference: dict[str, list[float]]
) -> None:
    warm_forkserver()
    cfg = replace(BASE, data=corpus, world_size=4, tp=2, **options)
    got = run_training(cfg).losses
    want = reference["tiny"]
    if cfg.grad_accum > 1:  # other batches: plain FSDP with the same accumulation
        want = run_training(
            replace(cfg, world_size=1, tp=1, backend="threads", sequence_parallel=True)
        ).losses
    assert _close(got, want), (got, want)


@needs_torch_2_13
def test_tp_meta_init_trains(corpus: str) -> None:
    """--meta-init with --tp: each unit initialised on its tp pieces (DTensor random ops), so
    the values are not the plain model's; the run trains (tests/fsdp2's
    test_param_init_fn_on_a_meta_tp_model checks that every rank assembles the same values)."""
    warm_forkserver()
    got = run_training(replace(BASE, data=corpus, world_size=2, tp=2, meta_init=True)).losses
    assert all(torch.isfinite(torch.tensor(got))) and got[-1] < got[0], got


def _fsdp_ckpt_stores_tp() -> bool:
    import fsdp_ckpt

    return getattr(fsdp_ckpt, "FORMAT_VERSION", 1) >= 2


@needs_torch_2_13
@pytest.mark.skipif(
    not _fsdp_ckpt_stores_tp(),
    reason="this fsdp-ckpt (index format 1) "
    "cannot store tensor-parallel parameters; --save with --tp is refused",
)
def test_tp_resume_exact(tmp_path: Path, corpus: str, reference: dict[str, list[float]]) -> None:
    """2 steps saved at (dp 2, tp 2), resumed to 4 at (dp 2, tp 2) and at (dp 1, tp 2):
    steps 3-4 as in an uninterrupted run; at tp 1 the checkpoint is refused."""
    warm_forkserver()
    first = tmp_path / "a"
    cfg = replace(BASE, data=corpus, world_size=4, tp=2)
    head = run_training(replace(cfg, steps=2, save=str(first))).losses
    assert _close(head, reference["tiny"][:2])
    second = tmp_path / "b"
    shutil.copytree(first, second)
    for world, path in ((4, first), (2, second)):
        tail = run_training(replace(cfg, world_size=world, resume=str(path), save=str(path))).losses
        assert _close(tail, reference["tiny"][2:]), (world, tail)
    with pytest.raises(ValueError, match=r"saved with --tp 2, and continues only at --tp 2"):
        run_training(
            replace(
                cfg,
                world_size=1,
                tp=1,
                backend="threads",
                resume=str(first),
                save=str(first),
                steps=6,
            )
        )
    import fsdp_ckpt  # its fused rows are tp-interleaved: no export as a plain model's state

    with pytest.raises(ValueError, match=r"cannot be exported as a whole model.*--tp 2"):
        fsdp_ckpt.export(str(first), str(tmp_path / "model.safetensors"))


@pytest.mark.skipif(
    _fsdp_ckpt_stores_tp(), reason="this fsdp-ckpt stores tensor-parallel parameters"
)
def test_tp_save_refused_without_ckpt_support(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    with pytest.raises(SystemExit):
        fsdp_main(["train", "--world-size", "2", "--tp", "2", "--save", str(tmp_path / "c")])
    assert "cannot store tensor-parallel parameters" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--world-size", "4", "--tp", "3"],
            "--tp 3 must divide --world-size 4 (the data-parallel size is the world size / --tp)",
        ),
        (["--tp", "0"], "--tp must be >= 1"),
        (
            ["--world-size", "2", "--tp", "2", "--backend", "threads"],
            "--tp 2 is not supported with --backend threads",
        ),
        (
            ["--world-size", "2", "--no-sequence-parallel"],
            "--no-sequence-parallel applies with --tp N >= 2 only",
        ),
        (
            ["--world-size", "8", "--tp", "8", "--model", "tiny"],
            "--tp 8 with --model tiny: GPTConfig.n_heads must be divisible by the tensor-parallel "
            "size 8 (each rank computes n_heads / tp heads), got 4",
        ),
        (
            ["--world-size", "4", "--tp", "2", "--global-batch", "3"],
            "--global-batch 3 must be divisible by the data-parallel size 2 (--world-size 4 / "
            "--tp 2)",
        ),
        (
            ["--world-size", "2", "--tp", "2", "--model", "tiny", "--seq-len", "63"],
            "seq_len must be divisible by the tensor-parallel size 2 under sequence parallelism",
        ),
        (
            ["--world-size", "8", "--tp", "2", "--strategy", "hybrid_shard", "--shard-size", "3"],
            "--shard-size 3 must divide the data-parallel size 4 (--world-size 8 / --tp 2)",
        ),
    ],
)
def test_bad_tp_flags_are_named(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        fsdp_main(["train", *argv])
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_fused_rows_round_trip() -> None:
    w = torch.arange(24.0).reshape(12, 2)  # [q; k; v], 4 rows each
    fused = fuse_rows(w, 3, 2)
    # tp rank 0's block: q rows 0-1, k rows 4-5, v rows 8-9
    assert fused[:6, 0].tolist() == [0.0, 2.0, 8.0, 10.0, 16.0, 18.0]
    assert torch.equal(unfuse_rows(fused, 3, 2), w)
    assert torch.equal(fuse_rows(w, 3, 1), w)
    with pytest.raises(ValueError, match=r"parts \(3\) x tp \(8\)"):
        fuse_rows(w, 3, 8)


def test_model_sizes_checked() -> None:
    assert tp_model_problem(MODEL_SIZES["small"], 4) is None
    assert tp_model_problem(LLAMA_SIZES["tiny"], 2) is None
    assert "LlamaConfig.ffn_dim must be divisible by the tensor-parallel size 3" in str(
        tp_model_problem(replace(LLAMA_SIZES["tiny"], n_heads=3, dim=63), 3)
    )
    with pytest.raises(
        ValueError,
        match=r"GPTConfig.vocab_size must be divisible by the "
        r"tensor-parallel size 2 \(.*\), got 255",
    ):
        check_tp_size(GPTConfig(vocab_size=255, d_model=64, n_heads=4), 2)
    with pytest.raises(ValueError, match="tie_embeddings must be False"):
        check_tp_size(GPTConfig(tie_embeddings=True), 2)
    assert "seq_len must be divisible" in str(tp_model_problem(MODEL_SIZES["tiny"], 2, seq_len=63))
    assert tp_model_problem(MODEL_SIZES["tiny"], 2, seq_len=63, sequence_parallel=False) is None
