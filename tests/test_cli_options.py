"""Options of every command (issue #15 item 4): one size rule for every size flag, help and
default for every option, ``--backend`` from the registry, usage lines naming the command as
typed, and ``fsdp train --config FILE`` / ``--print-config``."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from fsdp_ckpt import bench as ckpt_bench
from fsdp_ckpt import cli as ckpt_cli
from fsdp_comm import CliHelpFormatter, available_backends, parse_size
from fsdp_comm import bench as comm_bench

from fsdp._cli import main as fsdp_main
from fsdp.bench import ablations as bench_ablations
from fsdp.bench import engines as bench_engines
from fsdp.bench import gpu as bench_gpu
from fsdp.train import _cli as _train_cli

PARSERS: dict[str, Callable[[], argparse.ArgumentParser]] = {
    "fsdp train": _train_cli.build_parser,
    "fsdp comm-bench": lambda: comm_bench._parser("fsdp comm-bench"),
    "fsdp compare": lambda: bench_engines._parser("fsdp compare"),
    "fsdp ckpt": ckpt_cli.build_parser,
    "fsdp_ckpt.bench": lambda: ckpt_bench._parser("python -m fsdp_ckpt.bench"),
    "fsdp.bench.gpu": bench_gpu._parser,
    "fsdp.bench.ablations": bench_ablations._parser,
}


@pytest.fixture(autouse=True)
def _no_launcher_no_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Outside torchrun and Slurm; no test here may start ranks."""
    for name in (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "SLURM_PROCID",
        "SLURM_NTASKS",
        "MASTER_ADDR",
        "MASTER_PORT",
    ):
        monkeypatch.delenv(name, raising=False)

    def no_ranks(cfg: object) -> None:
        raise AssertionError(f"ranks were started for {cfg}")

    monkeypatch.setattr(_train_cli, "run_training", no_ranks)


