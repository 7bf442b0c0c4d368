"""The parts of ``python -m fsdp.bench.gpu`` that need no GPU: the order of its rounds, the
statistics and ratios it reports, the GPU's clocks, power and temperature, and the reduction
of a profiler trace to where the compute stream's time went.

Pure functions of plain data (run records as the benchmark writes them, nvidia-smi's text, a
list of GPU events), so that the tests drive them on a CPU.
"""

from __future__ import annotations

import os
import re
import shutil
import statistics
import subprocess
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple, TypeVar

__all__ = [
    "ConfigSummary",
    "GpuEvent",
    "GpuState",
    "Spread",
    "TraceSummary",
    "config_label",
    "events_from_chrome_trace",
    "format_gpu_state",
    "format_speed_table",
    "format_trace_lines",
    "kernel_category",
    "nvidia_smi_command",
    "paired_ratios",
    "parse_nvidia_smi",
    "read_gpu_state",
    "reduce_trace",
    "round_order",
    "spread",
    "summarize_runs",
    "union_length",
]

T = TypeVar("T")

# ---- rounds and statistics ---------------------------------------------------------------------


def round_order(configs: Sequence[T], repeats: int) -> list[tuple[int, T]]:
    """(round, configuration) in the order to run them: every configuration once per round,
    ``repeats`` rounds, every other round reversed (ABC CBA ABC ...). A drift of the GPU's
    clocks or temperature over the run then falls on every configuration alike instead of on
    whichever runs last, and each configuration has other neighbours from round to round."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    order: list[tuple[int, T]] = []
    for r in range(repeats):
        order.extend((r, c) for c in (configs if r % 2 == 0 else configs[::-1]))
    return order


@dataclass(frozen=True)
class Spread:
    """The median of some measurements and their range (lowest, highest), over ``n``."""

    median: float
    low: float
    high: float
    n: int

    @property
    def relative(self) -> float:
        """The range as a fraction of the median (0.03: the runs lay within 3%)."""
        return (self.high - self.low) / self.median if self.median else 0.0

    def format(self, scale: float = 1.0, digits: int = 1) -> str:
        """``median (low-high)``, each times ``scale``; the median alone for one run."""
        med = f"{self.median * scale:.{digits}f}"
        if self.n < 2:
            return med
        return f"{med} ({self.low * scale:.{digits}f}-{self.high * scale:.{digits}f})"


def spread(values: Iterable[float]) -> Spread | None:
    """Median and range of ``values``; None when there are none."""
    xs = sorted(values)
    if not xs:
        return None
    return Spread(statistics.median(xs), xs[0], xs[-1], len(xs))


def paired_ratios(num: Mapping[int, float], den: Mapping[int, float]) -> Spread | None:
    """``num[r] / den[r]`` for every round ``r`` both ran in, and their median and range: each
    ratio divides two runs of the same round, as close together in time as the order allows."""
    return spread(num[r] / den[r] for r in sorted(num) if r in den and den[r] > 0)


# ---- run records -------------------------------------------------------------------------------


def config_label(config: Mapping[str, Any]) -> str:
    """``engine`` with ``+AC`` and ``+offload`` as the configuration has them."""
    return (
        f"{config['engine']}{' +AC' if config.get('ac') else ''}"
        f"{' +offload' if config.get('offload') else ''}"
    )


def _variant(config: Mapping[str, Any]) -> tuple[bool, bool]:
    """What a configuration shares with its baselines: everything but the engine."""
    return bool(config.get("ac")), bool(config.get("offload"))


@dataclass
class ConfigSummary:
    """One configuration over its rounds. Step time as median and range; tokens/s and MFU
    from the median step; the largest peak; ratios to FSDP2 and to the plain model of the same
    variant (+AC, +offload), per round, as median and range."""

    label: str
    config: dict[str, Any]
    step_s: Spread | None
    tokens_per_s: float | None = None
    mfu: float | None = None
    peak_mib: float | None = None
    first_loss: float | None = None
    vs_fsdp2: Spread | None = None
    vs_plain: Spread | None = None
    errors: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)  # trace figures, h2d overlap

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


#: Figures a run may carry besides its timing, kept from the first round that has them.
_EXTRA_KEYS = ("trace", "h2d_ms", "h2d_hidden_share")


def summarize_runs(runs: Sequence[Mapping[str, Any]]) -> list[ConfigSummary]:
    """Per configuration, in order of first appearance, from the records of every run
    (``{"round": r, "config": {...}, "step_s": ..., ...}``, or ``"error"`` for a failed run)."""
    by_label: dict[str, list[Mapping[str, Any]]] = {}
    for run in runs:
        by_label.setdefault(config_label(run["config"]), []).append(run)
    steps = {
        label: {run["round"]: run["step_s"] for run in rs if "error" not in run}
        for label, rs in by_label.items()
    }
    baselines = {
        (run["config"]["engine"], _variant(run["config"])): config_label(run["config"])
        for run in runs
    }
    return [_summary(label, rs, steps, baselines) for label, rs in by_label.items()]


def _summary(
    label: str,
    runs: list[Mapping[str, Any]],
    steps: dict[str, dict[int, float]],
    baselines: dict[tuple[str, tuple[bool, bool]], str],
) -> ConfigSummary:
    config = {k: v for k, v in runs[0]["config"].items() if k != "trace"}
    ok = [r for r in runs if "error" not in r]
    out = ConfigSummary(
        label,
        config,
        spread(steps[label].values()),
        errors=[_last_line(r["error"]) for r in runs if "error" in r],
    )
    if ok:
        out.tokens_per_s = statistics.median(r["tokens_per_s"] for r in ok)
        mfus = [r["mfu"] for r in ok if r.get("mfu") is not None]
        out.mfu = statistics.median(mfus) if mfus else None
        out.peak_mib = max(r["peak_mib"] for r in ok)
        out.first_loss = ok[0]["first_loss"]
        for key in _EXTRA_KEYS:  # from the first round that has it (traces: the first)
            out.extra.update(next(({key: r[key]} for r in ok if key in r), {}))
    variant = _variant(config)
    for engine, attr in (("fsdp2", "vs_fsdp2"), ("plain", "vs_plain")):
        base = baselines.get((engine, variant))
        if base is not None and base != label:
            setattr(out, attr, paired_ratios(steps[label], steps[base]))
    return out


def _last_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[-1] if lines else "failed"


def format_speed_table(summaries: Sequence[ConfigSummary]) -> str:
    """The summary as a table: step time (median and range over rounds), tokens/s, MFU, peak
    memory, ratios to FSDP2 and plain (median and range of the per-round ratios), loss 1."""
    lines = [
        f"{'configuration':<18} {'step ms (min-max)':>22} {'tokens/s':>9} {'MFU':>6} "
        f"{'peak GiB':>8} {'vs FSDP2':>18} {'vs plain':>18} {'loss 1':>9}"
    ]
    for s in summaries:
        if s.step_s is None:
            lines.append(f"{s.label:<18} FAILED: {s.errors[-1] if s.errors else 'no run'}")
            continue
        mfu = "-" if s.mfu is None else f"{100 * s.mfu:.1f}%"
        ratio = [("-" if r is None else r.format(digits=2)) for r in (s.vs_fsdp2, s.vs_plain)]
        lines.append(
            f"{s.label:<18} {s.step_s.format(1e3):>22} {s.tokens_per_s or 0:9.0f} "
            f"{mfu:>6} {(s.peak_mib or 0) / 1024:8.2f} {ratio[0]:>18} {ratio[1]:>18} "
            f"{s.first_loss:9.5f}"
        )
        lines.extend(f"{'':<18} a round failed: {e}" for e in s.errors)
    return "\n".join(lines)


def format_trace_lines(summaries: Sequence[ConfigSummary]) -> list[str]:
    """One line per traced configuration: the compute stream's idle time and the kernel time
    by category, per step (and the host-to-device copies of the traced steps, and the share
    of them hidden behind kernels of other streams)."""
    lines = []
    for s in summaries:
        t = s.extra.get("trace")
        if not t:
            continue
        kernels = ", ".join(f"{k} {v:.1f}" for k, v in t["kernel_ms"].items())
        line = (
            f"trace {s.label:<18} compute stream {t['compute_stream']}: idle "
            f"{t['idle_ms']:.1f} of {t['span_ms']:.1f} ms per step; kernel ms per step: "
            f"{kernels}"
        )
        if s.extra.get("h2d_ms"):
            line += (
                f"; host-to-device {s.extra['h2d_ms']:.1f} ms in {t['steps']} steps, "
                f"{100 * s.extra['h2d_hidden_share']:.0f}% hidden"
            )
        lines.append(line)
    return lines


# ---- the GPU's clocks, power and temperature ---------------------------------------------------

#: What nvidia-smi is asked for, in this order.
NVIDIA_SMI_FIELDS = ("clocks.sm", "clocks.mem", "power.draw", "temperature.gpu")


@dataclass(frozen=True)
class GpuState:
    """SM and memory clocks (MHz), power draw (W) and temperature (C) of one GPU, as far as
    ``source`` ("nvidia-smi", "torch.cuda", or "absent": nothing to read them with) gives them."""

    source: str
    sm_mhz: float | None = None
    mem_mhz: float | None = None
    power_w: float | None = None
    temp_c: float | None = None
    note: str = ""


def _number(cell: str) -> float | None:
    """The number in one of nvidia-smi's cells ("1980 MHz", "70.52 W", "31"); None for
    "[N/A]", "[Not Supported]" and anything else without one."""
    m = re.search(r"[-+]?\d+(?:\.\d+)?", cell)
    return None if m is None or "N/A" in cell or "Not Supported" in cell else float(m.group())


def parse_nvidia_smi(text: str) -> list[GpuState]:
    """One `GpuState` per line of ``nvidia-smi --query-gpu=clocks.sm,clocks.mem,power.draw,
    temperature.gpu --format=csv,noheader`` (one line per GPU); lines that are not four cells
    are skipped."""
    states = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) != len(NVIDIA_SMI_FIELDS):
            continue
        sm, mem, power, temp = (_number(c) for c in cells)
        states.append(GpuState("nvidia-smi", sm, mem, power, temp))
    return states


def nvidia_smi_command(visible_devices: str | None = None) -> list[str]:
    """The nvidia-smi query, for the GPU the benchmark runs on: the first of
    ``CUDA_VISIBLE_DEVICES`` when it names one (an index or a UUID), else every GPU."""
    cmd = ["nvidia-smi", f"--query-gpu={','.join(NVIDIA_SMI_FIELDS)}", "--format=csv,noheader"]
    first = (visible_devices or "").split(",")[0].strip()
    if first:
        cmd.append(f"--id={first}")
    return cmd


def read_gpu_state(
    *,
    run: Callable[..., Any] = subprocess.run,
    which: Callable[[str], str | None] = shutil.which,
    env: Mapping[str, str] | None = None,
    torch_cuda: Any = None,
) -> GpuState:
    """The first GPU's state now: from nvidia-smi if it is on the PATH, else from torch.cuda's
    NVML readers, else ``GpuState("absent")`` saying why. Never raises."""
    env = os.environ if env is None else env
    notes = []
    if which("nvidia-smi"):
        try:
            done = run(
                nvidia_smi_command(env.get("CUDA_VISIBLE_DEVICES")),
                capture_output=True,
                text=True,
                timeout=15,
            )
        except (OSError, subprocess.SubprocessError) as exc:
            notes.append(f"nvidia-smi failed: {exc}")
        else:
            states = parse_nvidia_smi(done.stdout) if done.returncode == 0 else []
            if states:
                return states[0]
            notes.append(
                f"nvidia-smi exited {done.returncode}: "
                f"{(done.stderr or done.stdout or '').strip()[:200]}"
            )
    else:
        notes.append("no nvidia-smi on the PATH")
    return _torch_gpu_state(torch_cuda, notes)


def _torch_gpu_state(torch_cuda: Any, notes: list[str]) -> GpuState:
    if torch_cuda is None:
        import torch

        torch_cuda = torch.cuda
    if not torch_cuda.is_available():
        return GpuState("absent", note="; ".join([*notes, "no CUDA device"]))
    got: dict[str, float | None] = {}
    for key, reader, scale in (
        ("sm_mhz", "clock_rate", 1.0),
        ("power_w", "power_draw", 1e-3),
        ("temp_c", "temperature", 1.0),
    ):
        try:
            got[key] = float(getattr(torch_cuda, reader)(0)) * scale
        except Exception as exc:  # pynvml absent, or a reader this GPU does not have
            got[key] = None
            notes.append(f"torch.cuda.{reader}: {type(exc).__name__}: {exc}"[:200])
    if all(v is None for v in got.values()):
        return GpuState("absent", note="; ".join(notes))
    return GpuState(
        "torch.cuda", got["sm_mhz"], None, got["power_w"], got["temp_c"], note="; ".join(notes)
    )


def format_gpu_state(state: GpuState) -> str:
    """One line: ``sm 1980 MHz, mem 2619 MHz, 70.5 W, 31 C (nvidia-smi)``; what is absent
    says so."""
    if state.source == "absent":
        return f"absent ({state.note})" if state.note else "absent"

    def cell(value: float | None, unit: str, digits: int = 0) -> str:
        return "n/a" if value is None else f"{value:.{digits}f} {unit}"

    return (
        f"sm {cell(state.sm_mhz, 'MHz')}, mem {cell(state.mem_mhz, 'MHz')}, "
        f"{cell(state.power_w, 'W', 1)}, {cell(state.temp_c, 'C')} ({state.source})"
    )


# ---- profiler traces ---------------------------------------------------------------------------


class GpuEvent(NamedTuple):
    """One kernel or memory operation on the GPU: name, stream, start and duration (us)."""

    name: str
    stream: int | str
    start: float
    duration: float


#: Categories of `kernel_category`, in the order a table shows them.
CATEGORIES = ("gemm", "nccl", "copy+cast", "other")
_NCCL = re.compile(r"nccl", re.IGNORECASE)
_GEMM = re.compile(
    r"gemm|cutlass|cublas|nvjet|xmma|matmul|flash|fmha|sdpa|attention", re.IGNORECASE
)
_COPY = re.compile(r"copy|(?<!broad)cast|memcpy|memset|chunk_cat|catarray|\bcat\b", re.IGNORECASE)


def kernel_category(name: str) -> str:
    """ "nccl" (collectives), "gemm" (matrix multiplies, attention included), "copy+cast"
    (copies, dtype casts, concatenation, memcpy and memset) or "other", by the kernel's name."""
    for category, pattern in (("nccl", _NCCL), ("gemm", _GEMM), ("copy+cast", _COPY)):
        if pattern.search(name):
            return category
    return "other"


