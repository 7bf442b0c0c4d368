"""``python -m fsdp.bench.fault_tolerant`` (issue #31: "without --fault-tolerant, nothing
changes: same speed"): its arguments are checked, and a small run of both kinds writes a record
that ``scripts/gen_figures.py`` can render (the figures themselves: docs/fault-tolerance.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fsdp.bench import fault_tolerant, validate_record


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--steps", "0"], "--steps must be at least 1, got 0"),
        (["--rounds", "0"], "--rounds must be at least 1, got 0"),
        (["--steps", "5", "--warmup", "5"], "--warmup must be in [0, --steps), got 5"),
        (["--global-batch", "6"], "--global-batch must be a multiple of the 4 ranks, got 6"),
        (["--baseline", "/nonexistent"], "--baseline must be a checkout of this repository"),
    ],
)
def test_bad_arguments_are_named(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        fault_tolerant.main(argv)
    assert message in capsys.readouterr().err


@pytest.mark.faults  # eight rank processes: the fault-tolerance leg of .ci/run
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_small_run_records_both_kinds(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--model", "tiny", "--steps", "4", "--warmup", "1", "--rounds", "1"]
    assert fault_tolerant.main([*argv, "--record", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("*.json")
    record = json.loads(path.read_text())
    validate_record(record)
    assert record["kind"] == "fault-tolerant"
    figures = record["figures"]
    assert set(figures) == {"hybrid", "fault-tolerant"}
    assert figures["hybrid"]["ratio_to_hybrid"] == 1.0
    assert all(f["step_s"] > 0 for f in figures.values())
    assert "fault-tolerant" in capsys.readouterr().out
