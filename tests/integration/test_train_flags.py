"""`fsdp train` refuses every bad flag before any rank starts (issue #12 item 8): each error
names the flag, the rule and the value; sizes are checked against the world the ranks will
have (torchrun's or Slurm's, not --world-size); a resume never saves below its step."""

from __future__ import annotations

from pathlib import Path

import pytest

from fsdp._cli import main as fsdp_main
from fsdp.train import TrainConfig, run_training
from fsdp.train import _cli as _train_cli
from fsdp.train._cli import build_parser, config_from_args

_LAUNCHER_VARIABLES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_LOCALID",
    "MASTER_ADDR",
    "MASTER_PORT",
)


@pytest.fixture(autouse=True)
def _no_launcher_no_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Outside torchrun and Slurm, whatever runs the tests; and no test here may start ranks."""
    for name in _LAUNCHER_VARIABLES:
        monkeypatch.delenv(name, raising=False)

    def no_ranks(cfg: TrainConfig) -> None:
        raise AssertionError(f"ranks were started for {cfg}")

    monkeypatch.setattr(_train_cli, "run_training", no_ranks)


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The error ``fsdp train argv`` stops with (exit status 2, no traceback)."""
    with pytest.raises(SystemExit) as info:
        fsdp_main(["train", *argv])
    err = capsys.readouterr().err
    assert info.value.code == 2, err
    # (Only what argparse printed: transformers' logger keeps the stderr of the test that first
    # used it, and reports its own "--- Logging error ---" when that capture is gone.)
    assert "Traceback" not in err.rpartition("usage: fsdp train")[2]
    return err


def _parsed(argv: list[str]) -> TrainConfig:
    parser = build_parser()
    return config_from_args(parser, parser.parse_args(argv))


BAD_FLAGS = [
    (["--clip", "-1"], "--clip must be a finite number >= 0 (0: no clipping), got -1.0"),
    (["--clip", "nan"], "--clip must be a finite number >= 0 (0: no clipping), got nan"),
    (["--clip", "inf"], "--clip must be a finite number >= 0 (0: no clipping), got inf"),
    (["--lr", "-0.1"], "--lr must be a finite number > 0, got -0.1"),
    (["--lr", "0"], "--lr must be a finite number > 0, got 0.0"),
    (["--lr", "nan"], "--lr must be a finite number > 0, got nan"),
    (["--save-every", "-3"], "--save-every must be >= 0 (0: only at the end), got -3"),
    (["--save-every", "5"], "--save-every 5 needs --save DIR"),
    (["--threads-per-rank", "-1"], "--threads-per-rank must be >= 1, got -1"),
    (["--threads-per-rank", "0"], "--threads-per-rank must be >= 1, got 0"),
    (
        ["--seq-len", "129"],
        "--seq-len must be at most 128, the maximum sequence length of "
        "--model small (its positional table), got 129",
    ),
    (
        ["--model", "tiny", "--seq-len", "65"],
        "--seq-len must be at most 64, the maximum sequence length of --model tiny",
    ),
    (
        ["--strategy", "hybrid_shard", "--shard-size", "3"],
        "--shard-size 3 must divide --world-size 2",
    ),
    (
        ["--shard-size", "2"],
        "--shard-size applies only to --strategy hybrid_shard, got "
        "--strategy full_shard with --shard-size 2",
    ),
    (["--strategy", "hybrid_shard", "--shard-size", "0"], "--shard-size must be >= 1, got 0"),
    (["--backend", "nonsense"], "argument --backend: invalid choice: 'nonsense' (choose from "),
    (
        ["--save", "{tmp}/a_file"],
        "--save must be a directory, but {tmp}/a_file is an existing file",
    ),
    (
        ["--metrics", "{tmp}/missing/m.jsonl"],
        "--metrics: the directory of {tmp}/missing/m.jsonl does not exist",
    ),
    (["--metrics", "{tmp}"], "--metrics must be a file, but {tmp} is a directory"),
    (
        ["--plot", "{tmp}/missing/run.png"],
        "--plot: the directory of {tmp}/missing/run.png does not exist",
    ),
    (
        ["--resume", "{tmp}/empty"],
        "--resume: no checkpoint at {tmp}/empty: it holds neither CURRENT nor index.json",
    ),
    (
        ["--reshard-after-forward", "0"],
        "argument --reshard-after-forward: 0 is ambiguous: write true or false",
    ),
    (
        ["--reshard-after-forward", "1"],
        "argument --reshard-after-forward: 1 is ambiguous: write true or false",
    ),
    (
        ["--reshard-after-forward", "-2"],
        "argument --reshard-after-forward: a group size must be >= 2, got '-2'",
    ),
    (
        ["--reshard-after-forward", "maybe"],
        "argument --reshard-after-forward: must be auto, "
        "true, false (or yes, no) or a group size >= 2, got "
        "'maybe'",
    ),
    (
        ["--reshard-after-forward", "4"],
        "--reshard-after-forward 4 must divide the shard group size 2 (full_shard at world size 2)",
    ),
    (
        ["--strategy", "shard_grad_op", "--reshard-after-forward", "2"],
        "--reshard-after-forward 2: shard_grad_op never reshards after forward",
    ),
]


