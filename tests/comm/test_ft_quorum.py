"""The quorum of `fsdp_comm.FaultTolerantReplicate` (``_quorum.py``), on a real TCPStore in this
process: a replica group whose state is behind the last quorum's never decides a quorum of its
own while a member holding the newer state is alive (found on the two hosts, issue #31: hostB
cut off for longer than the timeout, back with its old step while hostA was between steps,
made a quorum of itself at that old step)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from fsdp_comm._errors import CommError
from fsdp_comm._quorum import Decision, Member, QuorumStore, connect_store

TIMEOUT_S = 0.6


def _address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def _leader(
    address: str, replica: int, *, host_it: bool = False, timeout: float = TIMEOUT_S
) -> QuorumStore:
    store = connect_store(address, host_it=host_it, timeout=10)
    return QuorumStore(
        store,
        address,
        replicas=2,
        replica=replica,
        timeout=timeout,
        heartbeat_timeout=0.4,
        token=f"token{replica}",
    )


@contextmanager
def _two_leaders() -> Iterator[tuple[QuorumStore, QuorumStore]]:
    """Replica 0's leader (hosting the store) and replica 1's; both closed at the end (a
    second close is harmless)."""
    address = _address()
    a = _leader(address, 0, host_it=True)
    b = _leader(address, 1)
    try:
        yield a, b
    finally:
        a.close()
        b.close()


def _member(replica: int, step: int, *, fresh: bool = False) -> Member:
    return Member(replica, f"token{replica}", step, fresh, False, 2)


def _decided(q: QuorumStore, k: int, *members: Member) -> None:
    """Round ``k`` as if decided: these members, at the newest of their steps."""
    step = max(m.step for m in members)
    q.store.set(f"q/{k}", Decision(k, members, k, step).to_json())
    q.store.set("q/latest", str(k))


@pytest.mark.timeout(60)
def test_a_replica_behind_waits_for_the_holder_to_admit_it() -> None:
    with _two_leaders() as (a, b):
        _decided(a, 5, _member(0, 10))  # replica 0 went on alone to step 10
        got: list[Decision] = []
        # Replica 0 registers for round 6 only after the timeout (a step longer than it, or a
        # pause): replica 1, back at step 3, must wait for it rather than decide alone.
        late = threading.Timer(3 * TIMEOUT_S, lambda: got.append(a.decide(6, _member(0, 10))))
        late.start()
        decision = b.decide(6, _member(1, 3))
        late.join()
        assert [m.replica for m in decision.members] == [0, 1], decision
        assert decision.step == 10 and got == [decision]
        assert [m.replica for m in decision.healers()] == [1]  # it receives the state


@pytest.mark.timeout(60)
def test_a_replica_behind_with_no_holder_alive_says_so() -> None:
    with _two_leaders() as (a, b):
        _decided(a, 5, _member(0, 10))
        a.close()  # replica 0's heartbeat stops: it is gone
        time.sleep(0.1)
        with pytest.raises(CommError, match=r"replica 1 came back at step 3, but no replica"):
            b.decide(6, _member(1, 3))


@pytest.mark.timeout(60)
def test_a_member_up_to_date_still_decides_after_the_timeout() -> None:
    """The rule is unchanged for a replica holding the newest step: a member of the last
    quorum that does not come within the timeout is left out."""
    with _two_leaders() as (a, b):
        _decided(a, 5, _member(0, 10), _member(1, 10))
        t0 = time.monotonic()
        decision = a.decide(6, _member(0, 11))  # replica 1 alive but never registers
        assert [m.replica for m in decision.members] == [0], decision
        assert time.monotonic() - t0 >= TIMEOUT_S


@pytest.mark.timeout(60)
def test_a_replica_left_out_waits_even_at_the_same_step() -> None:
    """Left out of the last quorum (its heartbeat stale for a while), it holds the step the
    quorum began at, not the one the quorum committed: it is admitted, not deciding alone."""
    with _two_leaders() as (a, b):
        _decided(a, 5, _member(0, 10))  # round 5 without replica 1: step 10 -> 11
        late = threading.Timer(3 * TIMEOUT_S, lambda: a.decide(6, _member(0, 11)))
        late.start()
        decision = b.decide(6, _member(1, 10))
        late.join()
        assert [m.replica for m in decision.members] == [0, 1] and decision.step == 11


@pytest.mark.timeout(60)
def test_the_heartbeat_resumes_once_the_store_is_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """A group cut off from the store for a while beats again once it is back (its beat ended
    at the first error before, and it was taken for dead while it took part)."""
    import fsdp_comm._quorum as quorum

    address = _address()
    store = connect_store(address, host_it=True, timeout=10)
    failures = iter([True, True, True])

    def flaky(address: str, *, host_it: bool, timeout: float) -> object:
        if next(failures, False):
            raise CommError("the store is out of reach (a cut link)")
        return connect_store(address, host_it=host_it, timeout=timeout)

    monkeypatch.setattr(quorum, "connect_store", flaky)
    q = QuorumStore(
        store, address, replicas=2, replica=1, timeout=1, heartbeat_timeout=0.5, token="t"
    )
    try:
        deadline = time.monotonic() + 20
        while int(store.add("hb/1/t", 0)) < 3:
            assert time.monotonic() < deadline, "the heartbeat never resumed"
            time.sleep(0.05)
    finally:
        q.close()


@pytest.mark.timeout(60)
def test_a_restarted_group_does_not_keep_its_predecessor_alive() -> None:
    """The heartbeat is the incarnation's: a vote waiting for a killed group's incarnation
    stops waiting once its beat stops, though the group's restart beats already."""
    address = _address()
    a = _leader(address, 0, host_it=True, timeout=30)  # a vote would wait 30 s for a live one
    old = _leader(address, 1)
    try:
        assert a.alive(1, "token1")
        old.close()  # killed
        new = QuorumStore(
            connect_store(address, host_it=False, timeout=10),
            address,
            replicas=2,
            replica=1,
            timeout=TIMEOUT_S,
            heartbeat_timeout=0.4,
            token="restarted",
        )
        try:
            t0 = time.monotonic()  # a vote with the old incarnation: dropped, not waited out
            assert not a.vote(6, True, [_member(0, 10), _member(1, 10)])
            assert time.monotonic() - t0 < 10
            assert a.alive(1, "restarted") and not a.alive(1, "token1")
        finally:
            new.close()
    finally:
        a.close()