@dataclass(frozen=True)
class TraceSummary:
    """Where the compute stream's time went, per traced step (milliseconds): ``idle_ms``, the
    gaps between its first and last kernel with nothing of its own running (launch gaps, waits
    on other streams), and ``kernel_ms``, the kernel time of every stream by category."""

    compute_stream: int | str | None
    steps: int
    span_ms: float
    idle_ms: float
    kernel_ms: dict[str, float]


def union_length(spans: Iterable[tuple[float, float]]) -> float:
    """Total length covered by the (start, end) ``spans``, overlaps counted once."""
    length, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            length += b - max(a, end)
            end = b
    return length


def reduce_trace(events: Sequence[GpuEvent], steps: int = 1) -> TraceSummary:
    """A trace's GPU ``events`` (times in us) over ``steps`` steps, reduced to the compute
    stream's idle time and the kernel time by category, each per step. The compute stream is
    the one with the most gemm time (the most kernel time, when there is no gemm)."""
    steps = max(steps, 1)
    kernel_ms = dict.fromkeys(CATEGORIES, 0.0)
    for e in events:
        kernel_ms[kernel_category(e.name)] += e.duration / 1e3 / steps
    stream = _compute_stream(events)
    if stream is None:
        return TraceSummary(None, steps, 0.0, 0.0, kernel_ms)
    spans = [(e.start, e.start + e.duration) for e in events if e.stream == stream]
    span = max(b for _, b in spans) - min(a for a, _ in spans)
    idle = span - union_length(spans)
    return TraceSummary(stream, steps, span / 1e3 / steps, idle / 1e3 / steps, kernel_ms)


def _compute_stream(events: Sequence[GpuEvent]) -> int | str | None:
    gemm: dict[int | str, float] = {}
    busy: dict[int | str, float] = {}
    for e in events:
        busy[e.stream] = busy.get(e.stream, 0.0) + e.duration
        if kernel_category(e.name) == "gemm":
            gemm[e.stream] = gemm.get(e.stream, 0.0) + e.duration
    pick = gemm or busy
    return max(pick, key=lambda s: pick[s]) if pick else None


#: Chrome-trace categories of GPU work (torch.profiler's export).
_GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def events_from_chrome_trace(trace: Mapping[str, Any]) -> list[GpuEvent]:
    """The GPU events of a chrome trace as ``torch.profiler``'s ``export_chrome_trace`` writes
    it: kernels, memcpys and memsets, on the stream in their ``args`` (else their ``tid``)."""
    out = []
    for e in trace.get("traceEvents", []):
        if e.get("cat") in _GPU_CATEGORIES and "dur" in e:
            stream = (e.get("args") or {}).get("stream", e.get("tid"))
            out.append(GpuEvent(e.get("name", ""), stream, float(e["ts"]), float(e["dur"])))
    return out
