"""The quorum of live replica groups, agreed step by step through a rendezvous store.

The protocol is Note [fault-tolerant replicas] in ``_ft_replicate.py``; this module is its
store side: registrations, heartbeats, the quorum decision and the commit vote. Only a replica
group's leader (its shard rank 0) calls it; the leader hands what was decided to its shard
group.
"""

from __future__ import annotations

import datetime
import json
import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

import torch.distributed as dist

from ._errors import CommError, CommTimeoutError

__all__ = ["Member", "Decision", "QuorumStore", "connect_store", "parse_address"]

_log = logging.getLogger("fsdp.comm")
_POLL_S = 0.01
_HEARTBEAT_EVERY_S = 0.2


@dataclass(frozen=True)
class Member:
    """One replica group's registration for a round. ``token`` names the incarnation (a
    restarted group has a new one); ``fresh``: it never took part in a quorum (it holds no
    training state yet); ``failed``: its last step was dropped or its last round broke, so the
    replica process groups must be built anew."""

    replica: int
    token: str
    step: int
    fresh: bool
    failed: bool
    shards: int


@dataclass(frozen=True)
class Decision:
    """The quorum of one round: its members (by replica index), the epoch of its replica
    process groups (the round where they were last rebuilt) and the newest step any member
    holds."""

    round: int
    members: tuple[Member, ...]
    epoch: int
    step: int

    def to_json(self) -> str:
        return json.dumps(
            {
                "round": self.round,
                "epoch": self.epoch,
                "step": self.step,
                "members": [asdict(m) for m in self.members],
            }
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> Decision:
        raw = json.loads(text)
        members = tuple(Member(**m) for m in raw["members"])
        return cls(int(raw["round"]), members, int(raw["epoch"]), int(raw["step"]))

    def index_of(self, replica: int, token: str) -> int | None:
        """This incarnation's position among the members, None when it is not one."""
        for i, m in enumerate(self.members):
            if m.replica == replica and m.token == token:
                return i
        return None

    def healers(self) -> list[Member]:
        """Members that must receive the state: behind the newest step, or fresh while some
        member holds state."""
        holders = [m for m in self.members if not m.fresh]
        return [m for m in self.members if m.step < self.step or (m.fresh and bool(holders))]


def _beat_key(replica: int, token: str) -> str:
    return f"hb/{replica}/{token}"


def parse_address(address: str) -> tuple[str, int]:
    """``host:port`` of the rendezvous store."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(
            f"the fault-tolerant rendezvous store must be 'host:port' (FSDP_FT_STORE), "
            f"got {address!r}"
        )
    return host, int(port)


def connect_store(address: str, *, host_it: bool, timeout: float) -> Any:
    """A client of the rendezvous store at ``address`` (hosting it when ``host_it``)."""
    host, port = parse_address(address)
    try:
        return dist.TCPStore(  # type: ignore[attr-defined]
            host,
            port,
            is_master=host_it,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=timeout),
        )
    except Exception as exc:  # DistNetworkError, RuntimeError: the store is not there
        what = "host" if host_it else "reach"
        raise CommError(
            f"cannot {what} the fault-tolerant rendezvous store at {address} within "
            f"{timeout:g} s: {exc}"
        ) from exc


class QuorumStore:
    """A replica group leader's side of the rendezvous store."""

    def __init__(
        self,
        store: Any,  # a torch TCPStore
        address: str,
        *,
        replicas: int,
        replica: int,
        timeout: float,
        heartbeat_timeout: float,
        token: str = "",
    ) -> None:
        self.store = store
        self._address = address
        self.replicas = replicas
        self.replica = replica
        self.token = token  # this incarnation's: its heartbeat is its own
        self.timeout = timeout
        self.heartbeat_timeout = heartbeat_timeout
        self._seen: dict[tuple[int, str], tuple[int, float]] = {}
        self._beaten = 0.0  # the main thread's last beat (_beat_here)
        self._stop = threading.Event()
        self._beat = threading.Thread(
            target=self._heartbeat, name=f"fsdp-comm-ft-heartbeat-replica{replica}", daemon=True
        )
        self._beat.start()

    # ---- liveness ----------------------------------------------------------------------------
    def _heartbeat(self) -> None:
        """Bump this incarnation's counter every 0.2 s on a connection of its own (a store
        client is not shared across threads).

        The counter is the incarnation's, not the replica's: a restarted group beating under
        the replica's key kept its dead predecessor alive to the others, who waited out the
        whole timeout for its vote. A failed beat (the store out of reach: a cut link) is
        retried on a new connection, bounded by the heartbeat timeout, until `close`: a group
        cut off for a while whose processes lived on beats again once the link is back, and is
        admitted as any group coming back; ending the beat at the first error left it taken
        for dead while it took part in quorums, every step with it dropped. (Both found on the
        two hosts, 2026-11-27.)"""
        own: Any = None
        failing = False
        while not self._stop.is_set():
            try:
                if own is None:
                    own = connect_store(
                        self._address, host_it=False, timeout=self.heartbeat_timeout
                    )
                own.add(_beat_key(self.replica, self.token), 1)
                if failing:
                    _log.warning("fault-tolerant heartbeat of replica %d resumed", self.replica)
                    failing = False
            except Exception as exc:  # noqa: BLE001 - a background thread: log, never raise
                if not failing and not self._stop.is_set():
                    _log.warning(
                        "fault-tolerant heartbeat of replica %d failed (retrying): %s",
                        self.replica,
                        exc,
                    )
                failing, own = True, None
            self._stop.wait(_HEARTBEAT_EVERY_S)

    def _beat_here(self) -> None:
        """A beat from the leader's own thread, every 0.2 s at most, while it waits in the
        store: a sign of life that does not depend on the heartbeat's connection (back later
        than the leader's own after a cut link)."""
        now = time.monotonic()
        if now - self._beaten >= _HEARTBEAT_EVERY_S:
            self._beaten = now
            self._call("add", _beat_key(self.replica, self.token), 1)

    def alive(self, replica: int, token: str) -> bool:
        """Whether the heartbeat of ``replica``'s incarnation ``token`` advanced within the
        heartbeat timeout (one first looked at now counts as alive for that long)."""
        value = int(self._call("add", _beat_key(replica, token), 0))
        now = time.monotonic()
        last = self._seen.get((replica, token))
        if last is None or last[0] != value:
            self._seen[(replica, token)] = (value, now)
            return True
        return now - last[1] < self.heartbeat_timeout

    def close(self) -> None:
        """Stop the heartbeat, and wait for its thread (bounded by its connection's timeout):
        a process that exits while the thread is in a store call aborts (``terminate called
        without an active exception``; seen on the two hosts, 2026-11-27)."""
        self._stop.set()
        if self._beat is not threading.current_thread():
            self._beat.join(timeout=2 * self.heartbeat_timeout + 1.0)

    # ---- rounds ------------------------------------------------------------------------------
    def latest_round(self) -> int:
        """The first round not decided yet (a joiner registers for it)."""
        k = int(self._get("q/latest")) if self._check("q/latest") else -1
        while self._check(f"q/{k + 1}"):
            k += 1
        return k + 1

    def decision(self, k: int) -> Decision | None:
        return Decision.from_json(self._get(f"q/{k}")) if self._check(f"q/{k}") else None

    def decide(self, k: int, me: Member) -> Decision:
        """Register ``me`` for round ``k`` and return the round's decision. The first leader to
        propose fixes it (compare-and-set on ``q/k``); before proposing, a leader waits for
        every member of round ``k - 1`` to register, to stop its heartbeat, or for the timeout
        (round 0: for every replica, or the timeout). A replica that was not a member of the
        previous quorum (fresh, or cut off for a while and left out), or is behind its step,
        never proposes while a member of it is alive (a quorum of its own would roll the
        training back): it waits for the members to admit it."""
        self._call("set", f"q/{k}/m/{me.replica}", json.dumps(asdict(me)))
        self._beat_here()
        prev = self.decision(k - 1) if k > 0 else None
        if prev is None:
            expected = set(range(self.replicas)) - {me.replica}
        else:
            expected = {m.replica for m in prev.members} - {me.replica}
        tokens = {m.replica: m.token for m in prev.members} if prev is not None else {}
        # Not a member of the last quorum (a new incarnation, or one left out), or behind it.
        joining = (
            prev is not None
            and prev.step > 0
            and (prev.index_of(me.replica, me.token) is None or me.step < prev.step)
        )
        start = time.monotonic()
        deadline = start + self.timeout
        hard = start + 10 * self.timeout  # a fresh replica waits for the living, not forever
        while True:
            if self._check(f"q/{k}"):
                return self._decided(k)
            self._beat_here()
            waiting = [r for r in expected if not self._check(f"q/{k}/m/{r}")]
            if prev is not None:
                waiting = [r for r in waiting if self.alive(r, tokens[r])]
            now = time.monotonic()
            if joining and prev is not None:
                # A replica coming back (restarted, or cut off and left out): only a member
                # holding the state may decide. One left out deciding alone after the timeout
                # made a quorum of its old step while the others held a newer one (a cut link
                # on the two hosts, 2026-11-27).
                if not any(self.alive(r, tokens[r]) for r in expected):
                    back = "" if me.fresh else f" at step {me.step}"
                    raise CommError(
                        f"replica {me.replica} came back{back}, but no replica of the last quorum "
                        f"(round {prev.round}, step {prev.step}, replicas "
                        f"{[m.replica for m in prev.members]}) is alive to hand it the state: "
                        "restart every replica from the last checkpoint"
                    )
                if now > hard:
                    raise CommTimeoutError(
                        f"replica {me.replica} waited {now - start:.1f} s to be admitted to a "
                        f"quorum (round {k}); replicas {sorted(expected)} are alive but did not "
                        "decide one"
                    )
            elif not waiting or now > deadline:
                break
            time.sleep(_POLL_S)
        members = self._registered(k)
        same = prev is not None and [(m.replica, m.token) for m in members] == [
            (m.replica, m.token) for m in prev.members
        ]
        epoch = (
            prev.epoch if same and prev is not None and not any(m.failed for m in members) else k
        )
        step = max(m.step for m in members)
        proposal = Decision(k, tuple(members), epoch, step)
        self._call("compare_set", f"q/{k}", "", proposal.to_json())
        return self._decided(k)

    def _decided(self, k: int) -> Decision:
        self._call("set", "q/latest", str(k))
        for old in (f"q/{k - 2}/m/{self.replica}", f"v/{k - 2}/{self.replica}"):
            self._call("delete_key", old)
        return Decision.from_json(self._get(f"q/{k}"))

    def _registered(self, k: int) -> list[Member]:
        out = []
        for r in range(self.replicas):
            key = f"q/{k}/m/{r}"
            if self._check(key):
                out.append(Member(**json.loads(self._get(key))))
        return out

    def vote(self, k: int, ok: bool, members: Iterable[Member]) -> bool:
        """This replica's vote on round ``k``'s step; True when the step is committed: every
        member voted yes. A no, a member that stopped its heartbeat or one that did not vote
        within the timeout drops it for all (compare-and-set on ``c/k``: one outcome)."""
        self._call("set", f"v/{k}/{self.replica}", "1" if ok else "0")
        self._beat_here()
        outcome = "drop"
        if ok:
            tokens = {m.replica: m.token for m in members if m.replica != self.replica}
            others = list(tokens)
            deadline = time.monotonic() + self.timeout
            while True:
                if self._check(f"c/{k}"):
                    break
                self._beat_here()
                missing = [r for r in others if not self._check(f"v/{k}/{r}")]
                votes = [self._get(f"v/{k}/{r}") for r in others if r not in missing]
                if any(v != b"1" for v in votes):
                    break
                if not missing:
                    outcome = "commit"
                    break
                if time.monotonic() > deadline or not all(
                    self.alive(r, tokens[r]) for r in missing
                ):
                    break
                time.sleep(_POLL_S)
        got = self._call("compare_set", f"c/{k}", "", outcome)
        assert isinstance(got, bytes)  # TCPStore.compare_set returns the stored value
        if k >= 3:
            self._call("delete_key", f"c/{k - 3}")
        return got == b"commit"

    # ---- store calls -------------------------------------------------------------------------
    def _check(self, key: str) -> bool:
        return bool(self._call("check", [key]))

    def _get(self, key: str) -> bytes:
        got = self._call("get", key)
        assert isinstance(got, bytes)  # TCPStore.get returns the value's bytes
        return got

    def _call(self, name: str, *args: object) -> bytes | int | bool:
        try:
            result: bytes | int | bool = getattr(self.store, name)(*args)
        except Exception as exc:  # DistStoreError, DistNetworkError: the store host is gone
            raise CommError(
                f"fault-tolerant rendezvous store at {self._address}: {name}{args[:1]} "
                f"failed on replica {self.replica}: {exc}"
            ) from exc
        return result
