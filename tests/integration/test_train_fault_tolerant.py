"""``fsdp train --strategy hybrid_shard --fault-tolerant`` (issue #31): two replica groups of 2
ranks, each its own world as under one torchrun per host; replica 1's ranks are SIGKILLed
after replica 0 saved step 4, and replica 0 trains on alone to the last step and saves it."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from tests.comm.test_fault_tolerance import _port, _start_group, _wait

STEPS = 12


def _argv(save: Path) -> list[str]:
    return [
        "-m", "fsdp", "train", "--model", "tiny", "--strategy", "hybrid_shard",
        "--fault-tolerant", "--steps", str(STEPS), "--save-every", "2", "--save", str(save),
        "--no-progress", "--global-batch", "8",
    ]  # fmt: skip


def test_fault_tolerant_flag_needs_hybrid_shard_and_its_environment(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from fsdp.train._fault_tolerant import fault_tolerant_problem

    assert "needs --strategy hybrid_shard" in str(fault_tolerant_problem("full_shard", 1, None))
    assert "--tp" in str(fault_tolerant_problem("hybrid_shard", 2, None))
    env = {k: v for k, v in os.environ.items() if not k.startswith("FSDP_FT_")}
    saved = dict(os.environ)
    try:
        os.environ.clear()
        os.environ.update(env)
        assert "FSDP_FT_STORE" in str(fault_tolerant_problem("hybrid_shard", 1, None))
    finally:
        os.environ.clear()
        os.environ.update(saved)


@pytest.mark.faults  # the fault-injection leg: python -m pytest -m faults (.ci/run)
@pytest.mark.slow
@pytest.mark.timeout(175)
def test_survivor_trains_to_the_end_after_the_other_host_is_killed(tmp_path: Path) -> None:
    out = tmp_path / "log"
    store = f"127.0.0.1:{_port()}"
    env = {"FSDP_LOG_LEVEL": "INFO", "FSDP_COMM_TIMEOUT": "20"}
    a = _start_group(0, store, out, STEPS, env, argv=_argv(tmp_path / "ckpt"))
    b = _start_group(1, store, out, STEPS, env, argv=_argv(tmp_path / "ckpt"))
    log_a = out.with_suffix(".0.0.err")
    deadline = time.monotonic() + 120
    while "checkpoint of step 4 saved" not in (log_a.read_text() if log_a.exists() else ""):
        assert time.monotonic() < deadline, "replica 0 never saved step 4"
        assert all(p.poll() is None for p in a + b), log_a.read_text()[-3000:]
        time.sleep(0.1)
    for p in b:
        os.kill(p.pid, signal.SIGKILL)
    _wait(a, time.monotonic() + 120, out)
    text = log_a.read_text()
    assert "replicas [0] (were [0, 1])" in text, text[-3000:]
    assert f"checkpoint of step {STEPS} saved" in text, text[-3000:]
    assert (tmp_path / "ckpt" / "replica0").is_dir()
