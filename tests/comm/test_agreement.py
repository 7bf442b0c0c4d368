"""Nothing hangs and nothing is left behind (issue #30): ranks started with different world
sizes are told so at once (Note [launch-time agreement] in fsdp_comm/_agreement.py), a local
peer that dies between shared-memory collectives is named within about a second (Note [a local
peer's death] in fsdp_comm/_peer_liveness.py), and `agree` itself."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from fsdp_comm import AgreementError, CommError, ReduceOp, ThreadsBackend, agree, launch
from fsdp_comm._agreement import describe_differences
from fsdp_comm._shm_collectives import stores_are_ordered

_SCRIPT = Path(__file__).with_name("agreement_script.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run_world(
    tmp_path: Path, mode: str, world_sizes: list[int], deadline: float, **env: str
) -> list[dict[str, Any]]:
    """Start one process per entry of ``world_sizes`` (RANK = its index, WORLD_SIZE = the entry)
    and return each one's JSON lines; every process is killed at ``deadline`` seconds."""
    ready = tmp_path / "ready"
    ready.mkdir()
    port = str(_free_port())
    procs = []
    for rank, size in enumerate(world_sizes):
        child_env = {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": str(size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            "PROCESSES": str(len(world_sizes)),
            "OMP_NUM_THREADS": "1",
            **env,
        }
        child_env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
        procs.append(
            subprocess.Popen(
                [sys.executable, str(_SCRIPT), mode, str(ready)],
                env=child_env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    end = time.monotonic() + deadline
    outputs = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=max(0.1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            out, err = proc.communicate()
            out += '\n{"hung": true}'
        rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        outputs.append({"rows": rows, "stderr": err[-2000:]})
    for p in procs:
        p.kill()
        p.wait()
    return outputs


def _last(output: dict[str, Any]) -> dict[str, Any]:
    assert output["rows"], output["stderr"]
    return output["rows"][-1]  # type: ignore[no-any-return]


@pytest.mark.parametrize("world_sizes", [[2, 3], [3, 2]])
def test_ranks_told_different_world_sizes_are_told_so_at_once(
    tmp_path: Path, world_sizes: list[int]
) -> None:
    # Before: the rank told 3 failed after FSDP_COMM_TIMEOUT with torch's "wait timeout ...
    # keys: /default_pg/0//cpu//0/2", and the rank told 2 could hang in gloo's connection
    # set-up until it was killed (issue #30).
    outputs = _run_world(tmp_path, "join", world_sizes, 90, FSDP_COMM_TIMEOUT="5")
    for rank, output in enumerate(outputs):
        row = _last(output)
        assert row.get("error") == "AgreementError", (rank, row, output["stderr"])
        want = (
            f"torch backend start: ranks disagree: rank 0 says world_size {world_sizes[0]}, "
            f"rank 1 says {world_sizes[1]}"
        )
        assert row["message"] == want, row
        assert row["seconds"] < 4, row  # well before FSDP_COMM_TIMEOUT


def test_a_rank_that_never_comes_is_named(tmp_path: Path) -> None:
    # Rank 1 of a world of 3 alone with rank 0: rank 2 never comes.
    outputs = _run_world(tmp_path, "join", [3, 3], 90, FSDP_COMM_TIMEOUT="3")
    for output in outputs:
        row = _last(output)
        assert row.get("error") == "CommTimeoutError", (row, output["stderr"])
        assert (
            "torch backend start: ranks [2] of a world of 3 did not arrive within 3 s"
            in row["message"]
        )
        assert row["seconds"] < 10, row


def test_a_clean_launch_joins(tmp_path: Path) -> None:
    outputs = _run_world(tmp_path, "join", [2, 2], 90, FSDP_COMM_TIMEOUT="30")
    for output in outputs:
        assert _last(output).get("ok") == [2.0, 2.0], output


@pytest.mark.slow
def test_under_torchrun_the_facts_are_agreed_through_the_group(tmp_path: Path) -> None:
    # torchrun's agent store outlives restarts, so there the check is one all-reduce after
    # torch's own join; a rank on another torch version is named by both.
    ready = tmp_path / "ready"
    ready.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += [str(_SCRIPT), "skew", str(ready)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PROCESSES": "2", "FSDP_COMM_TIMEOUT": "30"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=150, env=env)
    # Both ranks print to torchrun's one stdout: their lines may run together, so read every
    # JSON object wherever it starts.
    decoder, out = json.JSONDecoder(), done.stdout
    rows = [decoder.raw_decode(out, m.start())[0] for m in re.finditer(r'\{"rank"', out)]
    assert sorted(r["rank"] for r in rows) == [0, 1], done.stdout[-2000:] + done.stderr[-2000:]
    for row in rows:
        assert row.get("error") == "AgreementError", row
        assert row["message"] == (
            f'torch backend start: ranks disagree: rank 0 says torch "{torch.__version__}", '
            'rank 1 says "0.0.0-other"'
        ), row


@pytest.mark.skipif(not stores_are_ordered(), reason="the shared-memory path needs ordered stores")
def test_a_local_peer_that_dies_is_named_within_a_second(tmp_path: Path) -> None:
    # Before: the survivors waited for FSDP_COMM_TIMEOUT (here 60 s: past this test's deadline).
    outputs = _run_world(tmp_path, "die", [3, 3, 3], 50, FSDP_COMM_TIMEOUT="60", DIE_RANK="1")
    death = _last(outputs[1])
    assert "died" in death, outputs[1]
    for rank in (0, 2):
        row = _last(outputs[rank])
        assert row.get("error") == "CommError", (rank, row, outputs[rank]["stderr"])
        assert (
            f"rank 1 (pid {death['pid']}) exited with status 3 while rank {rank} waited"
            in row["message"]
        ), row
        assert "all_gather_into_tensor" in row["message"]
        assert row["at"] - death["died"] < 2.0, (row, death)  # about a second, on a busy host


# ---- agree through a backend -------------------------------------------------------------------
class _CountingThreads(ThreadsBackend):
    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.calls: list[tuple[str, int]] = []

    def _all_reduce_impl(self, tensor: torch.Tensor, op: ReduceOp, async_op: bool) -> Any:
        self.calls.append((op.kind.name, tensor.numel()))
        return super()._all_reduce_impl(tensor, op, async_op)


def _agree_rank(be: ThreadsBackend, facts_by_rank: list[dict[str, Any]]) -> Any:
    mine = _CountingThreads(be.world, be.rank)
    try:
        agree(facts_by_rank[be.rank], what="layout", backend=mine)
        return ("agreed", mine.calls)
    except AgreementError as exc:
        return (str(exc), mine.calls)


def test_agreeing_facts_cost_one_small_all_reduce() -> None:
    facts = {"mesh": [1, 3], "units": 4, "sizes": list(range(100))}
    results = launch(_agree_rank, 3, backend="threads", args=([facts] * 3,), timeout=60)
    assert results == [("agreed", [("MAX", 10)])] * 3


def test_differing_facts_are_named_on_every_rank() -> None:
    facts = [{"units": 4, "mesh": [1, 3]}, {"units": 5, "mesh": [1, 3]}, {"units": 4}]
    results = launch(_agree_rank, 3, backend="threads", args=(facts,), timeout=60)
    want = (
        "layout: ranks disagree: rank 2 says mesh nothing, ranks 0, 1 say [1, 3]; "
        "rank 1 says units 5, ranks 0, 2 say 4"
    )
    for message, calls in results:
        assert message == want
        assert len(calls) == 2  # the digests, then the facts themselves


def test_one_rank_or_a_simulated_world_exchanges_nothing() -> None:
    be = _CountingThreads.create(1)[0]
    agree({"a": 1}, what="x", backend=be)
    assert be.calls == []
    from fsdp_comm import FakeBackend

    agree({"a": 1}, what="x", backend=FakeBackend(rank=3, world_size=8))  # on meta: nothing


def test_describe_differences_orders_odd_ones_out_first() -> None:
    assert describe_differences("w", {0: {"a": 1}, 1: {"a": 1}}) is None
    text = describe_differences("w", {0: {"a": 2}, 1: {"a": 1}, 2: {"a": 2}})
    assert text == "w: ranks disagree: rank 1 says a 1, ranks 0, 2 say 2"


class _Store:
    """A dict with the methods of a torch.distributed store `agree` uses."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def set(self, key: str, value: str) -> None:
        self.data[key] = value.encode()

    def get(self, key: str) -> bytes:
        return self.data[key]

    def check(self, keys: list[str]) -> bool:
        return all(k in self.data for k in keys)

    def add(self, key: str, n: int) -> int:
        value = int(self.data.get(key, b"0")) + n
        self.data[key] = str(value).encode()
        return value


def test_two_processes_claiming_one_rank_are_named() -> None:
    store = _Store()
    store.add("fsdp_comm/agree/launch/claim/0", 1)  # another process claimed rank 0 first
    with pytest.raises(AgreementError, match=r"two processes claim rank 0: pid \d+ on .* and"):
        agree({"a": 1}, what="launch", store=store, rank=0, world_size=1, timeout=1)


def test_a_store_that_fails_is_named() -> None:
    class Broken(_Store):
        def check(self, keys: list[str]) -> bool:
            raise RuntimeError("Connection reset by peer")

    with pytest.raises(CommError, match="rank 1 lost the rendezvous store"):
        agree({"a": 1}, what="launch", store=Broken(), rank=1, world_size=2, timeout=1)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"what": "x"}, "exactly one of backend= and store=, got neither"),
        ({"what": "", "store": _Store(), "rank": 0, "world_size": 1}, "what must be a non-empty"),
        ({"what": "a/b", "store": _Store(), "rank": 0, "world_size": 1}, "without '/'"),
        ({"what": "x", "store": _Store(), "rank": 2, "world_size": 2}, "rank must be < world"),
        ({"what": "x", "store": _Store(), "rank": 0, "world_size": 0}, "world_size must be >= 1"),
        ({"what": "x", "store": _Store(), "rank": 0, "world_size": 1, "timeout": 0}, "timeout"),
        (
            {"what": "x", "backend": ThreadsBackend.create(1)[0], "rank": 0},
            "rank is taken from backend=",
        ),
    ],
)
def test_bad_arguments_are_named(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        agree({"a": 1}, **kwargs)


@pytest.mark.parametrize(
    ("facts", "match"),
    [
        ([1, 2], "facts must be a mapping"),
        ({1: "a"}, "facts must have str keys, got 1"),
        ({"a": object()}, "facts must hold JSON values"),
        ({"a": float("nan")}, "facts must hold JSON values"),
    ],
)
def test_bad_facts_are_named(facts: Any, match: str) -> None:
    with pytest.raises(TypeError, match=match):
        agree(facts, what="x", store=_Store(), rank=0, world_size=1, timeout=1)


def test_rank_and_world_size_types_are_named() -> None:
    with pytest.raises(TypeError, match="rank must be an int >= 0 with store=, got '0'"):
        agree({"a": 1}, what="x", store=_Store(), rank="0", world_size=1)  # type: ignore[arg-type]