@pytest.mark.parametrize("argv, message", BAD_FLAGS, ids=[" ".join(argv) for argv, _ in BAD_FLAGS])
def test_bad_flag_is_refused_before_any_rank(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "a_file").write_text("not a checkpoint")
    (tmp_path / "empty").mkdir()
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    err = _refused(argv, capsys)
    assert (
        "fsdp train: error: " + message.replace("{tmp}", str(tmp_path)) in err
        or message.replace("{tmp}", str(tmp_path)) in err.split("fsdp train: error: ", 1)[1]
    )


def test_backend_error_lists_the_registered_backends(capsys: pytest.CaptureFixture[str]) -> None:
    from fsdp_comm import available_backends

    err = _refused(["--backend", "nonsense"], capsys)
    choices = err.split("invalid choice: 'nonsense' (choose from ", 1)[1]
    assert all(name in choices for name in available_backends())


GOOD_FLAGS = [
    ([], {"reshard_after_forward": None}),  # auto: the engine's default
    (["--reshard-after-forward", "AUTO"], {"reshard_after_forward": None}),
    (["--reshard-after-forward", "true"], {"reshard_after_forward": True}),
    (["--reshard-after-forward", "No"], {"reshard_after_forward": False}),
    (["--reshard-after-forward", "yes"], {"reshard_after_forward": True}),
    (["--reshard-after-forward", "2"], {"reshard_after_forward": 2}),
    (
        [
            "--world-size",
            "4",
            "--strategy",
            "hybrid_shard",
            "--shard-size",
            "2",
            "--reshard-after-forward",
            "2",
        ],
        {"shard_size": 2, "reshard_after_forward": 2},
    ),
    (["--clip", "0"], {"clip": None}),
    (["--clip", "0.5", "--lr", "1e-4"], {"clip": 0.5, "lr": 1e-4}),
    (["--save", "{tmp}/new", "--save-every", "5"], {"save": "{tmp}/new", "save_every": 5}),
    (
        ["--metrics", "{tmp}/m.jsonl", "--threads-per-rank", "1"],
        {"metrics": "{tmp}/m.jsonl", "threads_per_rank": 1},
    ),
    (["--model", "tiny", "--seq-len", "64"], {"seq_len": 64}),
    (["--backend", "threads"], {"backend": "threads"}),
]


@pytest.mark.parametrize(
    "argv, expected", GOOD_FLAGS, ids=[" ".join(argv) for argv, _ in GOOD_FLAGS]
)
def test_good_flags_still_parse(
    argv: list[str], expected: dict[str, object], tmp_path: Path
) -> None:
    cfg = _parsed([a.replace("{tmp}", str(tmp_path)) for a in argv])
    for name, value in expected.items():
        if isinstance(value, str):
            value = value.replace("{tmp}", str(tmp_path))
        assert getattr(cfg, name) == value, name


