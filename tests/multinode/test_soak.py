"""The short soak of issue #30: `fsdp train` across two hosts under `torchrun --max-restarts`,
3 faults at random steps, each followed by an automatic restart from the last checkpoint.

`scripts/soak-two-hosts` does the work and the checks (its docstring; docs/soak.md): 100 steps
of the tiny model saved every 25, the final weights equal to an uninterrupted run's bit for bit,
resident memory flat over the last half, nothing left in either host's /dev/shm nor in the
checkpoint directory, every wait under a deadline. This test runs it once, small enough for the
multinode leg (about 3 minutes here), and fails with its report.

Each run covers one strategy and three of the four fault kinds, chosen from the date (UTC), so
that successive days cover full_shard and hybrid_shard and every set of three kinds, with the
steps and targets seeded by the date as well. ``FSDP_SOAK_SEED=N`` repeats day N's choices
(the failure message gives N); the long soak (1,000 steps, every kind twice, both strategies)
is the script's default, and docs/soak.md gives its figures.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ._hosts import ROOT, environment, why_not_possible

pytestmark = [pytest.mark.multinode, pytest.mark.slow, pytest.mark.timeout(600)]

SOAK = ROOT / "scripts" / "soak-two-hosts"
KINDS = ("kill-rank", "kill-host", "link-cut", "disk-full")
STRATEGIES = ("full_shard", "hybrid_shard")
STEPS = 100
SOAK_TIMEOUT_S = 540  # the script's own deadlines end a hung run well before this


def todays_choice(seed: int) -> tuple[str, list[str]]:
    """The strategy and the three fault kinds of the run seeded ``seed``: the strategy
    alternates, and the kind left out turns every second seed."""
    left_out = KINDS[(seed // 2) % len(KINDS)]
    return STRATEGIES[seed % 2], [k for k in KINDS if k != left_out]


def test_todays_choice_covers_everything_in_eight_days() -> None:
    seen = {(s, tuple(k)) for s, k in map(todays_choice, range(8))}
    assert len(seen) == 8, seen


def describe(report: dict) -> str:
    """The report, for a failure message: what failed, and each fault's line."""
    lines = [f"soak report ({report.get('wall_s')} s): {report.get('command')}"]
    for run in report.get("runs", []):
        failed = [name for name, ok in run.get("checks", {}).items() if not ok]
        lines.append(f"{run['strategy']}: ok={run['ok']} failed checks: {failed or '-'}")
        if "error" in run:
            lines.append(run["error"][-4000:])
        for fault in run.get("faults", []):
            lines.append("  " + json.dumps(fault)[:1200])
        for key in ("weights_differing", "missing_steps", "rss_growth", "shm_left", "ckpt_left"):
            if run.get(key):
                lines.append(f"  {key}: {run[key]}")
    return "\n".join(lines)


def test_short_soak(tmp_path: Path) -> None:
    reason = why_not_possible()
    if reason is not None:
        pytest.skip(f"two hosts on one machine: {reason}")
    seed = int(
        os.environ.get("FSDP_SOAK_SEED") or (datetime.date.today() - datetime.date(1970, 1, 1)).days
    )
    strategy, kinds = todays_choice(seed)
    cmd = [sys.executable, str(SOAK), "--steps", str(STEPS), "--faults", ",".join(kinds)]
    cmd += ["--strategies", strategy, "--seed", str(seed), "--comm-timeout", "10"]
    name = f"t{os.getpid()}s"
    cmd += ["--out", str(tmp_path / "soak"), "--name", name, "--timeout", "400"]
    try:
        done = subprocess.run(
            cmd, env=environment(), capture_output=True, text=True, timeout=SOAK_TIMEOUT_S
        )
    finally:  # the script takes its hosts down itself, unless it was killed
        subprocess.run(
            [str(ROOT / "scripts" / "two-hosts"), "down"],
            env=environment({"TWO_HOSTS_NAME": name}),
            capture_output=True,
            timeout=120,
        )
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    assert lines, (
        f"no report (exit {done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    )
    report = json.loads(lines[-1])
    print(describe(report))
    assert done.returncode == 0 and report["ok"], (
        f"FSDP_SOAK_SEED={seed} ({strategy}, {', '.join(kinds)}) failed:\n{describe(report)}"
    )
    (run,) = report["runs"]
    assert [f["kind"] for f in run["faults"]] == kinds
    for fault in run["faults"]:  # every fault restarted, from the last checkpoint
        assert fault["restart_s"] is not None, fault
        assert fault["resumed_from_step"] == fault["checkpoint_step"], fault
