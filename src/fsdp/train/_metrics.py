"""Per-step metrics of ``fsdp train`` and where they go: JSON lines, CSV, TensorBoard.

``--metrics PATH`` appends one record per step: CSV when PATH ends in ``.csv``, JSON lines
otherwise. ``--tensorboard DIR`` writes TensorBoard scalars (needs ``pip install 'fsdp[tb]'``).
Only rank 0 writes; every rank contributes its memory.
"""

from __future__ import annotations

import csv
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

__all__ = [
    "StepRecord",
    "CSV_COLUMNS",
    "TIMELINE_COLUMNS",
    "csv_columns",
    "open_sinks",
    "metrics_problem",
    "tensorboard_problem",
]

#: The columns of a ``--metrics *.csv`` file and the scalars written to TensorBoard (with
#: ``step``); memory is the largest rank's, where JSON lines have one value per rank.
CSV_COLUMNS = (
    "step",
    "loss",
    "lr",
    "grad_norm",
    "step_time_s",
    "tokens_per_s",
    "mfu",
    "peak_rss_mib_max",
    "cuda_max_memory_allocated_bytes_max",
)
#: With ``--profile``, appended to the CSV columns: rank 0's step timeline of each profiled
#: step (``fsdp_engine.TimelineSummary.metrics``), empty on the other steps.
TIMELINE_COLUMNS = (
    "timeline_step_ms",
    "timeline_compute_ms",
    "timeline_exposed_ms",
    "timeline_hidden_ms",
    "timeline_comm_ms",
    "timeline_engine_ms",
    "timeline_copies_ms",
)


def csv_columns(profile: bool) -> tuple[str, ...]:
    """The columns of a ``--metrics *.csv`` file, with or without ``--profile``."""
    return CSV_COLUMNS + TIMELINE_COLUMNS if profile else CSV_COLUMNS


@dataclass(frozen=True)
class StepRecord:
    """One training step as rank 0 reports it (``step`` counts from 0)."""

    step: int
    loss: float  # mean over ranks and micro-batches
    lr: float  # the optimizer's first parameter group's
    grad_norm: float | None  # global L2 norm before clipping
    step_time_s: float
    tokens_per_s: float  # all ranks together
    mfu: float | None  # 0..1; None without a known peak
    peak_rss_mib: list[float]  # per rank: peak resident host memory
    cuda_max_memory_allocated_bytes: list[int] | None  # per rank, CUDA devices only
    # A profiled step (--profile): rank 0's `TimelineSummary` of this step, else None.
    timeline: Any = None

    def json_row(self) -> dict[str, Any]:
        """The JSON line: per-rank memory as lists."""
        row: dict[str, Any] = {
            "step": self.step,
            "loss": self.loss,
            "tokens_per_s": self.tokens_per_s,
            "peak_rss_mib": self.peak_rss_mib,
            "lr": self.lr,
            "grad_norm": self.grad_norm,
            "step_time_s": self.step_time_s,
            "mfu": self.mfu,
        }
        if self.cuda_max_memory_allocated_bytes is not None:
            row["cuda_max_memory_allocated_bytes"] = self.cuda_max_memory_allocated_bytes
        if self.timeline is not None:  # the totals, and one entry per unit
            row["timeline"] = {
                **{k.removeprefix("timeline_"): v for k, v in self.timeline.metrics().items()},
                "units": {u.unit: _unit_row(u) for u in self.timeline.units},
            }
        return row

    def scalars(self) -> dict[str, float | None]:
        """Every `CSV_COLUMNS` value but ``step`` (None: not known here)."""
        cuda = self.cuda_max_memory_allocated_bytes
        timeline = {} if self.timeline is None else self.timeline.metrics()
        return {
            **timeline,
            "loss": self.loss,
            "lr": self.lr,
            "grad_norm": self.grad_norm,
            "step_time_s": self.step_time_s,
            "tokens_per_s": self.tokens_per_s,
            "mfu": self.mfu,
            "peak_rss_mib_max": max(self.peak_rss_mib, default=None),
            "cuda_max_memory_allocated_bytes_max": max(cuda) if cuda else None,
        }


