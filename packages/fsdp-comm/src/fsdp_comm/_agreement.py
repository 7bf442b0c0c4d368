"""`agree`: ranks check that they were started alike before they depend on each other.

Note [launch-time agreement]
    Two processes started against one ``MASTER_PORT`` with ``WORLD_SIZE`` 2 and 3 never form
    a group, and torch does not say so: the rank told 3 waits for a third address until its
    timeout ("wait timeout after 15000ms, keys: /default_pg/0//cpu//0/2"), while the rank told
    2 connected to the rank told 3 and could then hang in gloo's connection set-up, which has
    no deadline, until it was killed (seen for 90 s in issue #30; reproduced here in the
    initialisation and in a first all-gather). So before a `TorchBackend` initialises the
    default group from the environment, every rank posts a small JSON of its facts (world
    size, process-group backend, device type, fsdp-comm's and torch's versions) in the
    rendezvous store and reads every peer's, with ``FSDP_COMM_TIMEOUT`` as the deadline: a
    difference is named at once on every rank that sees it ("torch backend start: ranks
    disagree: rank 0 says world_size 2, rank 1 says 3"), and a peer that never comes is
    named when the deadline passes. Nothing waits in torch or gloo for a world that cannot
    form. Under torchrun, whose rendezvous sets every worker's RANK and WORLD_SIZE and whose
    agent keeps one store across restart rounds (keys a round left behind would pass for the
    next one's), the backend joins as torch does and agrees on the same facts through the new
    group instead (below).

    The same check serves layers above (the engine agrees on its shard layout at a root's lazy
    initialisation) through a backend: one all-reduce (MAX) of a digest of the facts and its
    negation, 10 int64 in all, tells whether every rank holds the same facts; only when they
    differ does a second all-reduce exchange the facts themselves, so that every rank names the
    same differences. A clean run pays the one small all-reduce.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import socket
import time
import uuid
from collections.abc import Mapping
from typing import Any, Protocol

import torch

from ._errors import AgreementError, CommError, CommTimeoutError
from ._fake_backend import FakeBackend
from ._reduce_op import ReduceOp
from ._settings import resolve_timeout

__all__ = ["agree", "launch_facts", "SupportsAllReduce"]

#: How long a rank that found a disagreement waits (at most) for the ranks that posted facts to
#: read them too, so that the process hosting the store does not take it away from under them.
_LINGER_S = 5.0
_MAX_NAMED = 6  # differing facts a message names (the rest are counted)
_MAX_VALUE_CHARS = 120
_DIGEST_WORDS = 4  # 32-bit words of the sha256 digest compared (128 bits)


class SupportsAllReduce(Protocol):
    """What `agree` needs of a backend (`fsdp_comm.Backend` has it, and so does the engine's
    ``CommBackend``)."""

    @property
    def rank(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    @property
    def device(self) -> torch.device: ...

    def all_reduce(self, tensor: torch.Tensor, *, op: Any = ..., async_op: bool = False) -> Any: ...


def agree(
    facts: Mapping[str, Any],
    *,
    what: str,
    backend: SupportsAllReduce | None = None,
    store: Any = None,
    rank: int | None = None,
    world_size: int | None = None,
    timeout: float | None = None,
) -> None:
    """Check that every rank passes equal ``facts``; raise `AgreementError` naming each fact
    that differs and which ranks say what (the same message on every rank that checks).

    Collective: every rank calls it with its own facts, a mapping of strings to JSON values
    (numbers, strings, bools, None, lists and mappings of them). ``what`` names the occasion in
    messages ("torch backend start", "fully_shard layout").

    Through a ``backend`` (any object with ``rank``, ``world_size``, ``device`` and
    ``all_reduce``): one all-reduce of 10 int64 when the facts agree, a second one to name the
    differences when they do not; the backend's own timeout bounds both. Nothing is exchanged
    for a world of one or a simulated one (`FakeBackend`, or any backend on ``meta``).

    Through a torch.distributed ``store`` (before any process group exists; ``rank`` and
    ``world_size`` required): each rank sets its facts under ``fsdp_comm/agree/<what>/<rank>``
    and reads every peer's, so call it once per store and ``what``. A peer that has not posted
    within ``timeout`` seconds (default ``FSDP_COMM_TIMEOUT``) raises `CommTimeoutError` naming
    the missing ranks; two processes claiming one rank raise `AgreementError`.
    """
    label = _check_what(what)
    payload = _canonical(facts)
    if (backend is None) == (store is None):
        both = "both" if backend is not None else "neither"
        raise ValueError(f"agree: pass exactly one of backend= and store=, got {both}")
    if backend is not None:
        for name, value in (("rank", rank), ("world_size", world_size), ("timeout", timeout)):
            if value is not None:
                raise ValueError(
                    f"agree: {name} is taken from backend= (and its timeout); pass {name} only "
                    f"with store=, got {name}={value!r}"
                )
        _agree_through_backend(backend, label, payload)
        return
    size = _check_int("world_size", world_size, 1)
    me = _check_int("rank", rank, 0)
    if me >= size:
        raise ValueError(f"agree: rank must be < world_size = {size}, got rank={me}")
    limit = resolve_timeout(timeout)
    _agree_through_store(store, label, payload, me, size, limit)


def launch_facts(process_group_backend: str, device_type: str, world_size: int) -> dict[str, Any]:
    """The facts ranks agree on before they form a torch.distributed group."""
    return {
        "world_size": world_size,
        "process_group_backend": process_group_backend,
        "device": device_type,
        "fsdp-comm": _version(),
        "torch": torch.__version__,
    }


# ---- arguments -------------------------------------------------------------------------------
def _check_what(what: Any) -> str:
    if not isinstance(what, str) or not what.strip() or "/" in what:
        raise ValueError(f"agree: what must be a non-empty string without '/', got {what!r}")
    return what


def _check_int(name: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"agree: {name} must be an int >= {low} with store=, got {value!r}")
    if value < low:
        raise ValueError(f"agree: {name} must be >= {low}, got {value}")
    return value


def _canonical(facts: Any) -> str:
    """``facts`` as canonical JSON (sorted keys, ASCII), which equal facts share."""
    if not isinstance(facts, Mapping):
        raise TypeError(f"agree: facts must be a mapping of str to JSON values, got {facts!r}")
    bad = [k for k in facts if not isinstance(k, str)]
    if bad:
        raise TypeError(f"agree: facts must have str keys, got {bad[0]!r}")
    try:
        return json.dumps(dict(facts), sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise TypeError(
            "agree: facts must hold JSON values (numbers, strings, bools, None, lists and "
            f"mappings of them), got {dict(facts)!r}: {exc}"
        ) from None


def _version() -> str:
    try:
        return importlib.metadata.version("fsdp-comm")
    except importlib.metadata.PackageNotFoundError:  # on sys.path without being installed
        return "0+unknown"


# ---- the message -----------------------------------------------------------------------------
def describe_differences(what: str, by_rank: Mapping[int, Mapping[str, Any]]) -> str | None:
    """The facts that differ among ``by_rank`` (rank -> facts), each as "rank 1 says KEY 3,
    rank 0 says 2" (the value held by fewer ranks first); None when all agree."""
    keys = sorted({k for facts in by_rank.values() for k in facts})
    parts = []
    missing = object()
    for key in keys:
        groups: dict[str, list[int]] = {}
        for r in sorted(by_rank):
            value = by_rank[r].get(key, missing)
            text = "nothing" if value is missing else json.dumps(value, sort_keys=True)
            if len(text) > _MAX_VALUE_CHARS:  # a long list: its start and length say enough
                text = f"{text[: _MAX_VALUE_CHARS - 20]}... ({len(text)} characters)"
            groups.setdefault(text, []).append(r)
        if len(groups) < 2:
            continue
        ordered = sorted(groups.items(), key=lambda item: (len(item[1]), item[1][0]))
        said = [
            f"{_ranks_text(ranks)} {'says' if len(ranks) == 1 else 'say'} "
            + (f"{key} {value}" if i == 0 else value)
            for i, (value, ranks) in enumerate(ordered)
        ]
        parts.append(", ".join(said))
    if not parts:
        return None
    more = f"; and {len(parts) - _MAX_NAMED} more" if len(parts) > _MAX_NAMED else ""
    return f"{what}: ranks disagree: " + "; ".join(parts[:_MAX_NAMED]) + more


