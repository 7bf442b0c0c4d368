"""`fsdp train`: trains at 1, 2 and 4 ranks (loss falls), resumes exactly, refuses bad flags.

Runs train on `_corpus.write_corpus`'s 1 MiB of standard-library source (``--data``), not the
default corpus that every rank reads by walking the whole standard library (5-10 s a rank);
``test_loss_falls[1]`` keeps the default corpus. Runs over processes (``backend="torch"``)
fork their ranks from a server that imported fsdp_engine once (``tests/forkserver_preload.py``).
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from fsdp._cli import main as fsdp_main
from fsdp.train import TrainConfig, run_training

from ..forkserver_preload import warm_forkserver
from ._corpus import write_corpus

TINY = TrainConfig(
    model="tiny", steps=12, global_batch=8, progress=False, lr=3e-3, threads_per_rank=1
)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    return write_corpus(tmp_path_factory.mktemp("corpus") / "stdlib.txt")


@pytest.fixture(scope="module")
def tiny(corpus: str) -> TrainConfig:
    return replace(TINY, data=corpus)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_loss_falls(world: int, tiny: TrainConfig) -> None:
    # world 1: the default corpus (the standard library), which no other run here reads
    cfg = replace(tiny, data=None) if world == 1 else tiny
    summary = run_training(replace(cfg, world_size=world, backend="threads"))
    assert len(summary.losses) == 12
    assert summary.losses[-1] < summary.losses[0] - 0.5, summary.losses


def test_over_processes_with_options(tmp_path, tiny: TrainConfig) -> None:
    warm_forkserver()
    cfg = replace(
        tiny,
        world_size=2,
        steps=6,
        grad_accum=2,
        activation_checkpointing=True,
        meta_init=True,
        metrics=str(tmp_path / "m.jsonl"),
    )
    summary = run_training(cfg)
    rows = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(6))
    assert len(rows[0]["peak_rss_mib"]) == 2 and summary.losses[-1] < summary.losses[0]


@pytest.mark.parametrize("strategy", ["shard_grad_op", "no_shard", "hybrid_shard"])
def test_strategies(strategy: str, tiny: TrainConfig) -> None:
    summary = run_training(
        replace(tiny, world_size=4, backend="threads", strategy=strategy, steps=4)
    )
    assert summary.losses[-1] < summary.losses[0]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "huge"], "argument --model: invalid choice: 'huge'"),
        (
            ["--world-size", "3", "--global-batch", "8"],
            "--global-batch 8 must be divisible by --world-size 3",
        ),
        (["--data", "/no/such/path"], "--data: no such file or directory: /no/such/path"),
        (["--resume", "/no/such/ckpt"], "--resume: no checkpoint at /no/such/ckpt"),
        (
            ["--strategy", "hybrid_shard", "--world-size", "4", "--shard-size", "3"],
            "--shard-size 3 must divide --world-size 4",
        ),
        (["--steps", "0"], "--steps must be >= 1"),
        (["--host-mmap-threshold", "-1"], "argument --host-mmap-threshold: not a size: '-1'"),
        (
            ["--host-mmap-threshold", "64M"],
            "--host-mmap-threshold must be 0 (glibc's own) or at "
            "most 32M (33554432 bytes), got 67108864",
        ),
    ],
)
def test_bad_flags_are_named(argv, message, capsys) -> None:
    with pytest.raises(SystemExit) as info:
        fsdp_main(["train", *argv])
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_own_text_file(tmp_path, capsys) -> None:
    text = tmp_path / "corpus.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    assert (
        fsdp_main(
            [
                "train",
                "--model",
                "tiny",
                "--steps",
                "20",
                "--backend",
                "threads",
                "--data",
                str(text),
                "--no-progress",
                "--threads-per-rank",
                "1",
                "--json",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    summary = json.loads(out.strip().splitlines()[-1])["summary"]
    assert summary["losses"][-1] < 0.7 * summary["losses"][0]


@pytest.mark.parametrize("backend", ["threads", "torch"])
def test_resume_continues_exactly(tmp_path, backend: str, tiny: TrainConfig) -> None:
    if backend == "torch":
        warm_forkserver()
    base = replace(tiny, world_size=2, backend=backend, steps=6)
    whole = run_training(base)
    first = run_training(replace(base, steps=3, save=str(tmp_path / "ck")))
    second = run_training(replace(base, resume=str(tmp_path / "ck")))
    assert second.start_step == 3
    assert first.losses + second.losses == whole.losses  # bit for bit


def test_resume_into_the_same_directory_leaves_only_the_last_version(
    tmp_path, tiny: TrainConfig
) -> None:
    # Process ranks end as soon as they return, and the superseded version is deleted by rank
    # 0's background thread: fsdp train now waits for it (a race: seen with a larger model,
    # where the old version stayed beside the new one until the next save; issue #30).
    warm_forkserver()
    ck = tmp_path / "ck"
    base = replace(tiny, world_size=2, backend="torch", save=str(ck))
    run_training(replace(base, steps=2))
    run_training(replace(base, steps=4, resume=str(ck)))
    assert sorted(p.name for p in ck.iterdir() if p.name.startswith("v")) == ["v000002"]
    assert not [p.name for p in ck.iterdir() if p.name.startswith((".staging", ".CURRENT.tmp"))]


def test_one_command_line_starts_and_restarts_a_job(tmp_path, corpus: str, capsys) -> None:
    # `--resume D --save D` with nothing in D yet starts at step 0, so a launcher that
    # restarts the job (torchrun --max-restarts) can use one command line (issue #30's soak).
    ck = str(tmp_path / "ck")
    argv = [
        "train",
        "--model",
        "tiny",
        "--world-size",
        "1",
        "--backend",
        "threads",
        "--no-progress",
        "--data",
        corpus,
        "--save",
        ck,
        "--resume",
        ck,
        "--json",
    ]
    assert fsdp_main([*argv, "--steps", "2"]) == 0
    assert "holds no checkpoint yet: starting at step 0" in capsys.readouterr().err
    assert fsdp_main([*argv, "--steps", "3"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["summary"]
    assert summary["start_step"] == 2 and len(summary["losses"]) == 1
    # Elsewhere, a --resume that holds nothing is still refused (a mistyped path).
    typo = [*argv[:-5], "--save", str(tmp_path / "new"), "--resume", str(tmp_path / "typo")]
    with pytest.raises(SystemExit):
        fsdp_main([*typo, "--steps", "3"])
    assert "--resume: no checkpoint at" in capsys.readouterr().err


def test_resume_at_another_world_size(tmp_path, tiny: TrainConfig) -> None:
    run_training(replace(tiny, world_size=4, backend="threads", steps=3, save=str(tmp_path / "c")))
    summary = run_training(
        replace(tiny, world_size=2, backend="threads", steps=5, resume=str(tmp_path / "c"))
    )
    assert summary.start_step == 3 and len(summary.losses) == 2


def test_checkpoint_of_another_model_is_refused(tmp_path, capsys, tiny: TrainConfig) -> None:
    run_training(replace(tiny, world_size=1, backend="threads", steps=1, save=str(tmp_path / "c")))
    code = fsdp_main(
        [
            "train",
            "--model",
            "small",
            "--world-size",
            "1",
            "--backend",
            "threads",
            "--steps",
            "2",
            "--no-progress",
            "--data",
            tiny.data,
            "--resume",
            str(tmp_path / "c"),
        ]
    )
    err = capsys.readouterr().err
    assert code == 2
    assert "--resume:" in err and "different model than --model small" in err
    assert "mismatches, first: " in err


@pytest.mark.parametrize(
    "spec",
    [
        "gpt2:n_layer=2,n_embd=64,n_head=4",
        "llama:num_hidden_layers=2,hidden_size=64,intermediate_size=128,num_attention_heads=4,"
        "num_key_value_heads=4,max_position_embeddings=64",
    ],
)
def test_hugging_face_models_train_with_blocks_found(spec: str, tiny: TrainConfig) -> None:
    pytest.importorskip("transformers")
    summary = run_training(replace(tiny, hf_config=spec, world_size=2, backend="threads", steps=8))
    assert summary.losses[-1] < summary.losses[0] - 0.5, summary.losses


def test_hugging_face_blocks_are_units() -> None:
    pytest.importorskip("transformers")
    from fsdp.hf import build_hf_model

    hf = build_hf_model("gpt2:n_layer=3,n_embd=32,n_head=2")
    assert [type(b).__name__ for b in hf.blocks] == ["GPT2Block"] * 3
    assert hf.model.config.vocab_size == 256


def test_bad_hugging_face_spec_is_named(capsys) -> None:
    pytest.importorskip("transformers")
    with pytest.raises(SystemExit):
        fsdp_main(["train", "--hf-config", "gpt2:n_layer"])
    assert "--hf-config: expected key=value, got ['n_layer']" in capsys.readouterr().err


def test_plot_of_loss_and_memory(tmp_path, capsys, corpus: str) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "run.png"
    assert (
        fsdp_main(
            [
                "train",
                "--model",
                "tiny",
                "--steps",
                "4",
                "--backend",
                "threads",
                "--no-progress",
                "--data",
                corpus,
                "--plot",
                str(png),
            ]
        )
        == 0
    )
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "run.jsonl").exists()


@pytest.mark.slow
def test_under_torchrun(tmp_path, corpus: str) -> None:
    import os
    import subprocess
    import sys

    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "fsdp._cli",
        "train",
        "--model",
        "tiny",
        "--steps",
        "3",
        "--no-progress",
        "--threads-per-rank",
        "1",
        "--data",
        corpus,
        "--save",
        str(tmp_path / "ck"),
    ]
    done = subprocess.run(
        cmd, capture_output=True, text=True, timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "steps 0->3" in done.stdout and "2 ranks over torch" in done.stdout
    assert (tmp_path / "ck" / "CURRENT").exists()
