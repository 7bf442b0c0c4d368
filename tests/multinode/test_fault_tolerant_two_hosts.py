"""Fault-tolerant hybrid sharding across two hosts (issue #31): one host lost and back, the
other never stopping.

hostA and hostB (`scripts/two-hosts`) are one replica group of 2 ranks each, each under its
own ``torchrun --standalone`` (its world is its shard group), meeting through the rendezvous
store hostA's rank 0 hosts (``FSDP_FT_STORE``); ``fsdp train --strategy hybrid_shard
--fault-tolerant`` of the tiny model, 100 steps. At a random step between 20 and 40 hostB is
lost, one of two ways:

- ``kill``: SIGKILL of hostB's ranks (its torchrun stays and restarts them);
- ``cut``: the link between the hosts down for ``FSDP_COMM_TIMEOUT`` + 5 s, then up (as
  scripts/soak-two-hosts cuts it): hostB's ranks either fail on their timeouts and its
  torchrun restarts them (again, while the link is down), or live on, behind; either way
  hostB rejoins once the link is back.

Checks: hostA never restarts and commits its next step within twice ``FSDP_COMM_TIMEOUT`` of
the fault; hostB rejoins (state from hostA, no checkpoint read), after a kill restarted by its
torchrun;
both torchruns exit 0 after step 100; the parameters and optimizer state saved by the two
hosts are bitwise equal, and equal to a one-process replay of the membership each step had
(``_ft_replay.py``: which replicas' data each committed step used, from the log; dropped steps
left no trace). The times (the fault -> hostA's next step; hostB's restart -> its first step
back) are printed as one JSON line (appended to ``FSDP_FT_FIGURES`` when set), as
docs/fault-tolerance.md quotes them.

The tiny model trains 100 steps faster than a restarted group starts here (two busy cores),
so from step 85 on hostA waits before each step without hostB until hostB asks to be admitted
(``_ft_hold.py``); with a quick enough restart nothing waits. ``FSDP_FT_TEST_SEED=N`` repeats
a run's fault step.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from . import _ft_replay as replay
from ._hosts import DATA, ROOT, Run, TwoHosts

pytestmark = [pytest.mark.multinode, pytest.mark.slow, pytest.mark.timeout(480)]

COMM_TIMEOUT = 12.0
STEPS = 100
FAULT_STEPS = (20, 40)
HOLD_AT = 85  # from this step on hostA waits for hostB to ask to be admitted (_ft_hold.py)
CUT_S = COMM_TIMEOUT + 5  # the link down this long (as scripts/soak-two-hosts cuts it)
RESTARTS = 8  # hostB's torchrun: a cut link fails a few restarts before it is mended
START_TIMEOUT = 240.0  # torchrun's start and the first steps, on 2 busy cores
REJOIN_TIMEOUT = 180.0
END_TIMEOUT = 180.0
TRAINER = ROOT / "tests" / "multinode" / "_ft_hold.py"
STORE_PORT = {"kill": 29651, "cut": 29652}
#: hostA's quorum changes: round, epoch, members, members before, the step it starts at.
QUORUM = re.compile(
    r"\[rank 0\] [^\n]*?replica 0: quorum round (\d+), epoch (\d+): replicas \[([\d, ]*)\] "
    r"\(were \[([\d, ]*)\]\), step (\d+)"
)
STARTED = re.compile(r"\[rank 0\] \S+ fsdp INFO: training tiny")
REJOINED = re.compile(r"\[rank 0\] [^\n]*?replica 1 rejoined at step (\d+) in ([\d.]+) s")
RECOVERED = re.compile(r"\[rank 0\] [^\n]*?replica 0 recovered: step (\d+) committed ([\d.]+) s")


@dataclass
class Host:
    """One host's torchrun and what its log said when (times: time.monotonic)."""

    run: Run
    log_dir: Path
    commits: dict[int, tuple[tuple[int, ...], float]] = field(default_factory=dict)
    attempts: dict[int, float] = field(default_factory=dict)  # torchrun's starts of the ranks
    mark: int | None = None  # where the log stood at the fault
    up: float | None = None  # when restarted ranks were up (the model built), after the mark

    def poll_log(self) -> str:
        text = self.run.output()
        now = time.monotonic()
        for step, members in replay.memberships(text).items():
            self.commits.setdefault(step, (members, now))
        for attempt in self.log_dir.glob("*/attempt_*"):
            self.attempts.setdefault(int(attempt.name.removeprefix("attempt_")), now)
        if self.mark is not None and self.up is None and STARTED.search(text, self.mark):
            self.up = now
        return text


