"""`StepTimeline`: what the engine's hooks record while `profile_steps` runs.

Note [step timeline]
    The recorder is reached through each unit's context (``UnitContext.timeline``), never a
    global: with none attached a hook pays one attribute check. While attached, the hooks
    and the gather and reduce parts report, on the training thread, with
    ``time.perf_counter_ns`` stamps, and open `torch.profiler.record_function` ranges of the
    same names (``fsdp::gather <fqn>``, ``fsdp::wait_gather <fqn>``, ``fsdp::forward <fqn>``,
    ``fsdp::backward <fqn>``, ``fsdp::reduce <fqn>``, ``fsdp::wait_reduce <fqn>``,
    ``fsdp::copy <fqn>``), so torch's own trace shows them:

    * hooks: the time inside each pre/post-forward, pre-backward, gradient and end-of-backward
      hook (the engine's Python, its host copies included);
    * waits: the training thread blocked on a collective (``Work.wait``), and synchronous
      collectives (the shared-memory all-gather of fsdp_comm, the replica all-reduce), whose
      whole call blocks it;
    * collectives: issue to completion. On CPU gloo runs them on its own threads, invisible
      to torch's profiler: completion is when the work's ``add_done_callback`` fires, or the
      wait's return where the work cannot tell, or where the wait blocked on it (then the
      training thread learnt of it only there);
    * ranges: each unit's forward (end of pre-forward hook to start of post-forward hook)
      and backward (end of pre-backward hook to its first gradient hook).

    The accounting (`_timeline_summary`) splits each step's wall time on the training
    thread, instant by instant, into exactly one of: **exposed** communication (inside a
    wait, not in a host copy: a staged all-gather's copy to parameter order runs inside
    its wait, Note [staged collectives] in fsdp_comm, and is the engine's layout work), the
    **engine**'s Python (inside a hook or a host copy, not waiting), **compute** (the rest,
    attributed to the innermost unit range, else to "outside units": loss, optimizer). So
    compute + exposed + engine = step. **comm** is the union of collective intervals;
    **hidden** = comm minus the waits (communication that ran while the thread did other
    work), so hidden >= 0 and exposed <= comm.

    On CUDA waits do not block the host (they order the current stream after the
    collective's stream): `CudaMarks` records events on the current stream at each step
    boundary and around each wait, so step and exposed (the stream stalled in a wait) come
    from the GPU's clock and compute = step - exposed. The collectives' own kernels run on
    the communication streams, which torch's trace shows as lanes already; comm here is
    the host's view (issue to completion callback or wait) and engine the host's time in
    hooks, which overlaps the GPU's work and is reported beside it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.profiler import record_function

__all__ = [
    "StepTimeline",
    "Span",
    "CudaMarks",
    "LANE_GATHER",
    "LANE_REDUCE",
    "LANE_COPY",
    "LANE_COMPUTE",
    "display_fqn",
]

LANE_COMPUTE = "compute"
LANE_GATHER = "all-gather"
LANE_REDUCE = "reduce-scatter"
LANE_COPY = "host copies"

_now = time.perf_counter_ns


def display_fqn(fqn: str) -> str:
    """The unit's name in ranges and tables (the root's fqn is empty)."""
    return fqn or "<root>"


@dataclass(eq=False)
class Span:
    """One interval on the training thread or a communication lane (perf_counter ns)."""

    lane: str
    fqn: str
    name: str
    start: int
    end: int = -1  # -1: not known yet (a collective in flight)
    done: int | None = None  # a collective's completion, from its done-callback
    wait_start: int | None = None  # when the training thread began waiting for it
    waited: int | None = None  # when that wait returned

    def resolve(self, fallback: int) -> None:
        """Set a collective's end (Note [step timeline]): its completion if that came before
        anyone waited, else the wait's return."""
        if self.end >= 0:
            return
        if self.done is not None and (self.wait_start is None or self.done <= self.wait_start):
            self.end = self.done
        else:
            self.end = self.waited if self.waited is not None else (self.done or fallback)
        self.end = max(self.end, self.start)


class CudaMarks:
    """CUDA events on the current stream, for the GPU clock (Note [step timeline])."""

    def __init__(self) -> None:
        self.steps: list[Any] = [self.mark()]
        self.waits: list[tuple[str, Any, Any]] = []  # fqn, before, after
        self.issues: list[tuple[str, Any]] = []  # fqn, issued

    @staticmethod
    def mark() -> Any:
        event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]  # unannotated
        event.record()
        return event


