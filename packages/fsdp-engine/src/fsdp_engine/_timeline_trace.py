"""The step timeline as lanes of a Chrome/Perfetto trace: torch's own trace (``export_chrome_
trace``) plus one lane per stream the profiler cannot see on CPU (gloo's threads): all-gather,
reduce-scatter, host copies, and the compute lane of Note [step timeline]'s accounting."""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ._timeline import LANE_COMPUTE, LANE_COPY, LANE_GATHER, LANE_REDUCE, Span, display_fqn

__all__ = ["write_trace", "lane_events"]

_LANES = (LANE_COMPUTE, LANE_GATHER, LANE_REDUCE, LANE_COPY)
_TID_BASE = 0x7FFF0000  # far from real thread ids
_THREAD = "training thread"


def _offset_us(trace: dict[str, Any], ranges: list[Span]) -> float:
    """Trace time minus perf_counter time (us), from the unit ranges found in both."""
    seen: dict[str, list[float]] = {}
    for e in trace.get("traceEvents", []):
        if e.get("ph") == "X" and str(e.get("name", "")).startswith("fsdp::"):
            seen.setdefault(e["name"], []).append(float(e["ts"]))
    ours: dict[str, list[int]] = {}
    for s in ranges:
        ours.setdefault(f"fsdp::{s.name} {display_fqn(s.fqn)}", []).append(s.start)
    diffs = [
        t - mine / 1e3
        for name, starts in ours.items()
        for t, mine in zip(sorted(seen.get(name, [])), sorted(starts))
    ]
    return statistics.median(diffs) if diffs else 0.0


def _layered(spans: list[tuple[str, int, int]]) -> list[list[tuple[str, int, int]]]:
    """Overlapping spans of one lane on sub-lanes (a lane's slices must not overlap)."""
    layers: list[list[tuple[str, int, int]]] = []
    for span in sorted(spans, key=lambda s: s[1]):
        for layer in layers:
            if layer[-1][2] <= span[1]:
                layer.append(span)
                break
        else:
            layers.append([span])
    return layers


def lane_events(
    comms: list[Span],
    copies: list[Span],
    segments: list[Any],
    pid: Any,
    offset_us: float,
    thread: Sequence[Span] = (),
) -> list[dict[str, Any]]:
    """Chrome trace events (metadata and slices) of the timeline's lanes; ``thread``: spans
    of the training thread, as ``fsdp::`` ranges on a lane of their own."""
    by_lane: dict[str, list[tuple[str, int, int]]] = {lane: [] for lane in _LANES}
    by_lane[_THREAD] = [
        (f"fsdp::{s.name} {display_fqn(s.fqn)}", s.start, s.end) for s in thread if s.end > s.start
    ]
    for category, fqn, a, b in segments:
        by_lane[LANE_COMPUTE].append((f"{category} {fqn}", a, b))
    for s in [*comms, *copies]:
        if s.end > s.start:
            by_lane[s.lane].append((f"{s.name} {display_fqn(s.fqn)}", s.start, s.end))
    events: list[dict[str, Any]] = []
    tid = _TID_BASE
    for lane in by_lane:
        for i, layer in enumerate(_layered(by_lane[lane]) or [[]]):
            tid += 1
            title = f"fsdp {lane}" + (f" {i + 1}" if i else "")
            events += [
                {"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": title}},
                {
                    "ph": "M",
                    "name": "thread_sort_index",
                    "pid": pid,
                    "tid": tid,
                    "args": {"sort_index": tid},
                },
            ]
            events += [
                {
                    "ph": "X",
                    "cat": "fsdp_timeline",
                    "name": name,
                    "pid": pid,
                    "tid": tid,
                    "ts": a / 1e3 + offset_us,
                    "dur": (b - a) / 1e3,
                }
                for name, a, b in layer
            ]
    return events


def write_trace(
    torch_trace: Path | None,
    out: Path,
    comms: list[Span],
    copies: list[Span],
    ranges: list[Span],
    segments: list[Any],
    waits: list[Span],
) -> None:
    """Write ``out``: torch's trace with the timeline's lanes added; without one (another
    rank of the process ran torch's profiler) the lanes plus the unit ranges and waits."""
    trace: dict[str, Any] = {"traceEvents": [], "displayTimeUnit": "ms"}
    if torch_trace is not None and torch_trace.exists():
        trace = json.loads(torch_trace.read_text())
    pid = next(
        (e["pid"] for e in trace["traceEvents"] if str(e.get("name", "")).startswith("fsdp::")),
        "fsdp",
    )
    own = [] if trace["traceEvents"] else [*ranges, *waits]
    trace["traceEvents"] += lane_events(
        comms, copies, segments, pid, _offset_us(trace, ranges), own
    )
    out.write_text(json.dumps(trace))
