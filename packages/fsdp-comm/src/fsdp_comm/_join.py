"""Joining a world from the environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``), the ranks agreeing first on what they were told (Note [launch-time
agreement] in ``_agreement.py``)."""

from __future__ import annotations

import datetime
import os
from typing import Any

import torch
import torch.distributed as dist

from ._agreement import agree, launch_facts
from ._errors import CommError

__all__ = ["STARTING", "join_from_environment"]

#: What the launch-time agreement is called in its messages and store keys.
STARTING = "torch backend start"


def join_from_environment(
    pg_backend: str, dev: torch.device, timeout: float, td: datetime.timedelta
) -> dict[str, Any] | None:
    """torch's ``env://`` join, with the ranks' agreement first (Note [launch-time agreement]
    in _agreement.py): the same store torch would make (`launch`'s, or one that rank 0
    hosts), whose host does not wait for the others to connect, since `agree` waits for them
    with names; then the group over that store, under torch's own prefix. Under torchrun, its
    own join, and the launch facts returned to be agreed on through the group."""
    facts = launch_facts(pg_backend, dev.type, _env_int("WORLD_SIZE", 1))
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        # torchrun's rendezvous gave every worker its RANK and WORLD_SIZE, and its agent's
        # store outlives restarts (torch shares it between rounds): keys an earlier round
        # left there would pass for this round's. So no store exchange here.
        try:
            dist.init_process_group(pg_backend, init_method="env://", timeout=td)
        except Exception as exc:
            raise CommError(
                f"torch backend: initialising the default process group failed: {exc}"
            ) from exc
        return facts
    rank = _env_int("RANK", 0)
    world_size = _env_int("WORLD_SIZE", 1)
    if rank >= world_size:
        raise ValueError(f"RANK must be < WORLD_SIZE = {world_size}, got RANK={rank}")
    addr = os.environ.get("MASTER_ADDR", "").strip()
    port = _env_int("MASTER_PORT", 0)
    if not addr or port > 65535:
        raise ValueError(
            "MASTER_ADDR (a host name or address) and MASTER_PORT (0..65535) must be set to "
            f"join a world of {world_size}, got MASTER_ADDR={addr!r} MASTER_PORT={port}"
        )
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    host = rank == 0 and not agent
    try:
        # Not re-exported in torch's stubs, hence the ignore.
        store = dist.TCPStore(  # type: ignore[attr-defined]
            addr,
            port,
            world_size,
            is_master=host,
            timeout=td,
            wait_for_workers=False,
            multi_tenant=host,
            use_libuv=os.environ.get("USE_LIBUV", "1") == "1",
        )
    except Exception as exc:
        where = "hosting" if host else "reaching"
        raise CommError(
            f"torch backend: rank {rank} of {world_size} failed {where} the rendezvous store at "
            f"{addr}:{port} (MASTER_ADDR:MASTER_PORT) within {timeout:g} s: {exc}"
        ) from exc
    agree(facts, what=STARTING, store=store, rank=rank, world_size=world_size, timeout=timeout)
    try:
        # torch's env:// join puts the group's keys under this prefix, as here.
        prefixed = dist.PrefixStore("default_pg", store)  # type: ignore[attr-defined]
        dist.init_process_group(
            pg_backend, store=prefixed, rank=rank, world_size=world_size, timeout=td
        )
    except Exception as exc:
        raise CommError(
            f"torch backend: initialising the default process group failed: {exc}"
        ) from exc
    return None


def _env_int(name: str, low: int) -> int:
    raw = os.environ.get(name, "")
    try:
        value = int(raw)
    except ValueError:
        value = low - 1
    if value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {name}={raw!r}")
    return value
