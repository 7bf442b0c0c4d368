"""The collectives of a save or load: small agreements, never tensor data.

A save is a two-phase commit. Before it, rank 0 takes the path's lock and names the version
and staging directory (`from_rank0`). Phase one (`vote`): every rank has written and fsynced
its files and votes; one failure anywhere and nobody commits, and every rank learns which ranks
failed and why. Phase two (`from_rank0`): rank 0 commits and tells the others how far it got,
so every rank returns the same answer and no rank starts the next save before the commit is on
disk. A load has rank 0 resolve the pointer and send every rank the same index (`from_rank0`),
so all ranks load one version, and votes (`vote`) on its reads before changing anything.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from fsdp_comm import ReduceOp

from ._errors import CheckpointError

__all__ = ["Failures", "vote", "rank0_code", "from_rank0"]


def _flag(backend: Any, value: int) -> torch.Tensor:
    return torch.tensor([value], dtype=torch.int32, device=backend.device)


def _alone(backend: Any) -> bool:
    return backend is None or backend.world_size == 1


# A failing rank's reason as the others receive it, and how many ranks' reasons are sent: a
# disk that fills fails every rank alike, and one reason each from the first few says it all.
_REASON_BYTES = 2000
_REASONS_SENT = 4


@dataclass(frozen=True)
class Failures:
    """The ranks that failed a step every rank voted on, and why (the lowest few ranks')."""

    ranks: tuple[int, ...]
    reasons: tuple[tuple[int, str], ...]  # (rank, "Type: message") of the first failing ranks

    def who(self) -> str:
        """ "rank 1" or "ranks 1, 3 and 4"."""
        if len(self.ranks) == 1:
            return f"rank {self.ranks[0]}"
        head = ", ".join(str(r) for r in self.ranks[:-1])
        return f"ranks {head} and {self.ranks[-1]}"

    def its(self) -> str:
        """ "its" for one failing rank, "their" for several."""
        return "its" if len(self.ranks) == 1 else "their"

    def raised_there(self) -> str:
        """Where the failing ranks' own errors are (`fsdp_comm.launch` reads it as an echo)."""
        return (
            "(its error is raised there)"
            if len(self.ranks) == 1
            else ("(each one's error is raised there)")
        )

    def describe(self) -> str:
        """ "rank 1: OSError: ...; rank 3: ..." for every reason received."""
        text = "; ".join(f"rank {rank}: {reason}" for rank, reason in self.reasons)
        more = len(self.ranks) - len(self.reasons)
        return text + (f" (and {more} more ranks)" if more > 0 else "")


def vote(backend: Any, error: BaseException | None) -> Failures | None:
    """Every rank says whether its part succeeded (``error`` is None) or why not. None when
    every rank succeeded; otherwise, on every rank alike, which ranks failed and the reasons
    of the lowest few, so a rank that did not fail can name the rank, file and cause.

    One all-reduce of one integer when all is well; on a failure, one more all-reduce (which
    ranks) and two broadcasts per reason sent.
    """
    if _alone(backend):
        if error is None:
            return None
        return Failures((0,), ((0, _reason(error)),))
    world, rank = backend.world_size, backend.rank
    code = _flag(backend, 1 if error is not None else 0)
    backend.all_reduce(code, op=ReduceOp.MAX)
    if int(code.item()) == 0:
        return None
    flags = torch.zeros(world, dtype=torch.int32, device=backend.device)
    flags[rank] = int(error is not None)
    backend.all_reduce(flags, op=ReduceOp.MAX)
    failed = tuple(int(r) for r in flags.nonzero().flatten().tolist())
    reasons = []
    for src in failed[:_REASONS_SENT]:
        text = _reason(error).encode() if rank == src and error is not None else b""
        _, data = _broadcast_bytes(backend, 1, text, src=src)
        reasons.append((src, data.decode(errors="replace")))
    return Failures(failed, tuple(reasons))


def _reason(error: BaseException) -> str:
    text = _describe(error).encode()
    if len(text) <= _REASON_BYTES:
        return text.decode()
    return text[:_REASON_BYTES].decode(errors="ignore") + " [...]"


def rank0_code(backend: Any, code: int) -> int:
    """Rank 0's ``code`` (a small int), on every rank (a broadcast)."""
    if _alone(backend):
        return code
    flag = _flag(backend, code)
    backend.broadcast(flag, src=0)
    return int(flag.item())


def _broadcast_bytes(backend: Any, status: int, data: bytes, src: int = 0) -> tuple[int, bytes]:
    head = torch.tensor([status, len(data)], dtype=torch.int64, device=backend.device)
    backend.broadcast(head, src=src)
    status, size = (int(v) for v in head.tolist())
    if size == 0:
        return status, b""
    if backend.rank == src:
        body = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(backend.device)
    else:
        body = torch.empty(size, dtype=torch.uint8, device=backend.device)
    backend.broadcast(body, src=src)
    return status, body.cpu().numpy().tobytes()


def from_rank0(backend: Any, produce: Callable[[], bytes], what: str) -> bytes:
    """Rank 0 runs ``produce``; every rank gets its bytes (two broadcasts).

    When ``produce`` raises, rank 0 re-raises it and every other rank raises a
    `CheckpointError` quoting it, prefixed with ``what`` ("save to ckpt/run").
    """
    if _alone(backend):
        return produce()
    data, error = b"", None
    if backend.rank == 0:
        try:
            data = produce()
        except Exception as exc:  # sent to the other ranks, then re-raised here
            error = exc
            data = _describe(exc).encode()
    failed, data = _broadcast_bytes(backend, int(error is not None), data)
    if error is not None:
        raise error
    if failed:
        raise CheckpointError(
            f"{what}: rank 0 failed (its error is raised there): {data.decode(errors='replace')}"
        )
    return data


def _describe(exc: BaseException) -> str:
    notes = getattr(exc, "__notes__", [])
    return " ".join([f"{type(exc).__name__}: {exc}.", *notes])