def start(hosts: TwoHosts, replica: int, tmp: Path, fault: str, restarts: int) -> Host:
    host = "AB"[replica]
    argv = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        "--nproc-per-node", "2", "--max-restarts", str(restarts),
        "--log-dir", str(tmp / f"logs-{host}"), "--tee", "3",
        str(TRAINER), "train", "--model", replay.MODEL, "--strategy", "hybrid_shard",
        "--fault-tolerant", "--steps", str(STEPS), "--clip", "0", "--threads-per-rank", "1",
        "--global-batch", str(replay.GLOBAL_BATCH), "--seed", str(replay.SEED),
        "--no-progress", "--data", str(DATA), "--save", str(tmp / "ckpt"),
    ]  # fmt: skip
    env = {
        "FSDP_FT_REPLICA": str(replica),
        "FSDP_FT_REPLICAS": str(replay.REPLICAS),
        "FSDP_FT_STORE": f"{hosts.addr_a}:{STORE_PORT[fault]}",
        "FSDP_COMM_TIMEOUT": f"{COMM_TIMEOUT:g}",
        "FSDP_LOG_LEVEL": "INFO",
        # A restart's ranks otherwise read the last attempt's keys in torchrun's store
        # (pytorch/pytorch#135712, docs/soak.md).
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        "FT_HOLD_AT": str(HOLD_AT),
    }
    return Host(hosts.exec(host, argv, tmp / f"{host}.log", env), tmp / f"logs-{host}")


def ranks_of(hosts: TwoHosts, host: str) -> set[int]:
    """The training ranks running on ``host`` (not its torchrun)."""
    listed = subprocess.run(
        ["ip", "netns", "pids", f"{hosts.name}-{host}"], capture_output=True, text=True, timeout=10
    ).stdout.split()
    found = set()
    for pid in map(int, listed):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if (
            any(a.endswith(b"_ft_hold.py") for a in argv[:3])
            and b"torch.distributed.run" not in argv
        ):
            found.add(pid)
    return found