def _all_parsers(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    """``parser`` and its sub-commands' parsers."""
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _all_parsers(sub)


def _options(name: str) -> Iterator[tuple[argparse.ArgumentParser, argparse.Action]]:
    for parser in _all_parsers(PARSERS[name]()):
        for action in parser._actions:
            if not isinstance(action, argparse._HelpAction):
                yield parser, action


def _help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    return parser._get_formatter()._expand_help(action)


def _exit_status(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as info:
        fsdp_main(argv)
    out, err = capsys.readouterr()
    return int(info.value.code or 0), out, err


# ---- sizes -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text, expected",
    [
        ("4096", 4096),
        ("64K", 64 << 10),
        ("1M", 1 << 20),
        ("16MiB", 16 << 20),
        ("1.5G", 3 << 29),
        ("2mb", 2 << 20),
        ("1T", 1 << 40),
        (" 8 k ", 8 << 10),
    ],
)
def test_one_size_rule(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["4Q", "", "-1", "inf", "nan", "1..5M", "M"])
def test_bad_sizes_name_the_argument_and_the_value(text: str) -> None:
    with pytest.raises(ValueError, match=f"--flag: .*{text!r}"):
        parse_size(text, argument="--flag")


def test_zero_only_where_allowed() -> None:
    assert parse_size("0", allow_zero=True) == 0
    with pytest.raises(ValueError, match="> 0, got '0'"):
        parse_size("0")


def test_train_host_mmap_threshold_takes_units() -> None:
    parser = _train_cli.build_parser()
    for text, expected in (("1M", 1 << 20), ("128K", 128 << 10), ("0", 0), ("4096", 4096)):
        args = parser.parse_args(["--host-mmap-threshold", text])
        assert _train_cli.config_from_args(parser, args).host_mmap_threshold == expected


def test_compare_size_flags_take_units() -> None:
    args = bench_engines._parser("fsdp compare").parse_args(
        ["--host-mmap-threshold", "1M", "--host-trim-bytes", "64M"]
    )
    assert (args.host_mmap_threshold, args.host_trim_bytes) == (1 << 20, 64 << 20)


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["comm-bench", "--sizes", "1K,4Q"], "--sizes"),
        (["train", "--host-mmap-threshold", "4Q"], "--host-mmap-threshold"),
        (["compare", "--host-trim-bytes", "4Q"], "--host-trim-bytes"),
    ],
)
def test_bad_size_is_a_usage_error(
    argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    status, _, err = _exit_status(argv, capsys)
    assert status == 2 and "Traceback" not in err
    assert f"error: argument {flag}: not a size: '4Q' (a number with an optional unit" in err


# ---- help, defaults, usage ---------------------------------------------------------------------
@pytest.mark.parametrize("name", PARSERS)
def test_every_option_is_explained(name: str) -> None:
    missing = [
        action.option_strings or action.dest
        for _, action in _options(name)
        if not (action.help or "").strip()
    ]
    assert not missing, f"{name}: options without help: {missing}"


@pytest.mark.parametrize("name", PARSERS)
def test_every_default_is_shown_and_none_is_not(name: str) -> None:
    for parser, action in _options(name):
        text = _help(parser, action)
        assert "(default: None)" not in text and "(default: False)" not in text, text
        if action.option_strings and action.default not in (None, False):
            assert "default" in text, f"{name} {action.option_strings}: {text!r}"


def test_train_help_shows_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = _exit_status(["train", "--help"], capsys)
    assert status == 0 and out.startswith("usage: fsdp train")
    for shown in (
        "(default: small)",
        "(default: 8)",
        "(default: 0.003)",
        "(default: torch)",
        "(default: full_shard)",
        "(default: 60)",
    ):
        assert shown in " ".join(out.split()), shown


@pytest.mark.parametrize("command", ["comm-bench", "compare", "ckpt", "train"])
def test_usage_names_the_command_as_typed(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = _exit_status([command, "--help"], capsys)
    assert status == 0 and out.startswith(f"usage: fsdp {command} ")


def test_module_usage_names_the_module(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        comm_bench.main(["--help"])
    assert capsys.readouterr().out.startswith("usage: python -m fsdp_comm.bench ")


def test_formatter_keeps_docstring_layout() -> None:
    parser = argparse.ArgumentParser(
        prog="x", description="one\n    two  spaced", formatter_class=CliHelpFormatter
    )
    assert "    two  spaced" in parser.format_help()


@pytest.mark.parametrize("command", ["train", "comm-bench"])
def test_backend_choices_come_from_the_registry(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    status, _, err = _exit_status([command, "--backend", "nope"], capsys)
    assert status == 2 and "Traceback" not in err
    choices = err.split("argument --backend: invalid choice: 'nope' (choose from ", 1)[1]
    assert all(name in choices for name in available_backends())


# ---- fsdp train --config -----------------------------------------------------------------------
def _config(tmp_path: Path, text: str) -> str:
    path = tmp_path / "train.toml"
    path.write_text(text)
    return str(path)


def _train_args(argv: list[str]) -> argparse.Namespace:
    from fsdp.train._config_file import parse_args_with_config

    parser = _train_cli.build_parser()
    args = parse_args_with_config(parser, argv)
    _train_cli.config_from_args(parser, args)
    return args


def test_config_values_are_used(tmp_path: Path) -> None:
    path = _config(
        tmp_path,
        'model = "tiny"\nglobal-batch = 4\nhost_mmap_threshold = "1M"\n'
        "no-progress = true\nreshard-after-forward = false\nlr = 1e-4\n",
    )
    args = _train_args(["--config", path])
    assert (args.model, args.global_batch, args.host_mmap_threshold) == ("tiny", 4, 1 << 20)
    assert args.no_progress is True and args.reshard_after_forward is False
    assert args.lr == 1e-4 and args.steps == 60  # the rest keep their defaults


def test_command_line_overrides_the_file(tmp_path: Path) -> None:
    path = _config(tmp_path, "global-batch = 4\nsteps = 5\n")
    args = _train_args(["--global-batch", "6", "--config", path])
    assert (args.global_batch, args.steps) == (6, 5)


def test_file_values_pass_the_same_checks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _config(tmp_path, "steps = 0\n")
    status, _, err = _exit_status(["train", "--config", path], capsys)
    assert status == 2 and "--steps must be >= 1, got 0" in err


def test_unknown_key_names_the_file_and_a_close_match(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _config(tmp_path, "global_bach = 4\n")
    status, _, err = _exit_status(["train", "--config", path], capsys)
    assert status == 2
    assert f"--config {path}: unknown key 'global_bach'; did you mean global-batch?" in err


@pytest.mark.parametrize(
    "text, message",
    [
        ("steps = [1, 2]\n", "steps = [1, 2]: --steps takes an integer, not a TOML array"),
        ('steps = "many"\n', 'steps = "many": --steps takes an integer'),
        ("steps = 2.5\n", "steps = 2.5: --steps takes an integer"),
        ("steps = true\n", "steps = true: --steps takes an integer, not a TOML boolean"),
        ('backend = "nope"\n', 'backend = "nope": --backend must be one of '),
        (
            'host-mmap-threshold = "4Q"\n',
            "host-mmap-threshold = \"4Q\": --host-mmap-threshold: not a size: '4Q'",
        ),
        ("json = 1\n", "json = 1: --json is a flag: write true or false"),
        ("[train]\nsteps = 3\n", "unknown key 'train'"),
        ("steps = \n", "not valid TOML"),
    ],
)
def test_bad_value_names_key_file_and_value(
    text: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _config(tmp_path, text)
    status, _, err = _exit_status(["train", "--config", path], capsys)
    assert status == 2 and "Traceback" not in err
    assert f"fsdp train: error: --config {path}: " in err and message in err


def test_missing_file_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status, _, err = _exit_status(["train", "--config", str(tmp_path / "none.toml")], capsys)
    assert status == 2 and f"--config: cannot read {tmp_path / 'none.toml'}" in err


def test_print_config_round_trips(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "--model",
        "tiny",
        "--global-batch",
        "4",
        "--lr",
        "1e-05",
        "--reshard-after-forward",
        "2",
        "--host-mmap-threshold",
        "1M",
        "--no-progress",
        "--data",
        str(tmp_path),
        "--compile",
        "eager",
        "--world-size",
        "4",
    ]
    assert fsdp_main(["train", *argv, "--print-config"]) == 0
    printed = capsys.readouterr().out
    assert 'model = "tiny"' in printed and "host-mmap-threshold = 1048576" in printed
    assert "shard-size" not in printed  # unset options are left out
    path = _config(tmp_path, printed)
    again = vars(_train_args(["--config", path]))
    assert {**again, "config": None} == vars(_train_args(argv))


def test_compare_table_reports_faults_per_step() -> None:
    """The faults/step column (Note [host heap]): the median over repeats, per engine."""
    from fsdp.bench.engines import EngineResult, format_results

    def result(engine: str, step: float, faults: float) -> EngineResult:
        return EngineResult(engine, 2, step, 900.0, [1.0], 0.0, faults)

    table = format_results(
        {
            "ours": [result("ours", 1.0, 100), result("ours", 1.1, 300), result("ours", 0.9, 200)],
            "ddp": [result("ddp", 1.0, 50)],
        }
    )
    header, ours, ddp = table.splitlines()
    assert "faults/step" in header
    assert ours.split()[:3] == ["ours", "1.000", "1.00"] and "200" in ours.split()
    assert "50" in ddp.split()
