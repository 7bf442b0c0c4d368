"""What ``fsdp train`` shows while it runs: a tqdm bar on a terminal, plain lines elsewhere.

Under Slurm, ``tee`` or a pipe, a bar's redraws fill the log; there one line is printed every
``--log-every`` steps (and after the last step), with the loss, step time and throughput
averaged over those steps::

    step 20/60 loss 3.412 lr 3.0e-03 grad_norm 0.82 1.23 s/step 6650 tok/s
"""

from __future__ import annotations

import sys
import threading
from typing import Any

from ._metrics import StepRecord

__all__ = ["Progress", "plain_line"]


def _is_terminal() -> bool:
    isatty = getattr(sys.stdout, "isatty", None)
    return bool(isatty and isatty())


def plain_line(done: int, total: int, window: list[StepRecord]) -> str:
    """The plain progress line after ``done`` of ``total`` steps; ``window``: the steps since
    the previous line (averaged), the last one's lr, gradient norm and memory shown."""
    last, n = window[-1], len(window)
    seconds = sum(r.step_time_s for r in window)
    # Rates over the window's time (not means of per-step rates): tokens over seconds.
    tokens_per_s = sum(r.tokens_per_s * r.step_time_s for r in window) / max(seconds, 1e-9)
    parts = [
        f"step {done}/{total}",
        f"loss {sum(r.loss for r in window) / n:.4f}",
        f"lr {last.lr:.1e}",
    ]
    if last.grad_norm is not None:
        parts.append(f"grad_norm {last.grad_norm:.3g}")
    parts += [f"{seconds / n:.3g} s/step", f"{tokens_per_s:.0f} tok/s"]
    if last.mfu is not None and last.tokens_per_s > 0:
        parts.append(f"mfu {100 * last.mfu * tokens_per_s / last.tokens_per_s:.3g}%")
    if last.cuda_max_memory_allocated_bytes:
        parts.append(f"cuda_max {max(last.cuda_max_memory_allocated_bytes) / 2**30:.2f} GiB")
    else:
        parts.append(f"rss_max {max(last.peak_rss_mib, default=0):.0f} MiB")
    return " ".join(parts)


class Progress:
    """Rank 0's display: nothing (``enabled=False``), a tqdm bar (stdout is a terminal) or a
    plain line every ``every`` steps."""

    def __init__(self, total: int, start: int, every: int, enabled: bool) -> None:
        self.total, self.every = total, every
        self.bar: Any = None
        self.plain = enabled and not _is_terminal()
        self.window: list[StepRecord] = []
        if enabled and not self.plain:
            from tqdm import tqdm

            # tqdm's default lock is a multiprocessing semaphore, which a rank process ending
            # with os._exit would leak (the resource tracker then warns): a thread lock suffices.
            tqdm.set_lock(threading.RLock())
            self.bar = tqdm(total=total, initial=start, desc="fsdp train", unit="step")

    def update(self, record: StepRecord) -> None:
        if self.bar is not None:
            self.bar.set_postfix(
                loss=f"{record.loss:.4f}",
                tok_s=f"{record.tokens_per_s:,.0f}",
                rss_mib="/".join(f"{m:.0f}" for m in record.peak_rss_mib),
            )
            self.bar.update(1)
        elif self.plain:
            self.window.append(record)
            done = record.step + 1
            if done % self.every == 0 or done == self.total:
                print(plain_line(done, self.total, self.window), flush=True)
                self.window = []

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
