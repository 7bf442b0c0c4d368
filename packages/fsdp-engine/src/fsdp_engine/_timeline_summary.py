"""`TimelineSummary`: a `StepTimeline` turned into step time, compute, exposed and hidden
communication and the engine's Python, per unit and in total (Note [step timeline])."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields
from typing import Any

from ._timeline import Span, StepTimeline, display_fqn

__all__ = ["TimelineSummary", "UnitTimes", "OUTSIDE_UNITS", "summarize_step", "combine"]

#: The row of compute no unit's forward or backward range covers (loss, optimizer step).
OUTSIDE_UNITS = "<outside units>"

Intervals = list[tuple[int, int]]


@dataclass(frozen=True)
class UnitTimes:
    """One unit's share of a step, milliseconds per step (Note [step timeline])."""

    unit: str
    compute_ms: float = 0.0  # inside its forward/backward range, not in a nested unit's
    exposed_ms: float = 0.0  # blocked waiting for its collectives
    hidden_ms: float = 0.0  # its collectives running while the thread was not blocked
    comm_ms: float = 0.0  # its collectives' busy time (union of their intervals)
    engine_ms: float = 0.0  # in its hooks, not waiting
    copies_ms: float = 0.0  # host copies in its hooks (part of engine_ms)


@dataclass(frozen=True)
class TimelineSummary:
    """Per-step means over ``steps`` profiled steps, in milliseconds.

    ``compute_ms + exposed_ms + engine_ms == step_ms`` on CPU; ``hidden_ms = comm_ms -``
    the part of ``comm_ms`` the training thread spent waiting. ``clock`` is ``"cpu"`` or
    ``"cuda"`` (step, exposed and comm from the GPU's clock; engine_ms overlaps them)."""

    steps: int
    step_ms: float
    compute_ms: float
    exposed_ms: float
    hidden_ms: float
    comm_ms: float
    engine_ms: float
    copies_ms: float
    units: tuple[UnitTimes, ...] = ()
    clock: str = "cpu"

    def metrics(self) -> dict[str, float]:
        """The totals as flat ``timeline_*`` keys (``--metrics`` records)."""
        return {f"timeline_{f}": getattr(self, f) for f in _TOTALS}

    def format(self) -> str:
        """A table: the totals, then one row per unit."""
        head = (
            f"{'unit':<28}{'compute':>10}{'exposed':>10}{'hidden':>10}{'comm':>10}"
            f"{'engine':>10}{'copies':>10}"
        )
        lines = [
            f"step timeline ({self.clock} clock), ms per step, mean of {self.steps} "
            f"step(s): step {self.step_ms:.2f} = compute {self.compute_ms:.2f} + exposed "
            f"comm {self.exposed_ms:.2f} + engine Python {self.engine_ms:.2f}; comm "
            f"{self.comm_ms:.2f}, of it hidden {self.hidden_ms:.2f}",
            head,
        ]
        rows = [
            *self.units,
            UnitTimes(
                "total",
                self.compute_ms,
                self.exposed_ms,
                self.hidden_ms,
                self.comm_ms,
                self.engine_ms,
                self.copies_ms,
            ),
        ]
        for u in rows:
            lines.append(
                f"{u.unit[:27]:<28}{u.compute_ms:10.2f}{u.exposed_ms:10.2f}"
                f"{u.hidden_ms:10.2f}{u.comm_ms:10.2f}{u.engine_ms:10.2f}"
                f"{u.copies_ms:10.2f}"
            )
        return "\n".join(lines)


_TOTALS = ("step_ms", "compute_ms", "exposed_ms", "hidden_ms", "comm_ms", "engine_ms", "copies_ms")


# ---- interval arithmetic ---------------------------------------------------------------------
def _union(spans: Iterable[tuple[int, int]], lo: int, hi: int) -> Intervals:
    """Sorted disjoint intervals covering ``spans`` clipped to ``[lo, hi)``."""
    out: Intervals = []
    for a, b in sorted((max(a, lo), min(b, hi)) for a, b in spans):
        if b <= a:
            continue
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _measure(u: Intervals) -> int:
    return sum(b - a for a, b in u)


def _overlap(u: Intervals, v: Intervals) -> int:
    """Measure of the intersection of two disjoint sorted interval lists."""
    i = j = total = 0
    while i < len(u) and j < len(v):
        a, b = max(u[i][0], v[j][0]), min(u[i][1], v[j][1])
        total += max(0, b - a)
        if u[i][1] < v[j][1]:
            i += 1
        else:
            j += 1
    return total


