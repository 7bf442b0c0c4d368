"""`ThreadWorld`: the rendezvous that the ranks of an in-process group meet at.

Each collective is one round, numbered by how many collectives a rank has issued. A rank posts
its input, waits until every rank has posted, computes its own output from the others' inputs,
then waits until every rank has finished reading before it returns (so no caller can overwrite
an input another rank still reads). A round that does not fill within the timeout, or an abort
from a failing rank, ends every waiting rank with a `CommError` naming the missing ranks.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ._errors import CommError, CommTimeoutError

__all__ = ["ThreadWorld"]


@dataclass
class _Round:
    collective: str
    payloads: list[Any]
    arrived: int = 0
    departed: int = 0
    posted: set[int] = field(default_factory=set)


class ThreadWorld:
    """Shared state of one in-process group of ``size`` ranks (``ranks`` names them for errors)."""

    def __init__(self, size: int, ranks: tuple[int, ...]) -> None:
        self.size = size
        self.ranks = ranks
        self._cond = threading.Condition()
        self._rounds: dict[int, _Round] = {}
        self._abort: CommError | None = None
        self._subworlds: dict[tuple[int, tuple[int, ...]], ThreadWorld] = {}

    def abort(self, error: CommError) -> None:
        """Fail every current and future collective of this world and its sub-groups."""
        with self._cond:
            if self._abort is None:
                self._abort = error
            subworlds = list(self._subworlds.values())
            self._cond.notify_all()
        for sub in subworlds:
            sub.abort(error)

    def subworld(self, key: tuple[int, tuple[int, ...]], ranks: tuple[int, ...]) -> ThreadWorld:
        """The sub-group made by the ``key``-th ``new_group`` call (same object on every rank)."""
        with self._cond:
            sub = self._subworlds.get(key)
            if sub is None:
                sub = ThreadWorld(len(ranks), tuple(self.ranks[r] for r in ranks))
                if self._abort is not None:
                    sub._abort = self._abort
                self._subworlds[key] = sub
            return sub

    def arrive(
        self, seq: int, rank: int, collective: str, payload: Any, timeout: float
    ) -> list[Any]:
        """Post ``payload`` for round ``seq`` and return every rank's payload once all arrived."""
        with self._cond:
            rnd = self._rounds.get(seq)
            if rnd is None:
                rnd = self._rounds[seq] = _Round(collective, [None] * self.size)
            if rnd.collective != collective:
                self._fail_locked(
                    CommError(
                        f"ranks disagree on collective number {seq}: rank {self.ranks[rank]} "
                        f"called {collective}, others called {rnd.collective}"
                    )
                )
            rnd.payloads[rank] = payload
            rnd.posted.add(rank)
            rnd.arrived += 1
            self._cond.notify_all()
            self._wait_locked(lambda: rnd.arrived == self.size, rnd, collective, timeout, "join")
            return rnd.payloads

    def depart(self, seq: int, collective: str, timeout: float) -> None:
        """Wait until every rank has finished reading the payloads of round ``seq``."""
        with self._cond:
            rnd = self._rounds[seq]
            rnd.departed += 1
            if rnd.departed == self.size:
                del self._rounds[seq]
            self._cond.notify_all()
            self._wait_locked(lambda: rnd.departed == self.size, rnd, collective, timeout, "finish")

    def _wait_locked(
        self, done: Callable[[], bool], rnd: _Round, collective: str, timeout: float, phase: str
    ) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            if self._abort is not None:
                raise self._abort
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = [self.ranks[r] for r in range(self.size) if r not in rnd.posted]
                what = (
                    f"ranks {missing} never joined" if phase == "join" else "ranks did not finish"
                )
                self._fail_locked(
                    CommTimeoutError(
                        f"{collective} on group ranks {list(self.ranks)} timed out after "
                        f"{timeout:g} s: {what} (FSDP_COMM_TIMEOUT sets the limit)"
                    )
                )
            self._cond.wait(remaining)
        if self._abort is not None and phase == "join":
            raise self._abort

    def _fail_locked(self, error: CommError) -> None:
        if self._abort is None:
            self._abort = error
        self._cond.notify_all()
        for sub in self._subworlds.values():
            sub.abort(error)  # sub-worlds have their own locks; no lock cycle
        raise self._abort
