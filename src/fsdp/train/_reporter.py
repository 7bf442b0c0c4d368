"""Each step's report: every rank's memory gathered, rank 0's display and metrics files.

Collective: every rank calls `StepReporter.step` once per step (one small all-gather).
"""

from __future__ import annotations

import resource
from typing import TYPE_CHECKING, Any

import torch

from ._metrics import StepRecord, open_sinks
from ._mfu import device_peak, model_flops_utilization
from ._progress import Progress

if TYPE_CHECKING:
    from ._train import TrainConfig, TrainSummary

__all__ = ["StepReporter", "rss_mib", "performance_line"]


def rss_mib() -> float:
    """This process's peak resident host memory (MiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class StepReporter:
    """Builds each step's `StepRecord`; on rank 0 shows it and writes it to the sinks."""

    def __init__(
        self,
        backend: Any,
        cfg: TrainConfig,
        start: int,
        flops_per_token: float,
        compute_dtype: torch.dtype,
    ) -> None:
        self.backend, self.flops_per_token = backend, flops_per_token
        self.cuda = backend.device.type == "cuda"
        self.peak, self.peak_basis = device_peak(cfg.peak_tflops, backend.device, compute_dtype)
        self.step_times: list[float] = []
        self.last: StepRecord | None = None
        rank0 = backend.rank == 0
        self.progress = Progress(cfg.steps, start, cfg.log_every, rank0 and cfg.progress)
        self.sinks = (
            open_sinks(cfg.metrics, cfg.tensorboard, profile=cfg.profile is not None)
            if rank0
            else []
        )

    def mfu(self, tokens_per_s: float) -> float | None:
        if self.peak is None:
            return None
        return model_flops_utilization(
            self.flops_per_token, tokens_per_s, self.peak, self.backend.world_size
        )

    def _memory(self) -> tuple[list[float], list[int] | None]:
        """Every rank's peak RSS (MiB) and, on CUDA, ``torch.cuda.max_memory_allocated``."""
        cuda = torch.cuda.max_memory_allocated(self.backend.device) if self.cuda else 0
        mine = torch.tensor(
            [rss_mib(), float(cuda)], dtype=torch.float64, device=self.backend.device
        )
        every = torch.empty(
            2 * self.backend.world_size, dtype=torch.float64, device=self.backend.device
        )
        self.backend.all_gather_into_tensor(every, mine)
        values = every.tolist()
        rss = [round(v, 1) for v in values[0::2]]
        return rss, ([int(v) for v in values[1::2]] if self.cuda else None)

    def step(
        self,
        step: int,
        loss: float,
        lr: float,
        grad_norm: float | None,
        step_time_s: float,
        tokens: int,
        timeline: Any = None,
    ) -> StepRecord:
        """Report one step of ``tokens`` tokens (all ranks); returns its record.
        ``timeline``: this rank's `fsdp_engine.TimelineSummary` of a profiled step."""
        rss, cuda = self._memory()
        tokens_per_s = tokens / max(step_time_s, 1e-9)
        record = StepRecord(
            step,
            loss,
            lr,
            grad_norm,
            step_time_s,
            tokens_per_s,
            self.mfu(tokens_per_s),
            rss,
            cuda,
            timeline,
        )
        self.step_times.append(step_time_s)
        self.last = record
        self.progress.update(record)
        for sink in self.sinks:
            sink.write(record)
        return record

    def fill(self, summary: TrainSummary) -> None:
        """Put the run's means, MFU and memory into ``summary``."""
        if self.step_times:
            summary.mean_step_time_s = sum(self.step_times) / len(self.step_times)
        summary.mfu = self.mfu(summary.tokens_per_s) if summary.tokens_per_s > 0 else None
        summary.mfu_basis = self.peak_basis
        summary.flops_per_token = self.flops_per_token
        if self.last is not None:
            summary.peak_rss_mib = self.last.peak_rss_mib
            summary.cuda_max_memory_allocated_bytes = self.last.cuda_max_memory_allocated_bytes

    def close(self) -> None:
        self.progress.close()
        for sink in self.sinks:
            sink.close()


def performance_line(summary: TrainSummary) -> str:
    """The summary's line on speed, MFU (or why it is unknown) and device memory."""
    parts = [
        f"mean step {summary.mean_step_time_s:.3g} s",
        f"{summary.flops_per_token:.3g} FLOPs/token",
    ]
    if summary.mfu is not None:
        parts.append(f"MFU {100 * summary.mfu:.3g}% ({summary.mfu_basis})")
    else:
        parts.append(summary.mfu_basis or "MFU unknown")
    cuda = summary.cuda_max_memory_allocated_bytes
    if cuda:
        parts.append(
            f"max CUDA memory allocated per rank (GiB) {[round(b / 2**30, 2) for b in cuda]}"
        )
    return ", ".join(parts)
