"""`profile_steps`: record a few training steps of a sharded model as a step timeline
(Note [step timeline]) and, optionally, a Chrome/Perfetto trace per rank."""

from __future__ import annotations

import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ._fully_shard import FSDPModule
from ._timeline import StepTimeline, display_fqn
from ._timeline_summary import TimelineSummary, UnitTimes, combine, summarize_step
from ._timeline_trace import write_trace

__all__ = ["profile_steps", "StepProfile"]

_now = time.perf_counter_ns
_PROFILER_LOCK = threading.Lock()


class StepProfile:
    """A profiled stretch of training: use as a context manager, call `step` after each
    training step, read `summary` (and the trace at `trace_path`) afterwards."""

    def __init__(self, model: nn.Module, trace_dir: Path | None, rank: int | None) -> None:
        self._states = _states(model)
        self.trace_dir = trace_dir
        self.rank = _rank(self._states) if rank is None else rank
        self.trace_path: Path | None = (
            None if trace_dir is None else trace_dir / f"rank{self.rank}.trace.json"
        )
        self.timeline: StepTimeline | None = None
        self._steps: list[TimelineSummary] = []
        self._segments: list[Any] = []
        self._profiler: Any = None

    def __enter__(self) -> StepProfile:
        if self.timeline is not None:
            raise RuntimeError("profile_steps: this profile is active already")
        if self.trace_dir is not None:
            self.trace_dir.mkdir(parents=True, exist_ok=True)
            self._profiler = _start_profiler()
        self.timeline = StepTimeline(cuda=_on_cuda(self._states))
        self._attach(self.timeline)
        return self

    def step(self) -> TimelineSummary:
        """Mark the end of a training step; returns that step's summary."""
        tl = self._active()
        self._attach(tl)  # units built by lazy initialisation during the step
        lo, hi = tl.step_marks[-1], tl.mark_step()
        return self._close_step(tl, lo, hi)

    def begin_step(self) -> None:
        """Start the next step now: the time since the last `step` (or the ``with``) is left
        out (logging, evaluation, checkpoints between steps). Optional."""
        tl = self._active()
        tl.step_marks[-1] = _now()
        if tl.cuda is not None:
            tl.cuda.steps[-1] = tl.cuda.mark()

    def _close_step(self, tl: StepTimeline, lo: int, hi: int) -> TimelineSummary:
        summary, segments = summarize_step(tl, lo, hi)
        if tl.cuda is not None:
            summary = _on_gpu_clock(summary, tl, len(tl.cuda.steps) - 2)
        self._steps.append(summary)
        self._segments += segments
        return summary

    def summary(self) -> TimelineSummary:
        """Per-step means over the steps marked so far (ValueError when none)."""
        return combine(self._steps)

    def __exit__(self, *exc: object) -> None:
        tl = self._active()
        self._attach(None)
        lo = tl.step_marks[-1]
        if tl.recorded_since(lo):  # a step without its step() call
            self._close_step(tl, lo, tl.mark_step())
        tl.close_all()
        self.timeline = None
        if self.trace_dir is not None:
            if self._profiler is not None:
                self._profiler.__exit__(None, None, None)
            if exc[0] is None:
                self._write_trace(tl)
            self._profiler = None

    def _write_trace(self, tl: StepTimeline) -> None:
        assert self.trace_path is not None
        if self._profiler is None:  # another rank of this process runs torch's profiler
            write_trace(
                None, self.trace_path, tl.comms, tl.copies, tl.ranges, self._segments, tl.waits
            )
            return
        fd, raw = tempfile.mkstemp(suffix=".json", dir=self.trace_path.parent)
        os.close(fd)
        try:
            self._profiler.export_chrome_trace(raw)
            write_trace(
                Path(raw), self.trace_path, tl.comms, tl.copies, tl.ranges, self._segments, tl.waits
            )
        finally:
            Path(raw).unlink(missing_ok=True)

    def _active(self) -> StepTimeline:
        if self.timeline is None:
            raise RuntimeError("profile_steps: use the profile inside its `with` block")
        return self.timeline

    def _attach(self, tl: StepTimeline | None) -> None:
        for state in self._states:
            if state.unit is not None:
                state.unit.ctx.timeline = tl


