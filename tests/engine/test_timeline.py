"""`fsdp_engine.profile_steps`: the step timeline (Note [step timeline] in _timeline.py) at
world sizes 1 (threads backend, in process) and 2 (gloo, processes): torch.profiler ranges and
the added lanes in the Chrome trace, a summary whose figures add up, nothing recorded without
a profile, and the CUDA clock on a GPU."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from fsdp_comm import ThreadsBackend, launch
from fsdp_engine import TimelineSummary, fully_shard, profile_steps

from fsdp.models import GPT, MODEL_SIZES

TIMEOUT = 120
LANES = {"fsdp compute", "fsdp all-gather", "fsdp reduce-scatter", "fsdp host copies"}


def _model(be: Any) -> tuple[Any, Any]:
    torch.manual_seed(0)
    net = GPT(MODEL_SIZES["tiny"])
    for block in net.blocks:
        fully_shard(block, mesh=be)
    fully_shard(net, mesh=be)
    return net, torch.optim.AdamW(net.parameters(), lr=1e-3)


def _step(net: Any, opt: Any, rank: int) -> None:
    cfg = MODEL_SIZES["tiny"]
    x = torch.randint(
        0, cfg.vocab_size, (2, cfg.seq_len), generator=torch.Generator().manual_seed(rank)
    )
    F.cross_entropy(net(x).flatten(0, 1), x.flatten()).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _profiled_rank(be: Any, trace_dir: str | None, steps: int = 2) -> TimelineSummary:
    torch.set_num_threads(1)
    net, opt = _model(be)
    _step(net, opt, be.rank)  # builds the units
    with profile_steps(net, trace_dir=trace_dir) as prof:
        for _ in range(steps):
            _step(net, opt, be.rank)
            prof.step()
    return prof.summary()


def _check_summary(s: TimelineSummary, units: set[str], steps: int = 2) -> None:
    assert s.steps == steps and s.clock == "cpu"
    assert s.step_ms > 0 and s.compute_ms > 0 and s.engine_ms > 0
    assert math.isclose(s.compute_ms + s.exposed_ms + s.engine_ms, s.step_ms, rel_tol=1e-6)
    assert s.hidden_ms >= 0 and s.exposed_ms <= s.comm_ms + 1e-6
    assert s.copies_ms <= s.engine_ms + 1e-6
    names = {u.unit for u in s.units}
    assert units <= names, names
    assert math.isclose(sum(u.compute_ms for u in s.units), s.compute_ms, rel_tol=1e-6)
    assert math.isclose(sum(u.engine_ms for u in s.units), s.engine_ms, rel_tol=1e-6)
    assert math.isclose(
        sum(u.exposed_ms for u in s.units), s.exposed_ms, rel_tol=1e-6, abs_tol=1e-9
    )
    text = s.format()
    assert "exposed comm" in text and all(u in text for u in units)
    assert set(s.metrics()) >= {
        "timeline_step_ms",
        "timeline_exposed_ms",
        "timeline_hidden_ms",
        "timeline_engine_ms",
    }


def _trace(path: Path) -> tuple[set[str], set[str]]:
    events = json.loads(path.read_text())["traceEvents"]
    ranges = {
        e["name"]
        for e in events
        if e.get("ph") == "X" and str(e.get("name", "")).startswith("fsdp::")
    }
    lanes = {e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    return ranges, lanes


UNITS = {"<root>", "blocks.0", "blocks.1"}


def test_world_size_1_trace_and_summary(tmp_path: Path) -> None:
    be = ThreadsBackend.create(1)[0]
    summary = _profiled_rank(be, str(tmp_path))
    _check_summary(summary, UNITS | {"<outside units>"})
    ranges, lanes = _trace(tmp_path / "rank0.trace.json")
    assert {f"fsdp::forward {unit}" for unit in UNITS} <= ranges, ranges
    # (a unit whose shard is the whole of it at world size 1 skips its pre-backward hook,
    # so its backward counts in the enclosing unit's range)
    assert "fsdp::backward <root>" in ranges
    assert LANES <= lanes


def _world2_rank(be: Any, trace_dir: str) -> TimelineSummary:
    return _profiled_rank(be, trace_dir)


def test_world_size_2_over_gloo(tmp_path: Path) -> None:
    results = launch(
        _world2_rank, 2, backend="torch", args=(str(tmp_path),), timeout=TIMEOUT, threads_per_rank=1
    )
    for rank, summary in enumerate(results):
        _check_summary(summary, UNITS)
        assert summary.comm_ms > 0
        blocks = [u for u in summary.units if u.unit.startswith("blocks.")]
        assert all(u.comm_ms > 0 for u in blocks)  # each block gathers and reduces
        ranges, lanes = _trace(tmp_path / f"rank{rank}.trace.json")
        for kind in ("gather", "wait_gather", "forward", "backward", "reduce", "wait_reduce"):
            assert f"fsdp::{kind} blocks.1" in ranges, (kind, ranges)
        assert LANES <= lanes


def test_lanes_line_up_with_torch_events(tmp_path: Path) -> None:
    """The added lanes are on torch's clock: the compute lane spans the profiled steps,
    inside the trace's own events."""
    be = ThreadsBackend.create(1)[0]
    _profiled_rank(be, str(tmp_path), steps=1)
    events = json.loads((tmp_path / "rank0.trace.json").read_text())["traceEvents"]
    ours = [e for e in events if e.get("cat") == "fsdp_timeline"]
    forward = [e for e in events if e.get("name") == "fsdp::forward <root>"]
    assert ours and forward
    start = min(e["ts"] for e in ours)
    end = max(e["ts"] + e["dur"] for e in ours)
    f = forward[0]
    assert start - 1e3 <= f["ts"] and f["ts"] + f["dur"] <= end + 1e3  # within 1 ms