def _ranks_text(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


# ---- through a backend -----------------------------------------------------------------------
def _agree_through_backend(backend: SupportsAllReduce, what: str, payload: str) -> None:
    world = backend.world_size
    device = backend.device
    if world == 1 or device.type == "meta" or isinstance(backend, FakeBackend):
        return  # no peers: nothing to compare with (and a simulated world's traffic unchanged)
    data = payload.encode()
    digest = hashlib.sha256(data).digest()
    words = [int.from_bytes(digest[4 * i : 4 * i + 4], "little") for i in range(_DIGEST_WORDS)]
    words.append(len(data))
    mine = torch.tensor(words + [-w for w in words], dtype=torch.int64, device=device)
    backend.all_reduce(mine, op=ReduceOp.MAX)
    seen = mine.tolist()
    n = len(words)
    if all(seen[i] == -seen[n + i] for i in range(n)):  # max == min: every rank the same
        return
    longest = seen[n - 1]
    rows = torch.zeros(world, longest, dtype=torch.int64, device=device)
    rows[backend.rank, : len(data)] = torch.tensor(list(data), dtype=torch.int64, device=device)
    backend.all_reduce(rows, op=ReduceOp.SUM)
    by_rank = {
        r: json.loads(bytes(v for v in row if v).decode()) for r, row in enumerate(rows.tolist())
    }
    message = describe_differences(what, by_rank)
    if message is None:  # equal JSON cannot digest differently: a backend that lost data
        raise AssertionError(f"{what}: the facts' digests differ but their contents agree")
    raise AgreementError(message)


# ---- through a store -------------------------------------------------------------------------
def _agree_through_store(
    store: Any, what: str, payload: str, rank: int, world_size: int, timeout: float
) -> None:
    """Post this rank's facts, read every peer's; the first rank to fail posts its error as the
    verdict, which every other rank still reading raises too (the same type and message)."""
    prefix = f"fsdp_comm/agree/{what}"
    mine = {"facts": json.loads(payload), "pid": os.getpid(), "host": socket.gethostname()}
    mine["token"] = uuid.uuid4().hex

    def call(fn: Any, *args: Any) -> Any:
        return _store_call(fn, *args, what=what, rank=rank)

    try:
        _post_and_read(call, store, prefix, what, mine, rank, world_size, timeout)
    except (AgreementError, CommTimeoutError) as exc:
        try:  # the first verdict stands: later ones are echoes of it
            if call(store.add, f"{prefix}/verdicts", 1) == 1:
                verdict = {"type": type(exc).__name__, "message": str(exc)}
                call(store.set, f"{prefix}/verdict", json.dumps(verdict))
        except CommError:
            pass
        _finish(store, prefix, failed=True)
        raise
    except BaseException:
        _finish(store, prefix, failed=True)
        raise
    _finish(store, prefix, failed=False)


def _post_and_read(
    call: Any,
    store: Any,
    prefix: str,
    what: str,
    mine: dict[str, Any],
    rank: int,
    world_size: int,
    timeout: float,
) -> None:
    deadline = time.monotonic() + timeout
    claims = call(store.add, f"{prefix}/claim/{rank}", 1)
    call(store.add, f"{prefix}/arrived", 1)
    own_key = f"{prefix}/{rank}"
    if claims > 1:
        other = _read(call, store, own_key) if call(store.check, [own_key]) else None
        raise AgreementError(_duplicate(what, rank, other, mine))
    call(store.set, own_key, json.dumps(mine))
    by_rank = {rank: mine}
    pending = [r for r in range(world_size) if r != rank]
    pause = 0.005
    while True:
        if call(store.check, [f"{prefix}/verdict"]):  # another rank failed first: its error
            verdict = json.loads(call(store.get, f"{prefix}/verdict"))
            cls = AgreementError if verdict.get("type") == "AgreementError" else CommTimeoutError
            raise cls(str(verdict.get("message")))
        for r in list(pending):
            if call(store.check, [f"{prefix}/{r}"]):
                by_rank[r] = _read(call, store, f"{prefix}/{r}")
                pending.remove(r)
        extra = f"{prefix}/{world_size}"  # a rank told a larger world, if it came already
        if world_size not in by_rank and call(store.check, [extra]):
            by_rank[world_size] = _read(call, store, extra)
        message = describe_differences(what, {r: p["facts"] for r, p in by_rank.items()})
        if message is not None:
            raise AgreementError(message)
        if not pending:
            break
        if time.monotonic() > deadline:
            raise CommTimeoutError(
                f"{what}: ranks {pending} of a world of {world_size} did not arrive within "
                f"{timeout:g} s (FSDP_COMM_TIMEOUT); ranks {sorted(by_rank)} did and agree "
                "(is every rank started, with the same world size and rendezvous address?)"
            )
        time.sleep(pause)
        pause = min(0.05, pause * 2)
    again = _read(call, store, own_key)
    if again.get("token") != mine["token"] or call(store.add, f"{prefix}/claim/{rank}", 0) > 1:
        raise AgreementError(_duplicate(what, rank, again, mine))  # claimed after us


def _finish(store: Any, prefix: str, *, failed: bool) -> None:
    """Count this rank as done; after a failure, wait (at most `_LINGER_S`) for every rank that
    posted to be done too: the process hosting the store (rank 0 outside torchrun) takes it
    with it when it exits, and the others are still to read the verdict."""
    try:
        store.add(f"{prefix}/done", 1)
        if not failed:
            return
        until = time.monotonic() + _LINGER_S
        while time.monotonic() < until:
            if store.add(f"{prefix}/done", 0) >= store.add(f"{prefix}/arrived", 0):
                return
            time.sleep(0.01)
    except Exception:  # the store is gone: nobody is left to wait for
        return


def _duplicate(
    what: str, rank: int, other: Mapping[str, Any] | None, mine: Mapping[str, Any]
) -> str:
    theirs = (
        f"pid {other.get('pid')} on {other.get('host')}"
        if other is not None and other.get("token") != mine["token"]
        else "another process"
    )
    return (
        f"{what}: two processes claim rank {rank}: pid {mine['pid']} on {mine['host']} and "
        f"{theirs}; give every process its own RANK"
    )


def _read(call: Any, store: Any, key: str) -> dict[str, Any]:
    raw = call(store.get, key)
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict) or not isinstance(value.get("facts"), dict):
        raise CommError(f"the store holds something else under {key!r}: {text[:200]!r}")
    return value


def _store_call(fn: Any, *args: Any, what: str, rank: int) -> Any:
    try:
        return fn(*args)
    except Exception as exc:
        raise CommError(
            f"{what}: rank {rank} lost the rendezvous store ({exc}); the process hosting it "
            "(rank 0, for ranks started by hand) has probably exited: see its error"
        ) from exc