# ---- the world the ranks join ----------------------------------------------------------------
@pytest.mark.parametrize("size", ["16", "3"])
def test_global_batch_is_checked_against_torchruns_world(
    size: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """16 ranks: every rank would crash; 3 ranks: 2 of 8 sequences silently dropped."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", size)
    err = _refused(["--global-batch", "8"], capsys)
    assert (
        f"--global-batch 8 must be divisible by the launcher's world size {size} "
        "(WORLD_SIZE; --world-size is ignored there)"
    ) in err


def test_slurm_world_is_checked(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name, value in (("SLURM_PROCID", "0"), ("SLURM_NTASKS", "3"), ("MASTER_ADDR", "n1")):
        monkeypatch.setenv(name, value)
    err = _refused(["--global-batch", "8"], capsys)
    assert "divisible by the launcher's world size 3 (SLURM_NTASKS" in err


def test_hybrid_shard_size_is_checked_against_torchruns_world(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "6")
    err = _refused(
        [
            "--global-batch",
            "12",
            "--strategy",
            "hybrid_shard",
            "--shard-size",
            "4",
            "--world-size",
            "8",
        ],
        capsys,
    )
    assert "--shard-size 4 must divide the launcher's world size 6" in err


def test_a_malformed_launcher_world_size_is_named(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "many")
    err = _refused([], capsys)
    assert "WORLD_SIZE (set by torchrun or Slurm) must be an integer >= 1, got 'many'" in err


def test_under_torchrun_the_real_world_size_is_used(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    cfg = _parsed(["--world-size", "3", "--global-batch", "8"])  # --world-size is ignored
    assert cfg.world_size == 4


def test_run_training_checks_the_world_before_starting_ranks() -> None:
    with pytest.raises(ValueError, match="--global-batch 8 must be divisible by --world-size 3"):
        run_training(TrainConfig(model="tiny", world_size=3, backend="threads", steps=1))


# ---- resuming never goes back in steps -------------------------------------------------------
@pytest.fixture(scope="module")
def checkpoint_at_step_2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("resume") / "ck"
    run_training(
        TrainConfig(
            model="tiny",
            world_size=1,
            backend="threads",
            steps=2,
            global_batch=2,
            progress=False,
            threads_per_rank=1,
            save=str(path),
        )
    )
    return path


def _saved_step(path: Path) -> tuple[int, tuple[str, ...]]:
    import fsdp_ckpt

    info = fsdp_ckpt.inspect_checkpoint(path)
    return info.index.extra["step"], info.versions


@pytest.mark.parametrize("steps", ["1", "2"])
def test_resume_needs_more_steps_than_the_checkpoint(
    steps: str, checkpoint_at_step_2: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    err = _refused(
        [
            "--model",
            "tiny",
            "--resume",
            str(checkpoint_at_step_2),
            "--save",
            str(checkpoint_at_step_2),
            "--steps",
            steps,
        ],
        capsys,
    )
    assert (
        f"--resume: {checkpoint_at_step_2} holds a checkpoint at step 2; --steps is the "
        f"total step count and must be greater than 2, got {steps}"
    ) in err
    assert (
        _parsed(["--model", "tiny", "--resume", str(checkpoint_at_step_2), "--steps", "3"]).steps
        == 3
    )


def test_run_training_never_saves_below_the_resumed_step(checkpoint_at_step_2: Path) -> None:
    before = _saved_step(checkpoint_at_step_2)
    cfg = TrainConfig(
        model="tiny",
        world_size=1,
        backend="threads",
        steps=1,
        global_batch=2,
        progress=False,
        threads_per_rank=1,
        resume=str(checkpoint_at_step_2),
        save=str(checkpoint_at_step_2),
    )
    with pytest.raises(ValueError, match="holds a checkpoint at step 2; --steps"):
        run_training(cfg)
    assert _saved_step(checkpoint_at_step_2) == before == (2, before[1])


def test_a_new_run_never_replaces_a_checkpoint_it_did_not_resume(
    checkpoint_at_step_2: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without --resume of the same directory, a run saving into a directory that holds a
    checkpoint would commit its own steps there and keep_last would delete the old one."""
    err = _refused(["--model", "tiny", "--save", str(checkpoint_at_step_2)], capsys)
    assert f"--save {checkpoint_at_step_2} already holds a checkpoint" in err
    assert f"pass --resume {checkpoint_at_step_2}" in err
    assert _parsed(
        [
            "--model",
            "tiny",
            "--save",
            str(checkpoint_at_step_2),
            "--resume",
            str(checkpoint_at_step_2),
            "--steps",
            "3",
        ]
    ).save


# ---- --hf-config ------------------------------------------------------------------------------
HF_BAD = [
    ("gpt2:nlayer=4", "--hf-config: GPT2Config (gpt2) has no key 'nlayer'; did you mean n_layer?"),
    ("gpt2:zzzz=4", "has no key 'zzzz'; valid keys: "),
    ("gpt2:n_layer=four", "--hf-config: n_layer of gpt2 must be an integer, got 'four'"),
    ("gpt2:n_layer=true", "--hf-config: n_layer of gpt2 must be an integer, got true"),
    ("gtp2:n_layer=4", "--hf-config: unknown model type 'gtp2'; did you mean gpt2"),
    (
        "gpt2:n_layer=1,n_embd=65,n_head=4",
        "cannot be built: ValueError: `embed_dim` must be divisible by num_heads",
    ),
    ("missing/config.json", "--hf-config: no such file: missing/config.json"),
]


@pytest.mark.parametrize("spec, message", HF_BAD, ids=[s for s, _ in HF_BAD])
def test_bad_hugging_face_spec_is_refused(
    spec: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("transformers")
    assert message in _refused(["--hf-config", spec], capsys)


def test_hugging_face_seq_len_beyond_the_positions(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers")
    spec = "gpt2:n_layer=1,n_embd=32,n_head=2,n_positions=64"
    err = _refused(["--hf-config", spec, "--seq-len", "65"], capsys)
    assert f"--seq-len must be at most 64, the maximum sequence length of --hf-config {spec}" in err
    assert _parsed(["--hf-config", spec, "--seq-len", "64"]).seq_len == 64


def test_hugging_face_good_spec_parses() -> None:
    pytest.importorskip("transformers")
    from fsdp.hf import parse_hf_spec

    config = parse_hf_spec("gpt2:n_layer=2,hidden_size=64,n_head=4,layer_norm_epsilon=1")
    assert (config.n_layer, config.n_embd, config.layer_norm_epsilon) == (2, 64, 1.0)
    assert config.vocab_size == 256


# ---- fsdp comm-bench ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "sizes, message",
    [
        ("4Q", "not a size: '4Q' (a number with an optional unit K, M, G or T"),
        ("1K,inf", "not a size: 'inf'"),
        (",", "no sizes given, got ','"),
    ],
)
def test_comm_bench_bad_sizes_are_argparse_errors(
    sizes: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        fsdp_main(["comm-bench", "--sizes", sizes])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "Traceback" not in err
    assert "error: argument --sizes: " + message in err
