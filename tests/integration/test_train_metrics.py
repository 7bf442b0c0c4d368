"""`fsdp train`'s logs and metrics: JSON lines, CSV and TensorBoard with lr, gradient norm,
step time and MFU; plain progress lines off a terminal; rank-prefixed log records."""

from __future__ import annotations

import csv
import json
import logging
import math
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from fsdp._cli import main as fsdp_main
from fsdp.models import GPT, GPTConfig
from fsdp.train import TrainConfig, run_training
from fsdp.train._metrics import CSV_COLUMNS
from fsdp.train._mfu import (
    ModelShape,
    detect_peak_tflops,
    device_peak,
    flops_per_token,
    model_flops_utilization,
    model_shape,
)

from ._corpus import write_corpus

TINY = TrainConfig(
    model="tiny",
    steps=4,
    global_batch=8,
    progress=False,
    lr=3e-3,
    threads_per_rank=1,
    world_size=2,
    backend="threads",
)
CLI = ["train", "--model", "tiny", "--backend", "threads", "--threads-per-rank", "1"]
PLAIN = re.compile(
    r"^step (\d+)/(\d+) loss [\d.]+ lr [\d.e+-]+ grad_norm [\d.e+-]+ "
    r"[\d.e+-]+ s/step \d+ tok/s rss_max \d+ MiB$"
)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    """``--data`` for every run here: not the default corpus, read by walking the whole
    standard library on every rank (see ``_corpus.py``)."""
    return write_corpus(tmp_path_factory.mktemp("corpus") / "stdlib.txt")


@pytest.fixture(scope="module")
def tiny(corpus: str) -> TrainConfig:
    return replace(TINY, data=corpus)


@pytest.fixture(scope="module")
def cli(corpus: str) -> list[str]:
    return [*CLI, "--data", corpus]


@pytest.fixture(autouse=True)
def _fresh_logging() -> Iterator[None]:
    """Each test starts and ends with the ``fsdp`` logger as Python leaves it."""
    logger = logging.getLogger("fsdp")

    def reset() -> None:
        for handler in [h for h in logger.handlers if getattr(h, "_fsdp_handler", False)]:
            logger.removeHandler(handler)
        logger.setLevel(logging.NOTSET)
        logger.propagate = True

    reset()
    yield
    reset()


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line]


# ---- metrics files --------------------------------------------------------------------------
@pytest.mark.parametrize("clip", [1.0, None])
def test_jsonl_has_lr_grad_norm_step_time(
    tmp_path: Path, clip: float | None, tiny: TrainConfig
) -> None:
    summary = run_training(replace(tiny, clip=clip, metrics=str(tmp_path / "m.jsonl")))
    rows = _jsonl(tmp_path / "m.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert [r["loss"] for r in rows] == summary.losses
    for r in rows:
        assert r["lr"] == 3e-3
        assert math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0  # computed with no clip too
        assert r["step_time_s"] > 0 and r["tokens_per_s"] > 0
        assert r["mfu"] is None  # CPU, no --peak-tflops
        assert len(r["peak_rss_mib"]) == 2 and "cuda_max_memory_allocated_bytes" not in r
    assert summary.mean_step_time_s > 0 and summary.mfu is None
    assert "--peak-tflops" in summary.mfu_basis


def test_csv_round_trips_and_mfu_follows_the_peak(tmp_path: Path, tiny: TrainConfig) -> None:
    path = tmp_path / "m.csv"
    cfg = replace(tiny, metrics=str(path), peak_tflops=0.5)
    summary = run_training(cfg)
    run_training(replace(cfg, steps=2))  # appends below the same header
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        assert tuple(reader.fieldnames or ()) == CSV_COLUMNS
        rows = list(reader)
    assert [int(r["step"]) for r in rows] == [0, 1, 2, 3, 0, 1]
    assert path.read_text().count("step,loss") == 1
    for r in rows:
        assert float(r["lr"]) == 3e-3 and float(r["grad_norm"]) > 0
        expected = summary.flops_per_token * float(r["tokens_per_s"]) / (0.5e12 * 2)
        assert float(r["mfu"]) == pytest.approx(expected, rel=1e-9)
        assert float(r["peak_rss_mib_max"]) > 0 and r["cuda_max_memory_allocated_bytes_max"] == ""
    assert summary.mfu == pytest.approx(summary.flops_per_token * summary.tokens_per_s / 1e12)


def test_csv_of_other_columns_is_refused_before_training(tmp_path: Path, capsys) -> None:
    path = tmp_path / "old.csv"
    path.write_text("step,loss\n0,5.5\n")
    with pytest.raises(ValueError, match=r"--metrics: .*old\.csv has the columns step,loss"):
        run_training(replace(TINY, metrics=str(path)))
    with pytest.raises(SystemExit) as info:
        fsdp_main([*CLI, "--steps", "1", "--metrics", str(path)])
    assert info.value.code == 2
    assert "has the columns step,loss, not those of this run" in capsys.readouterr().err
    assert path.read_text() == "step,loss\n0,5.5\n"


def test_tensorboard_scalars(tmp_path: Path, tiny: TrainConfig) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_training(replace(tiny, tensorboard=str(tmp_path / "tb"), peak_tflops=1.0))
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"loss", "lr", "grad_norm", "step_time_s", "tokens_per_s", "mfu"} <= tags
    assert [e.step for e in events.Scalars("loss")] == [0, 1, 2, 3]
    assert all(e.value == pytest.approx(3e-3) for e in events.Scalars("lr"))


