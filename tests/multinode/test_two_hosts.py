"""`fsdp train` across two hosts (issue #13, items 2 and 7).

torchrun starts 2 ranks on each of hostA and hostB (``scripts/two-hosts``: two network
namespaces joined by a veth pair), which rendezvous on hostA's address. The losses are those of
4 local ranks, with full and with hybrid sharding; the bytes that cross the veth in a step are
what `fsdp plan` predicts for the same model and layout; and a checkpoint saved by the 4 ranks
resumes on one host with 3 ranks, giving the losses of the uninterrupted run.

The model is ``small`` (3.3 M parameters, 13.3 MB of fp32 parameters): every unit is at least
256 KiB, so every all-gather and reduce-scatter between the hosts is the torch backend's
pairwise exchange (Note [gloo algorithms]) and the step's traffic dwarfs the few bytes each
collective adds. Each run starts 4 processes; on 2 cores the module takes 3-4 minutes.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ._hosts import DATA, TwoHosts, environment, summary

pytestmark = [pytest.mark.multinode, pytest.mark.slow, pytest.mark.timeout(900)]

GPUS, PER_NODE = 4, 2
GLOBAL_BATCH = 12  # divisible by 4 ranks and by the 3 that resume
STEPS = 2  # on the two hosts; the local reference runs 4
TRAIN = [
    "--model",
    "small",
    "--global-batch",
    str(GLOBAL_BATCH),
    "--no-progress",
    "--json",
    "--data",
    str(DATA),
]
HYBRID = ["--strategy", "hybrid_shard", "--shard-size", str(PER_NODE)]
RUN_TIMEOUT = 300  # seconds for one run of fsdp train
PAIRWISE_MIN_BYTES = 256 << 10  # fsdp_comm's DEFAULT_*_PAIRWISE_MIN_BYTES


def train_two_hosts(
    hosts: TwoHosts, workdir: Path, tag: str, args: list[str]
) -> tuple[dict[str, Any], int]:
    """``fsdp train ARGS`` on 2 hosts x 2 ranks: rank 0's summary and the bytes that crossed
    the link meanwhile (both directions)."""
    before = hosts.link_bytes()
    a, b = hosts.torchrun(["-m", "fsdp", "train", *args], workdir, tag=tag)
    try:
        codes = a.wait(RUN_TIMEOUT), b.wait(RUN_TIMEOUT)
    finally:
        hosts.stop(a, b)
    assert codes == (0, 0), f"torchrun exited {codes}:\n{a.output()[-3000:]}\n{b.output()[-3000:]}"
    return summary(a), hosts.link_bytes() - before


def train_local(args: list[str], world_size: int) -> dict[str, Any]:
    """``fsdp train --world-size N ARGS`` on this machine (local ranks over gloo)."""
    done = subprocess.run(
        [sys.executable, "-m", "fsdp", "train", "--world-size", str(world_size), *args],
        env=environment(),
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(ln for ln in reversed(done.stdout.splitlines()) if ln.startswith('{"summary"'))
    return json.loads(line)["summary"]


def plan(*args: str) -> dict[str, Any]:
    """`fsdp plan ... --json` for the test's model on 2 nodes x 2 GPUs."""
    from fsdp._cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert (
            main(
                [
                    "plan",
                    "--model",
                    "small",
                    "--gpus",
                    str(GPUS),
                    "--gpus-per-node",
                    str(PER_NODE),
                    "--json",
                    *args,
                ]
            )
            == 0
        )
    return json.loads(out.getvalue())


def link_bytes_per_step(p: dict[str, Any]) -> float:
    """Bytes that cross the link between the two nodes in one step, from the plan's collectives.

    `fsdp plan`'s ``sent_bytes`` is what one GPU sends per step with ring algorithms, and its
    cross-node figure counts all of a collective's traffic when its group spans nodes (the
    paper's Section 3.2.2 accounting). The link sees, summed over the GPUs, the part sent to a
    peer on the other node:

    - all-gather and reduce-scatter over the world (full sharding): the pairwise exchange
      sends ``B/n`` to each of the ``n-1`` peers, and ``n-G`` of them are on the other node:
      ``(n-G)/(n-1)`` of ``sent_bytes`` (2/3 here), from every GPU;
    - all-reduce across replicas (hybrid sharding, one rank per node): gloo's ring sends it
      all to the other node: all of ``sent_bytes``, from every GPU.
    """
    total = 0.0
    for c in p["comm"]["collectives"]:
        if not c["cross_node"]:
            continue
        n = c["group_size"]
        if c["kind"] in ("all_gather", "reduce_scatter"):
            assert n == GPUS, c  # a shard group spanning nodes is the world here
            assert smallest_unit_bytes(p) >= PAIRWISE_MIN_BYTES, (
                "a unit is too small for the pairwise exchange: gloo's own algorithm runs"
            )
            share = (n - PER_NODE) / (n - 1)
        else:
            assert c["kind"] == "all_reduce" and n == GPUS // PER_NODE, c
            share = 1.0
        total += GPUS * c["sent_bytes"] * share
    return total