def test_no_profile_records_nothing() -> None:
    be = ThreadsBackend.create(1)[0]
    net, opt = _model(be)
    _step(net, opt, 0)
    with profile_steps(net) as prof:
        _step(net, opt, 0)
        prof.step()
    tl = prof.timeline
    assert tl is None  # detached on exit
    states = [m._fsdp_state for m in net.modules() if hasattr(m, "_fsdp_state")]
    assert states and all(s.unit.ctx.timeline is None for s in states)
    with profile_steps(net) as prof:
        recorder = prof.timeline
    counts = [len(recorder.hooks), len(recorder.waits), len(recorder.comms)]
    _step(net, opt, 0)  # outside any profile
    assert [len(recorder.hooks), len(recorder.waits), len(recorder.comms)] == counts


def test_summary_without_steps_and_bad_arguments() -> None:
    be = ThreadsBackend.create(1)[0]
    net, _ = _model(be)
    with pytest.raises(TypeError, match="model must be a module passed to fully_shard"):
        profile_steps(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="rank must be an integer >= 0 or None, got -1"):
        profile_steps(net, rank=-1)
    with profile_steps(net) as prof:
        pass
    with pytest.raises(ValueError, match="no profiled step"):
        prof.summary()
    with pytest.raises(RuntimeError, match="inside its `with` block"):
        prof.step()


@pytest.mark.gpu
def test_cuda_clock(tmp_path: Path) -> None:
    be = ThreadsBackend.create(1, device="cuda")[0]
    torch.manual_seed(0)
    net = GPT(MODEL_SIZES["tiny"]).cuda()
    for block in net.blocks:
        fully_shard(block, mesh=be)
    fully_shard(net, mesh=be)
    x = torch.randint(0, 256, (2, MODEL_SIZES["tiny"].seq_len), device="cuda")
    net(x).sum().backward()
    with profile_steps(net, trace_dir=str(tmp_path)) as prof:
        net(x).sum().backward()
        prof.step()
    s = prof.summary()
    assert s.clock == "cuda" and s.step_ms > 0 and s.exposed_ms >= 0
    assert math.isclose(s.compute_ms + s.exposed_ms, s.step_ms, rel_tol=1e-6)
    assert (tmp_path / "rank0.trace.json").exists()
