"""One rank of a replica group for test_fault_tolerance.py (Note [fault-tolerant replicas]).

Its replica group is its own torch world (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT); the
groups meet through FSDP_FT_STORE. Each rank holds a 4-element shard ``p`` and, per step,
a gradient that depends on (replica, shard rank, step) only, in small integers: every sum and
division by 1 or 2 is exact, so the test can replay the membership in one process bitwise.
Writes one JSON line per committed step (and at the end) to FT_OUT.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
from fsdp_comm import FaultTolerantReplicate, ReduceOp, get_backend


def grad(replica: int, shard: int, step: int) -> torch.Tensor:
    return torch.arange(4, dtype=torch.float32) + float(1 + replica + 2 * shard + step % 3)


def main() -> None:
    steps = int(os.environ["FT_STEPS"])
    pause = float(os.environ.get("FT_SLEEP", "0.05"))
    out = open(os.environ["FT_OUT"], "a", buffering=1)  # noqa: SIM115 - for the whole run
    shard = get_backend("torch")
    replica = int(os.environ["FSDP_FT_REPLICA"])
    p = torch.zeros(4)
    torch.manual_seed(0)
    data = {"position": 0}

    def state() -> dict[str, object]:
        return {"p": p, "data": dict(data)}

    def load_state(got: dict[str, object]) -> None:
        got_p = got["p"]
        assert isinstance(got_p, torch.Tensor)
        p.copy_(got_p)
        data.update(got["data"])  # type: ignore[arg-type]

    ft = FaultTolerantReplicate(shard, state=state, load_state=load_state)
    out.write(json.dumps({"replica": replica, "shard": shard.rank, "ready": time.time()}) + "\n")
    hold_at = int(os.environ.get("FT_HOLD_AT", "-1"))  # wait there for FT_HOLD_FILE (rejoin)
    started = time.monotonic()
    while ft.step < steps:
        if ft.step == hold_at:
            until = time.monotonic() + 60
            while not os.path.exists(os.environ["FT_HOLD_FILE"]) and time.monotonic() < until:
                time.sleep(0.05)
        ft.start_step()
        g = grad(replica, shard.rank, ft.step)
        noise = torch.rand(1)  # the RNG state travels: equal draws after a rejoin
        time.sleep(pause)
        ft.all_reduce(g, op=ReduceOp.premul_sum(1.0 / ft.world_size))
        members = list(ft.ranks)
        if ft.commit():
            p.sub_(g, alpha=0.5)
            data["position"] += 1
            row = {
                "replica": replica,
                "shard": shard.rank,
                "step": ft.step,
                "members": members,
                "t": time.time(),
                "noise": noise.item(),
            }
            out.write(json.dumps(row) + "\n")
    s = ft.stats
    final = {
        "replica": replica,
        "shard": shard.rank,
        "final": p.tolist(),
        "step": ft.step,
        "position": data["position"],
        "rng": torch.rand(1).item(),
        "dropped": s.steps_dropped,
        "recovery_s": s.recovery_s,
        "rejoin_s": s.rejoin_s,
        "quorum_changes": s.quorum_changes,
        "elapsed": time.monotonic() - started,
    }
    out.write(json.dumps(final) + "\n")
    out.close()
    ft.close()
    sys.stdout.flush()
    os._exit(0)  # a replica group's peer may be dead: skip process-group teardown


if __name__ == "__main__":
    main()