# ---- the sweep: each instant of the step is exposed, engine or compute -----------------------
def _sweep(tl: StepTimeline, lo: int, hi: int) -> list[tuple[str, str, int, int]]:
    """(category, fqn, start, end) segments partitioning ``[lo, hi)``: inside a host copy
    "engine" (a staged collective's copy-out runs inside its wait: Note [staged collectives]
    in fsdp_comm), else inside a wait "exposed", else inside a hook "engine", else
    "compute" of the innermost open range."""
    events: list[tuple[int, int, int, Span]] = []  # time, 0 open / 1 close, priority, span
    for prio, spans in ((3, tl.copies), (2, tl.waits), (1, tl.hooks), (0, tl.ranges)):
        for s in spans:
            a, b = max(s.start, lo), min(s.end, hi)
            if b > a:
                events += [(a, 0, prio, s), (b, 1, prio, s)]
    events.sort(key=lambda e: (e[0], -e[1]))
    active: list[dict[int, Span]] = [{}, {}, {}, {}]
    segments: list[tuple[str, str, int, int]] = []
    t = lo
    for when, close, prio, span in events:
        if when > t:
            _emit(segments, _label(active), t, when)
            t = when
        if close:
            active[prio].pop(id(span), None)
        else:
            active[prio][id(span)] = span
    if hi > t:
        _emit(segments, _label(active), t, hi)
    return segments


def _label(active: list[dict[int, Span]]) -> tuple[str, str]:
    for prio, category in ((3, "engine"), (2, "exposed"), (1, "engine")):
        if active[prio]:
            return category, display_fqn(next(reversed(active[prio].values())).fqn)
    if active[0]:
        return "compute", display_fqn(max(active[0].values(), key=lambda s: s.start).fqn)
    return "compute", OUTSIDE_UNITS


def _emit(
    segments: list[tuple[str, str, int, int]], label: tuple[str, str], a: int, b: int
) -> None:
    if segments and segments[-1][:2] == label and segments[-1][3] == a:
        segments[-1] = (*label, segments[-1][2], b)
    else:
        segments.append((*label, a, b))


# ---- one step, and the mean of several -------------------------------------------------------
def summarize_step(tl: StepTimeline, lo: int, hi: int) -> tuple[TimelineSummary, list[Any]]:
    """The summary of ``[lo, hi)`` (perf_counter ns) and the compute lane's segments."""
    for span in tl.comms:
        span.resolve(hi)
    segments = _sweep(tl, lo, hi)
    waits = _union(((s.start, s.end) for s in tl.waits), lo, hi)
    rows: dict[str, dict[str, float]] = {}
    for category, fqn, a, b in segments:
        row = rows.setdefault(fqn, {})  # display names already
        row[f"{category}_ms"] = row.get(f"{category}_ms", 0.0) + (b - a) / 1e6
    for fqn in {s.fqn for s in tl.comms} | {s.fqn for s in tl.copies}:
        busy = _union(((s.start, s.end) for s in tl.comms if s.fqn == fqn), lo, hi)
        row = rows.setdefault(display_fqn(fqn), {})
        row["comm_ms"] = _measure(busy) / 1e6
        row["hidden_ms"] = (_measure(busy) - _overlap(busy, waits)) / 1e6
        row["copies_ms"] = (
            _measure(_union(((s.start, s.end) for s in tl.copies if s.fqn == fqn), lo, hi)) / 1e6
        )
    units = tuple(
        UnitTimes(name, **{k: v for k, v in r.items()})
        for name, r in rows.items()
        if any(r.values())
    )
    busy = _union(((s.start, s.end) for s in tl.comms), lo, hi)
    copies = _union(((s.start, s.end) for s in tl.copies), lo, hi)
    total = {
        c: sum((b - a) for cat, _, a, b in segments if cat == c) / 1e6
        for c in ("compute", "exposed", "engine")
    }
    summary = TimelineSummary(
        steps=1,
        step_ms=(hi - lo) / 1e6,
        compute_ms=total["compute"],
        exposed_ms=total["exposed"],
        hidden_ms=(_measure(busy) - _overlap(busy, waits)) / 1e6,
        comm_ms=_measure(busy) / 1e6,
        engine_ms=total["engine"],
        copies_ms=_measure(copies) / 1e6,
        units=_ordered(units),
    )
    return summary, segments


def _ordered(units: Sequence[UnitTimes]) -> tuple[UnitTimes, ...]:
    """Units by name (blocks in model order for numbered names), the outside row last."""

    def key(u: UnitTimes) -> tuple[bool, list[Any]]:
        parts = [int(p) if p.isdigit() else p for p in u.unit.replace(".", " ").split()]
        return u.unit == OUTSIDE_UNITS, [(isinstance(p, str), p) for p in parts]

    return tuple(sorted(units, key=key))


def combine(steps: Sequence[TimelineSummary]) -> TimelineSummary:
    """The per-step mean of several step summaries (units matched by name)."""
    if not steps:
        raise ValueError(
            "no profiled step to summarize: call step() after each training "
            "step inside profile_steps(), after the model's first forward"
        )
    n = len(steps)
    means = {f: sum(getattr(s, f) for s in steps) / n for f in _TOTALS}
    per: dict[str, dict[str, float]] = {}
    for s in steps:
        for u in s.units:
            row = per.setdefault(u.unit, {})
            for f in fields(UnitTimes)[1:]:
                row[f.name] = row.get(f.name, 0.0) + getattr(u, f.name) / n
    units = _ordered([UnitTimes(name, **row) for name, row in per.items()])
    return TimelineSummary(
        steps=sum(s.steps for s in steps), units=units, clock=steps[0].clock, **means
    )
