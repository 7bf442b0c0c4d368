"""The GPU benchmark's parts that need no GPU (issue #27): the order of its rounds, medians,
ranges and ratios, nvidia-smi's output, the reduction of a trace, the orchestration with the
GPU runs replaced, and the command's help and refusal without a GPU."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict

import pytest
import torch

from fsdp.bench import gpu as bench_gpu
from fsdp.bench._gpu_measure import (
    GpuEvent,
    GpuState,
    events_from_chrome_trace,
    format_gpu_state,
    format_speed_table,
    kernel_category,
    nvidia_smi_command,
    paired_ratios,
    parse_nvidia_smi,
    read_gpu_state,
    reduce_trace,
    round_order,
    spread,
    summarize_runs,
)


def test_h2d_overlap_counts_copies_hidden_behind_kernels_of_other_streams(tmp_path) -> None:
    events = [
        {
            "cat": "gpu_memcpy",
            "name": "Memcpy HtoD (Pinned -> Device)",
            "ts": 0,
            "dur": 10,
            "tid": 7,
        },
        {"cat": "kernel", "name": "gemm", "ts": 5, "dur": 10, "tid": 9},  # hides 5 of 10
        {"cat": "kernel", "name": "same stream", "ts": 0, "dur": 10, "tid": 7},  # hides nothing
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    got = bench_gpu.h2d_overlap(str(path))
    assert got == {"h2d_ms": 0.01, "h2d_hidden_share": 0.5}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_refuses_without_a_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        bench_gpu.main(["speed"])
    assert "needs a CUDA device" in capsys.readouterr().err


# ---- rounds, statistics, ratios (issue #27) ----------------------------------------------------
def test_rounds_alternate_direction() -> None:
    order = round_order("ABC", 2)
    assert "".join(c for _, c in order) == "ABCCBA"
    assert [r for r, _ in order] == [0, 0, 0, 1, 1, 1]
    assert "".join(c for _, c in round_order("ABC", 3)) == "ABCCBAABC"
    with pytest.raises(ValueError, match="repeats"):
        round_order("ABC", 0)


def test_spread_is_median_and_range() -> None:
    s = spread([0.12, 0.10, 0.11, 0.16])
    assert (s.median, s.low, s.high, s.n) == (pytest.approx(0.115), 0.10, 0.16, 4)
    assert s.relative == pytest.approx(0.06 / 0.115)
    assert s.format(1e3) == "115.0 (100.0-160.0)"
    assert spread([2.0]).format() == "2.0"
    assert spread([]) is None


def test_ratios_pair_runs_of_the_same_round() -> None:
    ours = {0: 1.10, 1: 1.30, 2: 1.20}
    fsdp2 = {0: 1.00, 1: 1.00}  # round 2 failed: no pair
    r = paired_ratios(ours, fsdp2)
    assert (r.n, r.median, r.low, r.high) == (
        2,
        pytest.approx(1.2),
        pytest.approx(1.1),
        pytest.approx(1.3),
    )
    assert paired_ratios(ours, {}) is None


def _run(engine: str, rnd: int, step_s: float, ac: bool = False, **extra: object) -> dict:
    return {
        "config": {"engine": engine, "model": "1b", "ac": ac, "offload": False, "trace": None},
        "round": rnd,
        "step_s": step_s,
        "tokens_per_s": 8192 / step_s,
        "mfu": 0.3,
        "peak_mib": 1024.0 * (rnd + 1),
        "first_loss": 10.8,
        **extra,
    }


def test_summary_ratios_to_fsdp2_and_plain_per_variant() -> None:
    runs = [
        _run("plain", 0, 0.100),
        _run("fsdp2", 0, 0.110),
        _run("ours", 0, 0.121, trace={"idle_ms": 1.0}),
        _run("plain", 0, 0.200, ac=True),
        _run("fsdp2", 0, 0.220, ac=True),
        _run("ours", 0, 0.220, ac=True),
        _run("ours", 1, 0.130, ac=True),
        _run("fsdp2", 1, 0.200, ac=True),
        _run("plain", 1, 0.100, ac=True),
        {
            "config": _run("ours", 1, 1.0)["config"],
            "round": 1,
            "error": "Traceback...\nRuntimeError: out of memory",
        },
        _run("fsdp2", 1, 0.100),
        _run("plain", 1, 0.080),
    ]
    got = {s.label: s for s in summarize_runs(runs)}
    assert list(got) == ["plain", "fsdp2", "ours", "plain +AC", "fsdp2 +AC", "ours +AC"]
    ours = got["ours"]
    assert ours.step_s.n == 1 and ours.step_s.median == 0.121
    assert ours.vs_fsdp2.median == pytest.approx(1.1) and ours.vs_fsdp2.n == 1
    assert ours.vs_plain.median == pytest.approx(1.21)
    assert ours.errors == ["RuntimeError: out of memory"]
    assert ours.extra == {"trace": {"idle_ms": 1.0}}
    ac = got["ours +AC"]  # rounds: 0.220/0.220 = 1.0 and 0.130/0.200 = 0.65
    assert ac.vs_fsdp2.median == pytest.approx(0.825)
    assert (ac.vs_fsdp2.low, ac.vs_fsdp2.high) == (pytest.approx(0.65), pytest.approx(1.0))
    assert ac.vs_plain.median == pytest.approx((1.1 + 1.3) / 2)
    assert ac.peak_mib == 2048.0 and ac.step_s.format(1e3) == "175.0 (130.0-220.0)"
    assert got["fsdp2"].vs_fsdp2 is None and got["plain"].vs_plain is None
    assert got["fsdp2"].vs_plain.median == pytest.approx((1.1 + 1.25) / 2)
    table = format_speed_table(list(got.values()))
    assert "ours +AC" in table and "0.82 (0.65-1.00)" in table
    assert "a round failed: RuntimeError: out of memory" in table


# ---- clocks, power, temperature ----------------------------------------------------------------
NVIDIA_SMI = """1980 MHz, 2619 MHz, 112.43 W, 34
345 MHz, 2619 MHz, [N/A], 29
"""


def test_nvidia_smi_output_parses() -> None:
    first, second = parse_nvidia_smi(NVIDIA_SMI + "\nsomething else\n")
    assert first == GpuState("nvidia-smi", 1980.0, 2619.0, 112.43, 34.0)
    assert second.power_w is None and second.sm_mhz == 345.0
    assert format_gpu_state(first) == "sm 1980 MHz, mem 2619 MHz, 112.4 W, 34 C (nvidia-smi)"
    assert "n/a" in format_gpu_state(second)
    assert parse_nvidia_smi("") == []


def test_nvidia_smi_asks_for_the_visible_gpu() -> None:
    cmd = nvidia_smi_command("3,1")
    assert cmd[:3] == [
        "nvidia-smi",
        "--query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu",
        "--format=csv,noheader",
    ]
    assert cmd[3:] == ["--id=3"]
    assert len(nvidia_smi_command(None)) == 3


class _NoCuda:
    @staticmethod
    def is_available() -> bool:
        return False


class _CudaWithoutNvml:
    @staticmethod
    def is_available() -> bool:
        return True

    def __getattr__(self, name: str):
        def reader(device: int) -> int:
            raise ModuleNotFoundError("pynvml")

        return reader


def test_gpu_state_is_absent_without_tools() -> None:
    state = read_gpu_state(which=lambda name: None, torch_cuda=_NoCuda())
    assert state.source == "absent" and "no nvidia-smi" in state.note
    state = read_gpu_state(which=lambda name: None, torch_cuda=_CudaWithoutNvml())
    assert state.source == "absent" and "clock_rate" in state.note
    assert format_gpu_state(state).startswith("absent (")


def test_gpu_state_from_nvidia_smi_or_its_failure() -> None:
    def ran(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess(cmd, 0, NVIDIA_SMI, "")

    def failed(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess(cmd, 9, "", "NVIDIA-SMI has failed")

    def where(name: str) -> str:
        return "/usr/bin/nvidia-smi"

    got = read_gpu_state(run=ran, which=where, env={}, torch_cuda=_NoCuda())
    assert got.sm_mhz == 1980.0
    got = read_gpu_state(run=failed, which=where, env={}, torch_cuda=_NoCuda())
    assert got.source == "absent" and "NVIDIA-SMI has failed" in got.note


# ---- trace reduction ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name, category",
    [
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "gemm"),
        ("nvjet_tst_128x256_64x4_2x1_v_bz_coopA_NNT", "gemm"),
        ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128>>", "gemm"),
        ("ncclDevKernel_AllGather_RING_LL(ncclDevComm*, unsigned long, ncclWork*)", "nccl"),
        (
            "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda>",
            "copy+cast",
        ),
        ("Memcpy HtoD (Pinned -> Device)", "copy+cast"),
        ("void at::native::(anonymous namespace)::CatArrayBatchedCopy<float>", "copy+cast"),
        (
            "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>",
            "other",
        ),
        ("void at::native::elementwise_kernel<broadcast_add>", "other"),
    ],
)
def test_kernel_categories_by_name(name: str, category: str) -> None:
    assert kernel_category(name) == category


def test_trace_reduces_to_idle_time_and_kernel_time() -> None:
    events = [  # (name, stream, start us, duration us), two steps
        GpuEvent("ampere_bf16_s16816gemm", 7, 0, 100),
        GpuEvent("direct_copy_kernel_cuda", 7, 100, 20),
        GpuEvent("ampere_bf16_s16816gemm", 7, 150, 100),  # 30 us idle before it
        GpuEvent("elementwise_kernel", 7, 240, 20),  # overlaps the gemm by 10
        GpuEvent("ncclDevKernel_AllGather", 20, 0, 300),  # another stream: not idle time
        GpuEvent("ampere_bf16_s16816gemm", 7, 300, 100),  # 40 us idle before it
    ]
    got = reduce_trace(events, steps=2)
    assert got.compute_stream == 7
    assert got.span_ms == pytest.approx(0.400 / 2)
    assert got.idle_ms == pytest.approx(0.070 / 2)
    assert got.kernel_ms == pytest.approx(
        {"gemm": 0.15, "nccl": 0.15, "copy+cast": 0.01, "other": 0.01}
    )
    empty = reduce_trace([])
    assert empty.compute_stream is None and empty.idle_ms == 0.0


def test_chrome_trace_to_events_and_figures(tmp_path) -> None:
    trace = {
        "traceEvents": [
            {"cat": "kernel", "name": "gemm", "ts": 0, "dur": 10, "tid": 7, "args": {"stream": 7}},
            {
                "cat": "gpu_memcpy",
                "name": "Memcpy HtoD (Pinned -> Device)",
                "ts": 0,
                "dur": 10,
                "tid": 9,
            },
            {"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 50, "tid": 1},
            {"cat": "kernel", "name": "gemm", "ts": 20, "dur": 10, "tid": 7},
        ]
    }
    assert events_from_chrome_trace(trace) == [
        GpuEvent("gemm", 7, 0.0, 10.0),
        GpuEvent("Memcpy HtoD (Pinned -> Device)", 9, 0.0, 10.0),
        GpuEvent("gemm", 7, 20.0, 10.0),
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(trace))
    got = bench_gpu.trace_figures(str(path), steps=2)
    assert got["h2d_ms"] == 0.01 and got["h2d_hidden_share"] == 1.0
    assert got["trace"]["idle_ms"] == pytest.approx(0.005)
    assert got["trace"]["kernel_ms"]["gemm"] == pytest.approx(0.01)


# ---- the command without a GPU -----------------------------------------------------------------
def test_speed_runs_rounds_in_alternating_order(monkeypatch, tmp_path, capsys) -> None:
    """The orchestration with the GPU runs replaced: order, one trace per configuration (first
    round), the summary printed and written."""
    ran: list[tuple[str, str | None]] = []

    def fake_run(cfg: bench_gpu.SpeedConfig) -> dict:
        ran.append((bench_gpu.config_label(asdict(cfg)), cfg.trace))
        step = {"plain": 0.1, "fsdp2": 0.11, "ours": 0.12}[cfg.engine] * (2 if cfg.ac else 1)
        return {
            "config": asdict(cfg),
            "step_s": step,
            "tokens_per_s": 1.0 / step,
            "mfu": None,
            "peak_mib": 100.0,
            "first_loss": 10.0,
            "device": "fake",
        }

    monkeypatch.setattr(bench_gpu, "_in_fresh_process", fake_run)
    monkeypatch.setattr(bench_gpu, "read_gpu_state", lambda: GpuState("absent", note="test"))
    args = bench_gpu._parser().parse_args(
        ["speed", "--model", "tiny", "--trace", "--out", str(tmp_path)]
    )
    assert bench_gpu.speed(args) == 0
    labels = [label for label, _ in ran]
    first = ["plain", "fsdp2", "ours", "plain +AC", "fsdp2 +AC", "ours +AC"]
    assert labels == first + first[::-1]
    assert all(trace for _, trace in ran[:6]) and not any(trace for _, trace in ran[6:])
    out = capsys.readouterr().out
    assert "ours +AC" in out and "GPU before: absent (test)" in out
    doc = json.loads((tmp_path / "speed-tiny.json").read_text())
    ours = next(s for s in doc["summary"] if s["label"] == "ours")
    assert ours["vs_fsdp2"]["median"] == pytest.approx(0.12 / 0.11)
    assert len(doc["runs"]) == 12 and doc["gpu"]["before"]["source"] == "absent"


def test_no_benchmark_named_means_speed() -> None:
    assert bench_gpu._with_default_benchmark([]) == ["speed"]
    assert bench_gpu._with_default_benchmark(["--repeats", "3"]) == ["speed", "--repeats", "3"]
    assert bench_gpu._with_default_benchmark(["--help"]) == ["--help"]
    assert bench_gpu._with_default_benchmark(["overhead"]) == ["overhead"]
    args = bench_gpu._parser().parse_args(bench_gpu._with_default_benchmark([]))
    assert (args.what, args.model, args.repeats, args.trace) == ("speed", "1b", 2, False)


def _module(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fsdp.bench.gpu", *argv], capture_output=True, text=True, timeout=120
    )


def test_help_works() -> None:
    done = _module("--help")
    assert done.returncode == 0 and done.stdout.startswith("usage: python -m fsdp.bench.gpu")
    assert "--repeats" in _module("speed", "--help").stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_command_without_a_gpu_exits_with_a_message() -> None:
    done = _module()
    assert done.returncode == 2
    assert "needs a CUDA device" in done.stderr and "Traceback" not in done.stderr
