"""The bus-bandwidth sweep (`python -m fsdp_comm.bench`) and its `fsdp comm-bench` door."""

from __future__ import annotations

import argparse

import pytest
from fsdp_comm import bench

from fsdp import _cli


def test_sizes_parse() -> None:
    assert bench._sizes("64M,1KiB, 512") == (64 << 20, 1024, 512)
    with pytest.raises(argparse.ArgumentTypeError, match="not a size: 'lots'"):
        bench._sizes("1K,lots")


def test_bus_bandwidth_factors_follow_nccl_tests() -> None:
    assert bench._bus_factor("all_gather", 4) == pytest.approx(0.75)
    assert bench._bus_factor("all_reduce", 4) == pytest.approx(1.5)
    assert bench._bus_factor("broadcast", 4) == 1.0


def test_sweep_with_raw_comparison(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        bench.main(
            [
                "--world-size",
                "2",
                "--sizes",
                "1K,300K",
                "--iters",
                "2",
                "--rounds",
                "1",
                "--warmup",
                "1",
                "--compare-raw",
                "--collectives",
                "all_gather,reduce_scatter,all_reduce,broadcast",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "busbw GB/s" in out and "raw/ours" in out
    assert (
        sum(
            line.startswith(("all_gather", "reduce_scatter", "all_reduce", "broadcast"))
            for line in out.splitlines()
        )
        == 8
    )


def test_threads_sweep_and_cli_door(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        _cli.main(
            [
                "comm-bench",
                "--backend",
                "threads",
                "--world-size",
                "3",
                "--sizes",
                "4K",
                "--iters",
                "2",
                "--rounds",
                "1",
            ]
        )
        == 0
    )
    assert "backend=threads world_size=3" in capsys.readouterr().out


def test_raw_comparison_needs_torch() -> None:
    with pytest.raises(ValueError, match="compare_raw needs backend='torch'"):
        bench.run_sweep(bench.BenchConfig(compare_raw=True), backend="threads")


def test_unknown_collective_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        bench.main(["--collectives", "all_to_all"])
    assert "unknown ['all_to_all']" in capsys.readouterr().err


def test_json_is_a_flag_and_out_a_path(tmp_path, capsys) -> None:
    """`--json` means "print JSON" in every command; files are written with `--out PATH`."""
    import json

    from fsdp_comm.bench import main

    out = tmp_path / "r.json"
    assert (
        main(
            [
                "--backend",
                "threads",
                "--world-size",
                "2",
                "--sizes",
                "1K",
                "--collectives",
                "all_gather",
                "--iters",
                "1",
                "--warmup",
                "0",
                "--rounds",
                "1",
                "--json",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads(out.read_text()) and printed[0]["collective"] == "all_gather"
