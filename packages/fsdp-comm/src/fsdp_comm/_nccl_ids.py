"""Rendezvous of NCCL communicators through a torch.distributed store.

Group rank 0 calls ``ncclGetUniqueId`` and publishes the id under a key unique to that
communicator; the other members wait for the key (bounded by the backend's timeout) and read it.
Keys must be the same on every member and never reused within one store:

- a world communicator's key counts how many times ranks joined a world of that size through
  this store (every member joins exactly once per creation, and a rank cannot start the next
  creation before the previous one completed, since creating is collective), so it needs no
  per-process state and also works for several ranks in one process;
- a sub-group's key extends its parent's key with the parent's group counter (every rank of the
  parent calls ``new_group`` in the same order) and the member ranks.
"""

from __future__ import annotations

import datetime
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from ._errors import CommError, CommTimeoutError

__all__ = [
    "KEY_PREFIX",
    "world_key",
    "group_key",
    "exchange_unique_id",
    "store_from_env",
    "run_with_deadline",
]

KEY_PREFIX = "fsdp_comm/cupy-nccl"

T = TypeVar("T")


def world_key(store: Any, world_size: int) -> str:
    """The store key of this creation of a world communicator (same on every member)."""
    joins = int(store.add(f"{KEY_PREFIX}/joins/ws{world_size}", 1))
    return f"{KEY_PREFIX}/ws{world_size}/world{(joins - 1) // world_size}"


def group_key(parent_key: str, index: int, world_ranks: Sequence[int]) -> str:
    """The store key of the ``index``-th group made from the communicator at ``parent_key``."""
    return f"{parent_key}/group{index}/ranks{'-'.join(str(r) for r in world_ranks)}"


def exchange_unique_id(
    store: Any,
    key: str,
    *,
    is_root: bool,
    make_id: Callable[[], bytes],
    timeout: float,
    who: str,
) -> bytes:
    """Publish ``make_id()`` under ``key`` on the root; wait for it and read it elsewhere.

    ``who`` names the caller in errors (collective, rank and group ranks). A root that never
    publishes ends in `CommTimeoutError` after ``timeout`` seconds; a store that fails
    otherwise (its host died) in `CommError`.
    """
    if is_root:
        uid = make_id()
        try:
            store.set(key, uid)
        except Exception as exc:
            raise CommError(
                f"{who}: publishing the NCCL unique id under store key {key!r} failed: {exc}"
            ) from exc
        return uid
    try:
        store.wait([key], datetime.timedelta(seconds=timeout))
        return bytes(store.get(key))
    except Exception as exc:
        text = str(exc)
        if "timeout" in text.lower() or "timed out" in text.lower():
            raise CommTimeoutError(
                f"{who}: no NCCL unique id under store key {key!r} after {timeout:g} s; is group "
                "rank 0 alive, and does every rank create the same groups in the same order?"
            ) from exc
        raise CommError(
            f"{who}: reading the NCCL unique id (store key {key!r}) failed: {text}"
        ) from exc


def store_from_env(rank: int, world_size: int, timeout: float) -> Any:
    """A store for ``world_size`` ranks from torchrun's variables, as ``env://`` builds it.

    A world of one needs nobody else: an in-memory `HashStore`. Otherwise a `TCPStore` at
    ``MASTER_ADDR:MASTER_PORT``, hosted by rank 0 unless an agent (torchrun, `launch`) already
    hosts it (``TORCHELASTIC_USE_AGENT_STORE=True``).
    """
    import torch.distributed as dist

    if world_size == 1:
        return dist.HashStore()  # type: ignore[attr-defined]  # not re-exported in torch's stubs
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port:
        raise ValueError(
            f"cupy-nccl: world_size={world_size} needs a store: pass store= (a "
            "torch.distributed Store) or set MASTER_ADDR and MASTER_PORT as torchrun does"
        )
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    try:
        # multi_tenant: several backends in one rank-0 process share one server on the port.
        return dist.TCPStore(  # type: ignore[attr-defined]  # not re-exported in torch's stubs
            addr,
            int(port),
            world_size,
            is_master=rank == 0 and not agent,
            timeout=datetime.timedelta(seconds=timeout),
            wait_for_workers=False,
            multi_tenant=True,
        )
    except Exception as exc:
        raise CommError(
            f"cupy-nccl: rank {rank} could not reach the store at {addr}:{port}: {exc}"
        ) from exc


def run_with_deadline(fn: Callable[[], T], timeout: float, what: str) -> T:
    """Run a call that may block forever (``ncclCommInitRank`` waits for every member) on a
    daemon thread; `CommTimeoutError` if it has not returned within ``timeout`` seconds.

    The thread is left behind on timeout: a blocking NCCL call cannot be interrupted.
    """
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # handed to the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=target, name="fsdp-nccl-init", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise CommTimeoutError(
            f"{what} did not finish within {timeout:g} s (FSDP_COMM_TIMEOUT); "
            "a member of the group may not have joined"
        )
    if "error" in box:
        raise box["error"]
    return box["value"]  # type: ignore[no-any-return]