def test_tensorboard_missing_names_the_extra(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # find_spec now answers None
    with pytest.raises(SystemExit) as info:
        fsdp_main([*CLI, "--steps", "1", "--tensorboard", str(tmp_path / "tb")])
    assert info.value.code == 2
    assert (
        "--tensorboard needs the tensorboard package: pip install 'fsdp[tb]'"
        in capsys.readouterr().err
    )


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--peak-tflops", "0"],
            "--peak-tflops must be a finite number > 0 (TFLOP/s per device), got 0.0",
        ),
        (["--peak-tflops", "nan"], "--peak-tflops must be a finite number > 0"),
        (["--log-every", "0"], "--log-every must be >= 1, got 0"),
        (["--plot", "x.png", "--metrics", "m.csv"], "--plot reads JSON-lines metrics"),
    ],
)
def test_bad_metrics_flags_are_named(argv: list[str], message: str, capsys) -> None:
    with pytest.raises(SystemExit) as info:
        fsdp_main([*CLI, *argv])
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_config_checks_name_the_flag() -> None:
    with pytest.raises(ValueError, match=r"--peak-tflops must be a finite number > 0 .*got -1"):
        TrainConfig(peak_tflops=-1)
    with pytest.raises(ValueError, match=r"--log-every must be an integer >= 1, got 0"):
        TrainConfig(log_every=0)


# ---- progress -------------------------------------------------------------------------------
def test_plain_progress_line_every_n_steps(capsys, cli: list[str]) -> None:
    # capsys's stdout is no terminal: plain lines, no bar.
    assert fsdp_main([*cli, "--world-size", "1", "--steps", "5", "--log-every", "2"]) == 0
    captured = capsys.readouterr()
    lines = [ln for ln in captured.out.splitlines() if ln.startswith("step ") and "/" in ln]
    assert [PLAIN.match(ln).groups() for ln in lines] == [("2", "5"), ("4", "5"), ("5", "5")], lines
    assert "\r" not in captured.out + captured.err  # no bar redraws


def test_no_progress_prints_no_lines(capsys, cli: list[str]) -> None:
    assert (
        fsdp_main([*cli, "--world-size", "1", "--steps", "2", "--log-every", "1", "--no-progress"])
        == 0
    )
    assert not [ln for ln in capsys.readouterr().out.splitlines() if PLAIN.match(ln)]


