"""Which error `launch` raises when ranks fail: the root cause, not its echoes on other ranks.

When one rank fails, its peers usually fail too, because of it: a collective with the dead
rank raises `CommError`, an in-process group is aborted, or library code that agreed on the
outcome raises "abandoned: another rank failed (its error is raised there)". `launch` raises
the error with the best standing and keeps every other rank's error as a note on it:

1. a rank's own error (``OWN``);
2. a rank that exited without a word (``DEATH``: killed, ``os._exit``, a crash);
3. an echo (``ECHO``): a `CommError`, an error raised while handling one (its ``__cause__`` or
   ``__context__`` chain holds one), or an error whose message says another rank failed.

Ties go to the lowest rank, so the choice never depends on the order in which ranks report.
"""

from __future__ import annotations

import pickle
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from ._errors import CommError

__all__ = [
    "OWN",
    "DEATH",
    "ECHO",
    "RankFailure",
    "standing",
    "as_rank_error",
    "pick_root",
    "is_settled",
    "notes_for",
]

OWN, DEATH, ECHO = 0, 1, 2

# Phrases of errors raised because another rank failed: fsdp-ckpt's "abandoned: another rank
# failed ... (its error is raised there)", gloo's "Connection closed by peer", and the like.
_ECHO_TEXT = re.compile(
    r"another rank|other ranks? (?:failed|could not|did not|died|exited)"
    r"|error is raised there|(?:closed|reset) by peer|peer (?:rank|process)\b"
    r"|(?:group|communicator|world) (?:was|has been) aborted",
    re.IGNORECASE,
)


@dataclass(frozen=True)
class RankFailure:
    """One rank's failure as `launch` collected it (picklable: ranks send it over a pipe)."""

    rank: int
    standing: int  # OWN, DEATH or ECHO
    exc_text: str  # "Type: message"
    remote_traceback: str
    exc_bytes: bytes | None = None  # process ranks: the exception pickled, when it pickles
    exc: BaseException | None = field(default=None, compare=False)  # thread ranks: itself

    def exception(self) -> BaseException:
        """The exception to raise in the caller (a `CommError` carrying the text if lost)."""
        if self.exc is not None:
            return self.exc
        if self.exc_bytes is not None:
            return pickle.loads(self.exc_bytes)  # type: ignore[no-any-return]
        return CommError(self.exc_text)


def standing(exc: BaseException) -> int:
    """``ECHO`` for an error caused by another rank's failure, else ``OWN``."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:  # chains can loop
        seen.add(id(current))
        if isinstance(current, CommError) or _ECHO_TEXT.search(str(current)):
            return ECHO
        current = current.__cause__ or current.__context__
    return OWN


def as_rank_error(rank: int, exc: BaseException) -> BaseException:
    """``exc``, except that a `SystemExit` becomes a `RuntimeError` naming the rank.

    Re-raised in the caller, a rank's ``sys.exit(0)`` would end the caller with status 0 as if
    every rank had succeeded; a rank must return a value or raise.
    """
    if not isinstance(exc, SystemExit):
        return exc
    error = RuntimeError(
        f"[rank {rank}] called sys.exit({exc.code!r}); a rank must return a value or raise, so "
        "launch reports an exit as a failure"
    )
    error.__cause__ = exc
    return error


def pick_root(failures: Sequence[RankFailure]) -> tuple[RankFailure, list[RankFailure]]:
    """The failure to raise (best standing, then lowest rank) and the others in that order."""
    if not failures:
        raise ValueError("pick_root needs at least one failure")
    ordered = sorted(failures, key=lambda f: (f.standing, f.rank))
    return ordered[0], ordered[1:]


def is_settled(failures: Sequence[RankFailure], pending: Sequence[int]) -> bool:
    """True when no rank still running could report a failure that `pick_root` would prefer."""
    if not failures:
        return False
    root, _ = pick_root(failures)
    return root.standing == OWN and all(rank > root.rank for rank in pending)


def notes_for(others: Sequence[RankFailure]) -> list[str]:
    """One note per other failed rank: own errors with their traceback, echoes in one line."""
    notes = []
    for failure in others:
        if failure.standing == ECHO:
            notes.append(f"rank {failure.rank} also failed, as a consequence: {failure.exc_text}")
        else:
            detail = (
                f"; its traceback:\n{failure.remote_traceback}" if failure.remote_traceback else ""
            )
            notes.append(f"rank {failure.rank} also failed: {failure.exc_text}{detail}")
    return notes