def _unit_row(unit: Any) -> dict[str, float]:
    return {k: v for k, v in vars(unit).items() if k != "unit"}


class Sink(Protocol):
    def write(self, record: StepRecord) -> None: ...

    def close(self) -> None: ...


class JsonlSink:
    """One JSON object per line, appended (a resumed run continues the file)."""

    def __init__(self, path: str) -> None:
        self.file = open(path, "a")

    def write(self, record: StepRecord) -> None:
        self.file.write(json.dumps(record.json_row()) + "\n")
        self.file.flush()  # readable while training runs (tail -f, a crash)

    def close(self) -> None:
        self.file.close()


def _is_csv(path: str) -> bool:
    return path.lower().endswith(".csv")


def _csv_header(path: str) -> list[str] | None:
    """The first row of an existing, non-empty CSV file, else None."""
    target = Path(path)
    if not target.is_file() or target.stat().st_size == 0:
        return None
    with target.open(newline="") as f:
        return next(csv.reader(f), None)


class CsvSink:
    """`csv_columns`, the header written once; an empty cell is a value not known."""

    def __init__(self, path: str, columns: tuple[str, ...] = CSV_COLUMNS) -> None:
        fresh = _csv_header(path) is None
        self.file = open(path, "a", newline="")
        self.writer = csv.DictWriter(self.file, fieldnames=columns, extrasaction="ignore")
        if fresh:
            self.writer.writeheader()

    def write(self, record: StepRecord) -> None:
        values = {k: ("" if v is None else v) for k, v in record.scalars().items()}
        self.writer.writerow({"step": record.step, **values})
        self.file.flush()

    def close(self) -> None:
        self.file.close()


class TensorBoardSink:
    """TensorBoard scalars (tags as `CSV_COLUMNS`) at the step's number."""

    def __init__(self, log_dir: str) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=log_dir)

    def write(self, record: StepRecord) -> None:
        for tag, value in record.scalars().items():
            if value is not None:
                self.writer.add_scalar(tag, value, record.step)

    def close(self) -> None:
        self.writer.close()


def open_sinks(
    metrics: str | None, tensorboard: str | None, *, profile: bool = False
) -> list[Sink]:
    """The sinks ``--metrics`` and ``--tensorboard`` ask for (rank 0 only)."""
    sinks: list[Sink] = []
    if metrics:
        sinks.append(
            CsvSink(metrics, csv_columns(profile)) if _is_csv(metrics) else JsonlSink(metrics)
        )
    if tensorboard:
        sinks.append(TensorBoardSink(tensorboard))
    return sinks


def tensorboard_problem() -> str | None:
    """Why ``--tensorboard`` cannot work here (the package is missing), or None."""
    if importlib.util.find_spec("tensorboard") is None:
        return "--tensorboard needs the tensorboard package: pip install 'fsdp[tb]'"
    return None


def metrics_problem(
    metrics: str | None, tensorboard: str | None, *, profile: bool = False
) -> str | None:
    """Why these outputs would fail once training runs, or None: a CSV file with other
    columns (``profile``: those of ``--profile``), TensorBoard missing, a TensorBoard
    directory that is a file."""
    if metrics and _is_csv(metrics):
        header, columns = _csv_header(metrics), csv_columns(profile)
        if header is not None and header != list(columns):
            return (
                f"--metrics: {metrics} has the columns {','.join(header)}, not those of "
                f"this run ({','.join(columns)}); append to a CSV file of the same "
                "columns or name a new file"
            )
    if tensorboard:
        if Path(tensorboard).exists() and not Path(tensorboard).is_dir():
            return f"--tensorboard must be a directory, but {tensorboard} is an existing file"
        return tensorboard_problem()
    return None
