"""`fsdp train --profile DIR`: a trace per rank, the step-timeline summary printed at the end
and its figures in the --metrics records of the profiled steps (one short run), plus the
option checks and the profiled window."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from fsdp._cli import main as fsdp_main
from fsdp.train._metrics import CSV_COLUMNS, TIMELINE_COLUMNS, csv_columns, metrics_problem
from fsdp.train._train import profiled_window

CLI = [
    "train",
    "--model",
    "tiny",
    "--backend",
    "threads",
    "--threads-per-rank",
    "1",
    "--no-progress",
]


def test_profile_writes_traces_summary_and_metrics(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    metrics = tmp_path / "m.jsonl"
    assert (
        fsdp_main(
            [
                *CLI,
                "--steps",
                "4",
                "--profile",
                str(tmp_path / "prof"),
                "--profile-steps",
                "2",
                "--metrics",
                str(metrics),
                "--json",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    for rank in (0, 1):
        events = json.loads((tmp_path / "prof" / f"rank{rank}.trace.json").read_text())
        names = {e.get("name") for e in events["traceEvents"]}
        assert "fsdp::wait_gather blocks.0" in names
        lanes = {e["args"]["name"] for e in events["traceEvents"] if e.get("name") == "thread_name"}
        assert {"fsdp all-gather", "fsdp reduce-scatter", "fsdp compute"} <= lanes
    assert "step timeline (cpu clock)" in out and "exposed comm" in out
    assert "blocks.1" in out and "total" in out
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line]
    profiled = [r["step"] for r in rows if "timeline" in r]
    assert profiled == list(profiled_window(0, 4, 2)) == [2, 3]
    for r in rows:
        t = r.get("timeline")
        if t is None:
            continue
        assert math.isclose(
            t["compute_ms"] + t["exposed_ms"] + t["engine_ms"], t["step_ms"], rel_tol=1e-6
        )
        assert t["hidden_ms"] >= 0 and t["exposed_ms"] <= t["comm_ms"] + 1e-6
        assert {"<root>", "blocks.0", "blocks.1"} <= set(t["units"])
    summary = json.loads(out.strip().splitlines()[-1])["summary"]["timeline"]
    assert summary["steps"] == 2 and summary["step_ms"] > 0


def test_profiled_window() -> None:
    assert profiled_window(0, 60, 3) == range(2, 5)  # after two warm-up steps
    assert profiled_window(0, 3, 3) == range(0, 3)  # a short run: no warm-up left
    assert profiled_window(10, 12, 3) == range(10, 12)  # resumed: what is left
    assert profiled_window(5, 20, 1) == range(7, 8)


def test_csv_columns_with_profile(tmp_path: Path) -> None:
    assert csv_columns(True) == CSV_COLUMNS + TIMELINE_COLUMNS
    old = tmp_path / "m.csv"
    old.write_text(",".join(CSV_COLUMNS) + "\n")
    problem = metrics_problem(str(old), None, profile=True)
    assert problem is not None and "timeline_exposed_ms" in problem
    assert metrics_problem(str(old), None) is None


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--profile-steps", "0"], "--profile-steps must be >= 1, got 0"),
        (["--profile", "FILE"], "--profile must be a directory, but"),
    ],
)
def test_profile_option_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    (tmp_path / "FILE").write_text("x")
    argv = [str(tmp_path / a) if a == "FILE" else a for a in argv]
    with pytest.raises(SystemExit) as exc:
        fsdp_main([*CLI, *argv, "--print-config"])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