def wait_for(
    what: str, timeout: float, hosts: tuple[Host, ...], predicate: Callable[[], object]
) -> float:
    """Poll the logs and ``predicate`` every 50 ms; the time it held (time.monotonic)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for h in hosts:
            h.poll_log()
        if predicate():
            return time.monotonic()
        for h in hosts:
            if h.run.poll() is not None:
                raise AssertionError(
                    f"torchrun on host{h.run.host} exited ({h.run.proc.returncode}) before "
                    f"{what}:\n{h.run.output()[-5000:]}"
                )
        time.sleep(0.05)
    raise AssertionError(
        f"no {what} within {timeout:g} s; logs:\n"
        + "\n".join(f"host{h.run.host}:\n{h.run.output()[-3000:]}" for h in hosts)
    )


def _since(t: float | None, origin: float | None) -> float | None:
    return None if t is None or origin is None else round(t - origin, 2)


@pytest.mark.parametrize("fault", ["kill", "cut"])
def test_host_lost_and_rejoined(two_hosts: TwoHosts, tmp_path: Path, fault: str) -> None:
    seed = int(os.environ.get("FSDP_FT_TEST_SEED", random.randrange(10**6)))
    at = random.Random(seed).randint(*FAULT_STEPS)
    print(f"\n{fault}: FSDP_FT_TEST_SEED={seed}: hostB lost after step {at}")
    a = start(two_hosts, 0, tmp_path, fault, 0)
    b = start(two_hosts, 1, tmp_path, fault, RESTARTS)
    both = (a, b)
    try:
        wait_for(f"step {at} on hostA", START_TIMEOUT, both, lambda: at in a.commits)
        if fault == "kill":
            killed = ranks_of(two_hosts, "B")
            assert len(killed) == replay.SHARDS, killed
            for pid in killed:
                os.kill(pid, signal.SIGKILL)
        else:
            two_hosts.link("down")
        lost = time.monotonic()
        b.mark = len(b.run.output())  # hostB's log from here on is after the fault

        # hostA's next step: the first of a new quorum (a step in flight may still commit
        # with hostB's vote cast before the fault), alone or with hostB's restarted ranks when
        # they were quicker than hostA's quorum.
        def next_step() -> int | None:
            changes = QUORUM.finditer(a.run.output())
            first = next((m for m in changes if m.group(4) and int(m.group(5)) > at), None)
            step = None if first is None else int(first.group(5))
            return step if step in a.commits else None

        wait_for("hostA's next step", 4 * COMM_TIMEOUT, both, next_step)
        nxt = next_step()
        assert nxt is not None  # wait_for saw it
        next_t = a.commits[nxt][1]
        if fault == "cut":
            # Down for longer than the timeout, as a real cut: hostB's ranks may fail on their
            # timeouts (and be restarted, again while it lasts) or live on and come back.
            wait_for("the cut's end", CUT_S + 30, both, lambda: time.monotonic() > lost + CUT_S)
            two_hosts.link("up")
            mended = time.monotonic()
        else:
            mended = lost

        # hostB back: its first step from its rejoin (hostA waits for it at step 85).
        def back_step() -> int | None:
            rejoined = REJOINED.search(b.run.output(), b.mark)
            step = None if rejoined is None else int(rejoined.group(1))
            return step if step in b.commits else None

        wait_for("hostB's first step back", REJOIN_TIMEOUT, both, back_step)
        back = back_step()
        assert back is not None  # wait_for saw it
        back_t = b.commits[back][1]
        codes = a.run.wait(END_TIMEOUT), b.run.wait(END_TIMEOUT)
        for h in both:
            h.poll_log()
    finally:
        two_hosts.link("up")
        two_hosts.stop(a.run, b.run)
    text_a, text_b = a.run.output(), b.run.output()
    assert codes == (0, 0), (codes, text_a[-4000:], text_b[-4000:])
    assert sorted(a.attempts) == [0], f"hostA was restarted: attempts {sorted(a.attempts)}"
    restarted = b.attempts[max(b.attempts)] if len(b.attempts) > 1 else None
    if fault == "kill":
        assert restarted is not None, f"hostB was not restarted: attempts {sorted(b.attempts)}"
    recovery = next_t - lost
    figures = {
        "fault": fault,
        "seed": seed,
        "lost_after_step": at,
        "comm_timeout_s": COMM_TIMEOUT,
        "recovery_s": round(recovery, 2),  # the fault -> hostA's next step committed
        "hostA_next_step": [nxt, list(a.commits[nxt][0])],
        "hostA_recovery_logged_s": [float(m.group(2)) for m in RECOVERED.finditer(text_a)],
        "repair_s": round(mended - lost, 2),  # the link back (cut), else 0
        # hostB: torchrun's restart (the attempt that rejoined), its ranks up (imports, model
        # built), its first step back (admitted, state received, a step taken). After a cut
        # its ranks may have lived on: no restart, they rejoin once the link is back.
        "restart_s": _since(restarted, lost),  # the fault -> torchrun restarts hostB
        "up_s": _since(b.up, restarted),  # -> the restarted ranks are up
        "rejoin_s": _since(back_t, restarted),  # hostB's restart -> its first step back
        "back_s": round(back_t - mended, 2),  # the kill or the link back -> hostB's first step
        "hostB_rejoin_logged_s": [float(m.group(2)) for m in REJOINED.finditer(text_b)],
        "hostA_alone_steps": len([m for m, _ in a.commits.values() if m == (0,)]),
        "dropped": {"A": replay.dropped(text_a), "B": replay.dropped(text_b)},
        "hostB_attempts": len(b.attempts),
        "hostB_back_at_step": back,
    }
    print(json.dumps(figures))
    if os.environ.get("FSDP_FT_FIGURES"):
        with open(os.environ["FSDP_FT_FIGURES"], "a") as f:
            f.write(json.dumps(figures) + "\n")
    assert recovery <= 2 * COMM_TIMEOUT, figures
    # The membership: every step committed once, by hostA; hostB agrees on the steps it logged.
    plan = replay.memberships(text_a)
    assert sorted(plan) == list(range(STEPS)), sorted(set(range(STEPS)) - set(plan))
    theirs = replay.memberships(text_b)
    assert all(plan[s] == m for s, m in theirs.items()), {
        s: (plan[s], m) for s, m in theirs.items() if plan[s] != m
    }
    assert plan[at] == (0, 1) and plan[STEPS - 1] == (0, 1), plan
    if fault == "cut":  # hostB cannot be back before the link is
        assert plan[nxt] == (0,), figures
    assert REJOINED.search(text_b), "hostB never logged its rejoin"
    # The state: both hosts' copies bitwise equal, and equal to the replay.
    saved_a = replay.load(tmp_path / "ckpt" / "replica0")
    saved_b = replay.load(tmp_path / "ckpt" / "replica1")
    assert not replay.differences(saved_a, saved_b), replay.differences(saved_a, saved_b)[:10]
    want = replay.replay(plan, STEPS, DATA)
    assert not replay.differences(saved_a, want), replay.differences(saved_a, want)[:10]
