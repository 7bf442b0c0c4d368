"""The GPU benchmark's parts that need no GPU: the trace overlap figure and its refusal."""

from __future__ import annotations

import json

import pytest
import torch

from fsdp import bench_gpu


def test_h2d_overlap_counts_copies_hidden_behind_kernels_of_other_streams(tmp_path) -> None:
    events = [
        {"cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "ts": 0, "dur": 10,
         "tid": 7},
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