def smallest_unit_bytes(p: dict[str, Any]) -> int:
    """fp32 bytes of the smallest unit, the root or a block."""

    def numel(shapes: list[list[int]]) -> int:
        return sum(math.prod(s) for s in shapes)

    return 4 * min(numel(p["model"]["root_params"]), numel(p["model"]["block_params"]))


@pytest.fixture(scope="module")
def full_shard(two_hosts: TwoHosts, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("full")
    ckpt = work / "ckpt"
    hosts, moved = train_two_hosts(
        two_hosts, work, "full", [*TRAIN, "--steps", str(STEPS), "--save", str(ckpt)]
    )
    local = train_local([*TRAIN, "--steps", str(2 * STEPS)], GPUS)
    return {"hosts": hosts, "bytes": moved, "local": local, "ckpt": ckpt}


@pytest.fixture(scope="module")
def hybrid_shard(two_hosts: TwoHosts, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("hybrid")
    hosts, moved = train_two_hosts(
        two_hosts, work, "hybrid", [*TRAIN, *HYBRID, "--steps", str(STEPS)]
    )
    local = train_local([*TRAIN, *HYBRID, "--steps", str(STEPS)], GPUS)
    return {"hosts": hosts, "bytes": moved, "local": local}


def test_full_shard_losses_are_four_local_ranks(full_shard: dict[str, Any]) -> None:
    print(
        f"full_shard losses: two hosts {full_shard['hosts']['losses']}, local "
        f"{full_shard['local']['losses']}"
    )
    assert full_shard["hosts"]["losses"] == pytest.approx(
        full_shard["local"]["losses"][:STEPS], abs=1e-6
    )


def test_full_shard_link_bytes_are_the_plans(full_shard: dict[str, Any]) -> None:
    expected = link_bytes_per_step(plan("--strategy", "full_shard"))
    measured = full_shard["bytes"] / STEPS  # the start-up and the save add ~0.1%
    print(f"full_shard: {measured:,.0f} bytes per step crossed the link; plan: {expected:,.0f}")
    assert measured == pytest.approx(expected, rel=0.10), (measured, expected)


def test_hybrid_losses_are_four_local_ranks(hybrid_shard: dict[str, Any]) -> None:
    print(
        f"hybrid_shard losses: two hosts {hybrid_shard['hosts']['losses']}, local "
        f"{hybrid_shard['local']['losses']}"
    )
    assert hybrid_shard["hosts"]["losses"] == pytest.approx(
        hybrid_shard["local"]["losses"], abs=1e-6
    )


def test_hybrid_shard_groups_are_the_hosts(hybrid_shard: dict[str, Any]) -> None:
    """Only the all-reduce across replicas crosses the link: were a shard group to span the
    hosts, its all-gathers and reduce-scatters would cross too, several times the bytes."""
    p = plan("--strategy", "hybrid_shard", "--shard-size", str(PER_NODE))
    assert [c["kind"] for c in p["comm"]["collectives"] if c["cross_node"]] == ["all_reduce"]
    expected = link_bytes_per_step(p)
    measured = hybrid_shard["bytes"] / STEPS
    print(f"hybrid_shard: {measured:,.0f} bytes per step crossed the link; plan: {expected:,.0f}")
    assert measured == pytest.approx(expected, rel=0.10), (measured, expected)


def test_resume_on_one_host_with_three_ranks(full_shard: dict[str, Any]) -> None:
    """The 2 x 2 ranks' checkpoint of step 2, resumed by 3 local ranks, gives steps 3 and 4 of
    the uninterrupted 4-rank run (the global batch is the same at any world size)."""
    resumed = train_local(
        [*TRAIN, "--steps", str(2 * STEPS), "--resume", str(full_shard["ckpt"])], 3
    )
    print(f"resumed on 3 ranks: {resumed['losses']}")
    assert resumed["start_step"] == STEPS
    assert resumed["losses"] == pytest.approx(full_shard["local"]["losses"][STEPS:], abs=1e-5)