# ---- logging --------------------------------------------------------------------------------
def test_info_level_gives_rank_prefixed_checkpoint_records(
    tmp_path: Path, monkeypatch, capsys, cli: list[str]
) -> None:
    monkeypatch.setenv("FSDP_LOG_LEVEL", "info")
    assert fsdp_main([*cli, "--steps", "2", "--no-progress", "--save", str(tmp_path / "ck")]) == 0
    err = capsys.readouterr().err
    for rank in (0, 1):
        assert re.search(
            rf"^\[rank {rank}\] \d\d:\d\d:\d\d fsdp\.ckpt INFO: saved .*ck "
            r"\(v\d+\): \d+ bytes written by this rank in [\d.]+ s$",
            err,
            re.M,
        ), err
    assert re.search(r"^\[rank 0\] .* fsdp INFO: checkpoint of step 2 saved to ", err, re.M)
    assert re.search(r"^\[rank \d\] .* fsdp\.engine INFO: lazy init of ", err, re.M)


def test_default_level_is_quiet(tmp_path: Path, monkeypatch, capsys, cli: list[str]) -> None:
    monkeypatch.delenv("FSDP_LOG_LEVEL", raising=False)
    assert fsdp_main([*cli, "--steps", "1", "--no-progress", "--save", str(tmp_path / "c")]) == 0
    assert "INFO" not in capsys.readouterr().err


