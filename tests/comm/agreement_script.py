"""Run by test_agreement.py as one rank of a hand-made world (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT set by the test, as an operator would), so that ranks can be told different things.

``python agreement_script.py MODE READY_DIR``: imports first, then waits until every process of
the test has written its file in READY_DIR (slow imports on a busy machine must not eat
FSDP_COMM_TIMEOUT), then joins with ``get_backend("torch")`` and prints one JSON line.

- ``join``: a first all-reduce; prints what happened and how long the join and it took.
- ``skew``: ``join``, with rank 1's launch facts naming another torch version.
- ``die``: shared-memory all-gathers; rank ``DIE_RANK`` exits (status 3) between two of them,
  the others report the error of the second and when they raised it.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
from fsdp_comm import CommError, get_backend


def _wait_for_peers(ready: Path, count: int) -> None:
    (ready / f"{os.getpid()}").write_text("ready")
    deadline = time.monotonic() + 120
    while len(list(ready.iterdir())) < count and time.monotonic() < deadline:
        time.sleep(0.02)


def _join() -> dict[str, object]:
    t0 = time.monotonic()
    try:
        be = get_backend("torch")
        t = torch.ones(2)
        be.all_reduce(t)
        return {"ok": t.tolist(), "seconds": time.monotonic() - t0}
    except Exception as exc:
        return {"error": type(exc).__name__, "message": str(exc), "seconds": time.monotonic() - t0}


def _die() -> dict[str, object]:
    options = {"all_gather_shm_min_bytes": 0, "all_gather_pairwise_min_bytes": 0}
    be = get_backend("torch", **options)
    n = 1 << 16
    out = torch.empty(n * be.world_size)
    be.all_gather_into_tensor(out, torch.full((n,), float(be.rank)))
    assert be.shared_memory_all_gathers == 1, "the all-gather did not go through shared memory"
    be.barrier()
    if be.rank == int(os.environ["DIE_RANK"]):
        time.sleep(0.5)  # the others are waiting in the second all-gather by now
        print(json.dumps({"died": time.time(), "pid": os.getpid()}), flush=True)
        os._exit(3)
    try:
        be.all_gather_into_tensor(out, torch.full((n,), float(be.rank)))
        return {"ok": True}
    except CommError as exc:
        return {"error": type(exc).__name__, "message": str(exc), "at": time.time()}


def _skew_torch_version_on_rank_1() -> None:
    """As if rank 1 ran another torch: its launch facts say so."""
    import fsdp_comm._join as tb

    real = tb.launch_facts

    def skewed(*args: object) -> dict[str, object]:
        facts = real(*args)  # type: ignore[arg-type]
        if os.environ["RANK"] == "1":
            facts["torch"] = "0.0.0-other"
        return facts

    tb.launch_facts = skewed  # type: ignore[assignment]


if __name__ == "__main__":
    mode, ready_dir = sys.argv[1], Path(sys.argv[2])
    _wait_for_peers(ready_dir, int(os.environ["PROCESSES"]))
    if mode == "skew":
        _skew_torch_version_on_rank_1()
    result = _die() if mode == "die" else _join()
    print(json.dumps({"rank": int(os.environ["RANK"]), **result}), flush=True)
    sys.stdout.flush()
    os._exit(0)  # no teardown: a failed join leaves nothing to tear down in order
