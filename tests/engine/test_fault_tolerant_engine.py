"""`fully_shard` hybrid sharding over `fsdp_comm.FaultTolerantReplicate` (issue #31): without
faults it trains exactly as the ordinary 2-D mesh; with replica 1 SIGKILLed and restarted,
replica 0 goes on alone, replica 1 rejoins, and both end with bitwise the same parameters
and optimizer state, close to a one-process replay of the membership."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests.comm.test_fault_tolerance import (
    SHARDS,
    _kill_when,
    _port,
    _rows,
    _start_group,
    _wait,
)
from tests.engine.ft_engine_script import batch, make_model

SCRIPT = Path(__file__).with_name("ft_engine_script.py")


def _load(d: Path, mode: str, replica: int, shard: int) -> dict[str, Any]:
    got: dict[str, Any] = torch.load(d / f"{mode}_{replica}_{shard}.pt", weights_only=False)
    return got


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return bool(a == b)


def _replay(rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """One process, full model: each committed step's loss is the mean over the members'
    ranks' batches, as the sharded reduction divides by shard x live replicas."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    commits = sorted(
        (r for r in rows if r.get("replica") == 0 and r.get("shard") == 0 and "members" in r),
        key=lambda r: r["step"],
    )
    for r in commits:
        members, step = r["members"], r["step"] - 1
        terms = [
            nn.functional.mse_loss(model(x), y)
            for m in members
            for s in range(SHARDS)
            for x, y in [batch(step, m, s)]
        ]
        (sum(terms) / len(terms)).backward()  # type: ignore[operator]
        opt.step()
        opt.zero_grad()
    return {k: v.detach() for k, v in model.state_dict().items()}


def _full(d: Path, mode: str, replica: int) -> dict[str, torch.Tensor]:
    """Parameters gathered from the shard files (dim-0 shards, rank order)."""
    parts = [_load(d, mode, replica, s)["params"] for s in range(SHARDS)]
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


@pytest.mark.faults  # the fault-injection leg: python -m pytest -m faults (.ci/run)
@pytest.mark.slow
@pytest.mark.timeout(170)
def test_without_faults_equals_the_ordinary_hybrid_mesh(tmp_path: Path) -> None:
    steps = 6
    out = tmp_path / "rows.jsonl"
    env = {"FT_MODE": "hsdp", "FT_DIR": str(tmp_path)}
    plain = _start_group(0, "unused:1", out, steps, env, script=SCRIPT, ranks=2 * SHARDS)
    _wait(plain, time.monotonic() + 120, out)
    store = f"127.0.0.1:{_port()}"
    env = {"FT_MODE": "ft", "FT_DIR": str(tmp_path)}
    ft = [_start_group(r, store, out, steps, env, script=SCRIPT) for r in (0, 1)]
    _wait(ft[0] + ft[1], time.monotonic() + 120, out)
    for r in (0, 1):
        for s in range(SHARDS):
            want, got = _load(tmp_path, "hsdp", r, s), _load(tmp_path, "ft", r, s)
            assert _same(want["params"], got["params"]), (r, s)
            assert _same(want["optim"], got["optim"]), (r, s)


@pytest.mark.faults  # the fault-injection leg: python -m pytest -m faults (.ci/run)
@pytest.mark.slow
@pytest.mark.timeout(170)
def test_kill_and_rejoin_ends_bitwise_equal(tmp_path: Path) -> None:
    steps = 20
    out = tmp_path / "rows.jsonl"
    store = f"127.0.0.1:{_port()}"
    gate = tmp_path / "gate"
    env = {"FT_MODE": "ft", "FT_DIR": str(tmp_path)}
    a = _start_group(
        0, store, out, steps, {**env, "FT_HOLD_AT": "12", "FT_HOLD_FILE": str(gate)}, script=SCRIPT
    )
    b = _start_group(1, store, out, steps, env, script=SCRIPT)
    killed = _kill_when(out, b, 5)
    time.sleep(1.0)
    b2 = _start_group(1, store, out, steps, env, script=SCRIPT)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        ready = [r for r in _rows(out) if r.get("replica") == 1 and r.get("ready", 0) > killed]
        if len(ready) == SHARDS:
            break
        time.sleep(0.05)
    gate.touch()
    _wait(a + b2, time.monotonic() + 120, out)
    rows = _rows(out)
    commits = [r for r in rows if r.get("replica") == 0 and r.get("shard") == 0 and "members" in r]
    assert [0] in [r["members"] for r in commits] and commits[-1]["members"] == [0, 1]
    for s in range(SHARDS):
        fa, fb = _load(tmp_path, "ft", 0, s), _load(tmp_path, "ft", 1, s)
        assert _same(fa["params"], fb["params"]) and _same(fa["optim"], fb["optim"]), s
        assert fa["position"] == fb["position"] == steps
        assert torch.equal(fa["rng"], fb["rng"])
    want, got = _replay(rows), _full(tmp_path, "ft", 0)
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6)
