"""``fsdp train --profile DIR``: which steps are profiled, and `fsdp_engine.profile_steps`
around them (Note [step timeline] in fsdp_engine/_timeline.py)."""

from __future__ import annotations

from typing import Any

__all__ = ["PROFILE_WARMUP", "TrainProfiling", "profiled_window"]

#: Steps ``--profile`` lets run before its window (lazy initialisation, first allocations).
PROFILE_WARMUP = 2


def profiled_window(start: int, steps: int, count: int) -> range:
    """The steps ``--profile`` records: ``count`` of them after up to `PROFILE_WARMUP`
    warm-up steps (fewer warm-up steps, then fewer profiled ones, in a short run)."""
    first = start + max(0, min(PROFILE_WARMUP, steps - start - count))
    return range(first, min(first + count, steps))


class TrainProfiling:
    """``--profile``: `fsdp_engine.profile_steps` around the profiled window's steps."""

    def __init__(
        self, trace_dir: str | None, count: int, model: Any, start: int, steps: int
    ) -> None:
        self.model, self.dir = model, trace_dir
        self.window = profiled_window(start, steps, count) if trace_dir is not None else range(0)
        self.active: Any = None
        self.summary: Any = None

    def before(self, step: int) -> None:
        if self.window and step == self.window.start:
            from fsdp_engine import profile_steps

            self.active = profile_steps(self.model, trace_dir=self.dir).__enter__()
        elif self.active is not None:
            self.active.begin_step()  # not the last step's report

    def after(self, step: int) -> Any:
        """This step's timeline (None outside the window)."""
        if self.active is None:
            return None
        timeline = self.active.step()
        if step == self.window[-1]:
            self.close()
        return timeline

    def close(self) -> None:
        if self.active is not None:
            active, self.active = self.active, None
            active.__exit__(None, None, None)
            self.summary = active.summary()