def test_process_ranks_log_and_print_plain_lines_through_a_pipe(
    tmp_path: Path, corpus: str
) -> None:
    cmd = [
        sys.executable,
        "-m",
        "fsdp._cli",
        "train",
        "--model",
        "tiny",
        "--steps",
        "4",
        "--world-size",
        "2",
        "--threads-per-rank",
        "1",
        "--log-every",
        "2",
        "--data",
        corpus,
        "--save",
        str(tmp_path / "ck"),
    ]
    done = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=170,
        env={**os.environ, "FSDP_LOG_LEVEL": "INFO", "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    steps = [PLAIN.match(ln).group(1) for ln in done.stdout.splitlines() if PLAIN.match(ln)]
    assert steps == ["2", "4"], done.stdout
    for rank in (0, 1):  # each rank process configured its own handler
        assert (
            f"[rank {rank}] " in done.stderr
            and f"fsdp.comm INFO: backend torch: rank {rank} of 2" in done.stderr
        ), done.stderr


def test_bad_log_level_is_a_clear_error(monkeypatch, capsys) -> None:
    from fsdp_comm import configure_logging
    from fsdp_comm._logging import configure_from_environment

    monkeypatch.setenv("FSDP_LOG_LEVEL", "LOUD")
    expected = (
        "FSDP_LOG_LEVEL must be one of DEBUG, INFO, WARNING, ERROR, CRITICAL (any case) "
        "or a number from 0 to 50, got 'LOUD'"
    )
    with pytest.raises(ValueError) as info:
        configure_logging()
    assert str(info.value) == expected
    with pytest.warns(UserWarning, match="fsdp logging left unconfigured"):
        configure_from_environment()  # what importing fsdp_comm does: never fails an import
    with pytest.raises(SystemExit) as exit_info:
        fsdp_main([*CLI, "--steps", "1"])
    assert exit_info.value.code == 2 and expected in capsys.readouterr().err
    with pytest.raises(ValueError, match="level must be one of .* got 'loud'"):
        configure_logging("loud")


def test_configure_logging_twice_adds_one_handler(capsys) -> None:
    from fsdp_comm import configure_logging

    assert configure_logging("DEBUG") == logging.DEBUG
    assert configure_logging(20, rank=3) == logging.INFO
    logger = logging.getLogger("fsdp")
    assert len([h for h in logger.handlers if getattr(h, "_fsdp_handler", False)]) == 1
    logging.getLogger("fsdp.memory").debug("hidden")
    logging.getLogger("fsdp.memory").info("shown %d", 7)
    err = capsys.readouterr().err
    assert "hidden" not in err
    assert re.fullmatch(r"\[rank 3\] \d\d:\d\d:\d\d fsdp\.memory INFO: shown 7\n", err), err


def test_every_package_logs_to_its_own_logger() -> None:
    import fsdp_ckpt._save
    import fsdp_comm._launch
    import fsdp_engine._lazy_init
    import fsdp_memory._buffer_pool
    from fsdp_comm._logging import LOGGER_NAMES

    import fsdp.train._train

    found = [
        m._log.name
        for m in (
            fsdp_comm._launch,
            fsdp_memory._buffer_pool,
            fsdp_engine._lazy_init,
            fsdp_ckpt._save,
            fsdp.train._train,
        )
    ]
    assert tuple(found) == LOGGER_NAMES
    root = Path(__file__).resolve().parents[2]
    adders = [
        p.name
        for p in [*root.glob("packages/*/src/*/*.py"), *root.glob("src/fsdp/*.py")]
        if "addHandler(" in p.read_text()
    ]
    assert adders == ["_logging.py"]  # the one place that configures handlers


# ---- MFU ------------------------------------------------------------------------------------
def test_flops_per_token_and_mfu_formulas() -> None:
    shape = ModelShape(params=1000, n_layers=2, d_model=8)
    assert flops_per_token(shape, seq_len=16) == 6 * 1000 + 12 * 2 * 16 * 8
    assert model_flops_utilization(1e9, 1000.0, peak_tflops=1.0, world_size=2) == 0.5
    with pytest.raises(ValueError, match="peak_tflops must be a finite number > 0, got 0"):
        model_flops_utilization(1e9, 1000.0, peak_tflops=0, world_size=1)


@pytest.mark.parametrize("tie", [False, True])
def test_model_shape_leaves_out_embedding_lookups(tie: bool) -> None:
    cfg = GPTConfig(
        vocab_size=256, seq_len=64, d_model=64, n_heads=4, n_layers=2, tie_embeddings=tie
    )
    with torch.device("meta"):
        shape = model_shape(GPT(cfg), cfg.n_layers, cfg.d_model)
    lookups = cfg.seq_len * cfg.d_model + (0 if tie else cfg.vocab_size * cfg.d_model)
    assert shape == ModelShape(cfg.num_params - lookups, 2, 64)


@pytest.mark.parametrize(
    "name, dtype, tf32, peak",
    [
        ("NVIDIA H100 80GB HBM3", torch.bfloat16, None, 989.0),
        ("NVIDIA H100 PCIe", torch.float16, None, 756.0),
        ("NVIDIA H200", torch.bfloat16, None, 989.0),
        ("NVIDIA A100-SXM4-80GB", torch.float32, False, 19.5),
        ("NVIDIA A100-SXM4-80GB", torch.float32, True, 156.0),
        ("NVIDIA L40S", torch.bfloat16, None, 362.0),
        ("NVIDIA L4", torch.bfloat16, None, 121.0),
        ("Tesla K80", torch.bfloat16, None, None),
    ],
)
def test_peak_table(name: str, dtype: torch.dtype, tf32: bool | None, peak: float | None) -> None:
    assert detect_peak_tflops(name, dtype, allow_tf32=tf32) == peak


def test_peak_on_cpu_is_unknown_unless_given() -> None:
    peak, why = device_peak(None, "cpu", torch.float32)
    assert peak is None and "no peak FLOP/s is known for cpu devices; pass --peak-tflops" in why
    assert device_peak(312.0, "cpu", torch.float32) == (312.0, "--peak-tflops 312 per device")


@pytest.mark.gpu
def test_gpu_metrics_have_device_memory_and_mfu(tmp_path: Path, tiny: TrainConfig) -> None:
    summary = run_training(
        replace(
            tiny,
            backend="torch",
            world_size=1,
            param_dtype="bf16",
            metrics=str(tmp_path / "m.jsonl"),
        )
    )
    rows = _jsonl(tmp_path / "m.jsonl")
    assert all(r["cuda_max_memory_allocated_bytes"][0] > 0 for r in rows)
    name = torch.cuda.get_device_name()
    if detect_peak_tflops(name, torch.bfloat16) is not None:
        assert all(0 < r["mfu"] < 1 for r in rows) and summary.mfu is not None
    assert summary.cuda_max_memory_allocated_bytes and summary.cuda_max_memory_allocated_bytes[0]
