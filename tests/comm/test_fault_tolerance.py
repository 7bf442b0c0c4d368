"""`FaultTolerantReplicate` (Note [fault-tolerant replicas]): 2 replica groups x 2 shard ranks
as 4 processes on this machine, each replica group its own torch world, the groups meeting
through the rendezvous store replica 0's rank 0 hosts. Replica 1's processes are SIGKILLed
mid-run; replica 0 must go on within twice the timeout, and its state must equal a
one-process replay of the membership (which replicas' gradients each committed step used).
With a restart, replica 1 must rejoin with bitwise the state of replica 0."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.comm.ft_script import grad

SCRIPT = Path(__file__).with_name("ft_script.py")
TIMEOUT_S = 6.0  # FSDP_COMM_TIMEOUT of the ranks
SHARDS = 2


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start_group(
    replica: int,
    store: str,
    out: Path,
    steps: int,
    extra: dict[str, str] | None = None,
    *,
    script: Path = SCRIPT,
    ranks: int = SHARDS,
    argv: list[str] | None = None,
) -> list[subprocess.Popen[bytes]]:
    """Start one replica group's ranks as torchrun would (its own world); ``ranks`` may
    span several replica groups for a plain 2-D mesh."""
    port = _port()
    procs = []
    for rank in range(ranks):
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(ranks),
            "LOCAL_WORLD_SIZE": str(ranks),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "FSDP_FT_STORE": store,
            "FSDP_FT_REPLICA": str(replica),
            "FSDP_FT_REPLICAS": "2",
            "FSDP_COMM_TIMEOUT": str(TIMEOUT_S),
            "FT_OUT": str(out),
            "FT_STEPS": str(steps),
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(Path(__file__).parents[2]),
            **(extra or {}),
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, *(argv or [str(script)])],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=open(out.with_suffix(f".{replica}.{rank}.err"), "ab"),  # noqa: SIM115
                start_new_session=True,
            )
        )
    return procs


def _rows(out: Path) -> list[dict[str, Any]]:
    if not out.exists():
        return []
    return [json.loads(line) for line in out.read_text().splitlines() if line.strip()]


def _wait(procs: list[subprocess.Popen[bytes]], deadline: float, out: Path) -> None:
    for p in procs:
        try:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            errs = "".join(f.read_text()[-1500:] for f in sorted(out.parent.glob("*.err")))
            pytest.fail(f"ranks did not finish in time; stderr tails:\n{errs}")
        assert p.returncode == 0, "".join(
            f.read_text()[-3000:] for f in sorted(out.parent.glob("*.err"))
        )


def _kill_when(out: Path, procs: list[subprocess.Popen[bytes]], step: int) -> float:
    """SIGKILL ``procs`` once replica 0 committed ``step``; returns when."""
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if any(r.get("replica") == 0 and r.get("step", 0) >= step for r in _rows(out)):
            for p in procs:
                os.kill(p.pid, signal.SIGKILL)
            for p in procs:
                p.wait(timeout=10)
            return time.time()
        time.sleep(0.02)
    pytest.fail("replica 0 never reached the step to kill at")


def _replay(rows: list[dict[str, Any]], shard: int) -> torch.Tensor:
    """One process: the same updates, from each committed step's membership."""
    p = torch.zeros(4)
    commits = sorted(
        (r for r in rows if r.get("replica") == 0 and r.get("shard") == shard and "members" in r),
        key=lambda r: r["step"],
    )
    assert [r["step"] for r in commits] == list(range(1, len(commits) + 1))
    for r in commits:
        members = r["members"]
        total = torch.zeros(4)
        for m in members:
            total += grad(m, shard, r["step"] - 1) * (1.0 / len(members))
        p -= 0.5 * total
    return p


def _finals(rows: list[dict[str, Any]]) -> dict[tuple[int, int], dict[str, Any]]:
    return {(r["replica"], r["shard"]): r for r in rows if "final" in r}


@pytest.mark.faults  # the fault-injection leg: python -m pytest -m faults (.ci/run)
@pytest.mark.slow
@pytest.mark.timeout(170)
def test_survivor_goes_on_alone_and_matches_the_replay(tmp_path: Path) -> None:
    out = tmp_path / "rows.jsonl"
    store = f"127.0.0.1:{_port()}"
    steps = 30
    a = _start_group(0, store, out, steps)
    b = _start_group(1, store, out, steps)
    killed = _kill_when(out, b, 8)
    _wait(a, time.monotonic() + 120, out)
    rows = _rows(out)
    after = [r["t"] for r in rows if r.get("replica") == 0 and "members" in r and r["t"] > killed]
    assert after, "replica 0 committed nothing after the kill"
    assert min(after) - killed < 2 * TIMEOUT_S, min(after) - killed
    finals = _finals(rows)
    for shard in range(SHARDS):
        final = finals[(0, shard)]
        assert final["step"] == steps
        assert torch.equal(torch.tensor(final["final"]), _replay(rows, shard))
    last = [r for r in rows if r.get("replica") == 0 and "members" in r][-1]
    assert last["members"] == [0]  # the end ran on replica 0 alone
    early = [r for r in rows if r.get("replica") == 0 and r.get("step") == 2]
    assert early and early[0]["members"] == [0, 1]  # both replicas' data before the kill


@pytest.mark.faults  # the fault-injection leg: python -m pytest -m faults (.ci/run)
@pytest.mark.slow
@pytest.mark.timeout(170)
def test_killed_replica_rejoins_with_bitwise_equal_state(tmp_path: Path) -> None:
    out = tmp_path / "rows.jsonl"
    store = f"127.0.0.1:{_port()}"
    steps = 30
    gate = tmp_path / "gate"
    # Replica 0 holds at step 16 until the restarted replica 1 is up, so that it is still
    # training when replica 1 asks to come back (on a slow machine the restart may take
    # longer than replica 0's remaining steps).
    a = _start_group(0, store, out, steps, {"FT_HOLD_AT": "16", "FT_HOLD_FILE": str(gate)})
    b = _start_group(1, store, out, steps)
    killed = _kill_when(out, b, 8)
    time.sleep(1.0)  # torchrun's restart, roughly
    b2 = _start_group(1, store, out, steps)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        ready = [r for r in _rows(out) if r.get("replica") == 1 and r.get("ready", 0) > killed]
        if len(ready) == SHARDS:
            break
        time.sleep(0.05)
    gate.touch()
    _wait(a + b2, time.monotonic() + 140, out)
    rows = _rows(out)
    finals = _finals(rows)
    for shard in range(SHARDS):
        fa, fb = finals[(0, shard)], finals[(1, shard)]
        assert fa["step"] == fb["step"] == steps
        assert fa["final"] == fb["final"]
        assert torch.equal(torch.tensor(fa["final"]), _replay(rows, shard))
        assert fa["position"] == fb["position"] == steps
        assert fa["rng"] == fb["rng"]  # the RNG state travelled with the rest
        assert fb["rejoin_s"], fb
    commits = [r for r in rows if r.get("replica") == 0 and "members" in r]
    alone = [r["step"] for r in commits if r["members"] == [0]]
    assert alone, "replica 0 never ran alone"
    assert commits[-1]["members"] == [0, 1]  # replica 1 was back for the end
    b_rows = [r for r in rows if r.get("replica") == 1 and "members" in r and r["t"] > killed]
    assert b_rows and min(r["step"] for r in b_rows) > max(alone)
    print(
        "rejoin_s",
        [finals[(1, s)]["rejoin_s"] for s in range(SHARDS)],
        "recovery_s",
        [finals[(0, s)]["recovery_s"] for s in range(SHARDS)],
    )