class StepTimeline:
    """Recorder of one profiled run; the engine calls it only while attached."""

    def __init__(self, *, cuda: bool = False) -> None:
        self.step_marks: list[int] = [_now()]
        self.hooks: list[Span] = []
        self.waits: list[Span] = []
        self.comms: list[Span] = []
        self.copies: list[Span] = []
        self.ranges: list[Span] = []
        self._open: dict[tuple[str, str], tuple[Span, Any]] = {}
        self._in_flight: dict[int, tuple[Any, Span]] = {}
        self.cuda = CudaMarks() if cuda else None

    # ---- steps ---------------------------------------------------------------------------
    def mark_step(self) -> int:
        """End the current step (and begin the next); returns the stamp."""
        t = _now()
        self.step_marks.append(t)
        if self.cuda is not None:
            self.cuda.steps.append(self.cuda.mark())
        return t

    def recorded_since(self, t: int) -> bool:
        return any(s.start >= t for s in self.hooks) or any(s.start >= t for s in self.waits)

    # ---- hooks and unit ranges ------------------------------------------------------------
    def hook_begin(self, fqn: str, closes: str | None = None) -> int:
        """A hook starts; ``closes`` ends the unit's open range of that kind."""
        t = _now()
        if closes is not None:
            self._close(fqn, closes, t)
        return t

    def hook_end(self, fqn: str, t0: int, opens: str | None = None) -> None:
        """A hook begun at ``t0`` returns; ``opens`` starts a range of that kind."""
        t = _now()
        self.hooks.append(Span(LANE_COMPUTE, fqn, "hook", t0, t))
        if opens is not None and (fqn, opens) not in self._open:
            rf = record_function(f"fsdp::{opens} {display_fqn(fqn)}")
            rf.__enter__()  # type: ignore[no-untyped-call]  # unannotated in torch
            self._open[(fqn, opens)] = (Span(LANE_COMPUTE, fqn, opens, _now()), rf)

    def _close(self, fqn: str, kind: str, t: int) -> None:
        opened = self._open.pop((fqn, kind), None)
        if opened is not None:
            span, rf = opened
            rf.__exit__(None, None, None)
            span.end = t
            self.ranges.append(span)

    def close_all(self) -> None:
        """Profiling ends: close the ranges still open (a step cut short)."""
        t = _now()
        for fqn, kind in list(self._open):
            self._close(fqn, kind, t)
        for _, span in self._in_flight.values():
            span.resolve(t)
        self._in_flight.clear()

    # ---- communication and copies ---------------------------------------------------------
    def collective(
        self, lane: str, fqn: str, name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any
    ) -> Any:
        """Issue ``fn(*args, **kwargs)``, a collective; returns its work."""
        t0 = _now()
        with record_function(f"fsdp::{name} {display_fqn(fqn)}"):
            work = fn(*args, **kwargs)
        span = Span(lane, fqn, name, t0)
        self.comms.append(span)
        if self.cuda is not None:
            self.cuda.issues.append((fqn, self.cuda.mark()))
        if work is not None:
            watch = getattr(work, "add_done_callback", None)
            tells = watch is not None and watch(lambda: _set_done(span))
            if not tells or span.done is None:  # in flight (or only its wait will tell)
                self._in_flight[id(work)] = (work, span)
                return work
        t1 = _now()  # finished within the call (or synchronous): the thread was blocked
        span.end = t1
        self.waits.append(Span(lane, fqn, "sync_" + name, t0, t1))
        return work

    def wait(self, lane: str, fqn: str, name: str, work: Any) -> None:
        """``work.wait()``, timed as the training thread blocked on communication."""
        t0 = _now()
        before = CudaMarks.mark() if self.cuda is not None else None
        with record_function(f"fsdp::wait_{name} {display_fqn(fqn)}"):
            work.wait()
        t1 = _now()
        if self.cuda is not None:
            self.cuda.waits.append((fqn, before, CudaMarks.mark()))
        self.waits.append(Span(lane, fqn, "wait_" + name, t0, t1))
        found = self._in_flight.pop(id(work), None)
        if found is None:  # issued before profiling began: what the wait saw of it
            self.comms.append(Span(lane, fqn, name, t0, t1))
            return
        span = found[1]
        span.wait_start, span.waited = t0, t1
        span.resolve(t1)

    def host_copy(self, fqn: str, name: str, fn: Callable[..., Any], *args: Any) -> Any:
        """A copy the engine makes on the host thread (rank-major layout, casts, offload)."""
        t0 = _now()
        with record_function(f"fsdp::copy {display_fqn(fqn)}"):
            out = fn(*args)
        self.copies.append(Span(LANE_COPY, fqn, name, t0, _now()))
        return out


def _set_done(span: Span) -> None:
    if span.done is None:
        span.done = _now()