def profile_steps(
    model: nn.Module, *, trace_dir: str | os.PathLike[str] | None = None, rank: int | None = None
) -> StepProfile:
    """Record the steps run inside ``with profile_steps(model) as prof:`` (call
    ``prof.step()`` after each): per unit and in total, step time, compute, communication
    hidden and exposed, and time in the engine's Python (Note [step timeline]).

    ``model`` is the root module given to `fully_shard`. With ``trace_dir``, a
    `torch.profiler` runs too and ``trace_dir/rank<R>.trace.json`` (Chrome/Perfetto) gets
    torch's events plus lanes for all-gather, reduce-scatter, host copies and compute.
    ``rank`` names the file (default: the model's rank in its world). Profile after a
    warm-up step: the first forward builds the units.
    """
    if not isinstance(model, FSDPModule):
        raise TypeError(
            f"profile_steps: model must be a module passed to fully_shard (an "
            f"FSDPModule), got {type(model).__name__}"
        )
    if trace_dir is not None and not isinstance(trace_dir, (str, os.PathLike)):
        raise TypeError(
            f"profile_steps: trace_dir must be a path or None, got {type(trace_dir).__name__}"
        )
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 0):
        raise ValueError(f"profile_steps: rank must be an integer >= 0 or None, got {rank!r}")
    return StepProfile(model, None if trace_dir is None else Path(trace_dir), rank)


def _states(model: nn.Module) -> list[Any]:
    return list(dict.fromkeys(m._fsdp_state for m in model.modules() if isinstance(m, FSDPModule)))


def _rank(states: list[Any]) -> int:
    world = getattr(states[0].config.backends, "world", None)
    return int(getattr(world, "rank", 0) or 0)


def _on_cuda(states: list[Any]) -> bool:
    world = getattr(states[0].config.backends, "world", None)
    device = getattr(world, "device", None)
    return isinstance(device, torch.device) and device.type == "cuda"


def _start_profiler() -> Any:
    """A running `torch.profiler.profile`, or None where one runs already in this process:
    torch's profiler is one per process, so with ranks as threads (the threads backend) the
    first rank's records every thread's events and the others' traces hold the timeline's
    lanes only; a profiler the user started gets the ranges and writes its own trace."""
    with _PROFILER_LOCK:
        if torch.autograd.profiler._is_profiler_enabled:
            return None
        profiler = torch.profiler.profile(activities=_activities())
        profiler.__enter__()  # type: ignore[no-untyped-call]  # unannotated in torch
        return profiler


def _activities() -> list[Any]:
    acts = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    return acts


def _on_gpu_clock(cpu: TimelineSummary, tl: StepTimeline, k: int) -> TimelineSummary:
    """Step ``k``'s summary with step, exposed and comm from CUDA events (Note [step
    timeline]): the GPU stalls at each wait, and each collective from issue to its wait."""
    marks = tl.cuda
    assert marks is not None
    torch.cuda.synchronize()
    start, end = marks.steps[k], marks.steps[k + 1]
    step = start.elapsed_time(end)
    inside = [
        (f, a, b)
        for f, a, b in marks.waits
        if start.elapsed_time(a) >= 0 and a.elapsed_time(end) >= 0
    ]
    exposed = sum(max(0.0, a.elapsed_time(b)) for _, a, b in inside)
    per: dict[str, float] = {}
    for fqn, a, b in inside:
        name = display_fqn(fqn)
        per[name] = per.get(name, 0.0) + max(0.0, a.elapsed_time(b))
    units = tuple(
        UnitTimes(
            u.unit,
            exposed_ms=per.get(u.unit, 0.0),
            engine_ms=u.engine_ms,
            comm_ms=u.comm_ms,
            hidden_ms=max(0.0, u.comm_ms - per.get(u.unit, 0.0)),
        )
        for u in cpu.units
    )
    return TimelineSummary(
        steps=1,
        step_ms=step,
        compute_ms=step - exposed,
        exposed_ms=exposed,
        hidden_ms=max(0.0, cpu.comm_ms - exposed),
        comm_ms=cpu.comm_ms,
        engine_ms=cpu.engine_ms,
        copies_ms=cpu.copies_ms,
        units=units,
        clock="cuda",
    )
