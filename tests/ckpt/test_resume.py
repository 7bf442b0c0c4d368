"""A run that saves at step k, resumes in fresh processes' objects and continues matches the
uninterrupted run step for step (exactly at the same world size)."""

from __future__ import annotations

from pathlib import Path

import torch
from fsdp_comm import launch

from . import ranks

TIMEOUT = 120
K, TOTAL = 3, 6


def _mean_losses(results: list[dict]) -> list[float]:
    per_rank = [r["losses"] for r in results]
    return [sum(step) / len(step) for step in zip(*per_rank)]


def test_resume_matches_uninterrupted_run_exactly(tmp_path: Path) -> None:
    path = str(tmp_path / "run")
    full = launch(ranks.resume_run, 2, backend="threads", args=(None, 0, TOTAL), timeout=TIMEOUT)
    first = launch(ranks.train_then_save, 2, backend="threads", args=(path, K), timeout=TIMEOUT)
    resumed = launch(ranks.resume_run, 2, backend="threads", args=(path, K, TOTAL), timeout=TIMEOUT)
    uninterrupted = [r["losses"] for r in full]
    stitched = [a + b["losses"] for a, b in zip(first, resumed)]
    assert stitched == uninterrupted  # bit for bit, every rank, every step
    for name, value in full[0]["params"].items():
        assert torch.equal(resumed[0]["params"][name], value), name


def test_resume_at_another_world_size_continues_the_same_run(tmp_path: Path) -> None:
    path = str(tmp_path / "run")
    full = launch(ranks.resume_run, 2, backend="threads", args=(None, 0, TOTAL), timeout=TIMEOUT)
    launch(ranks.train_then_save, 4, backend="threads", args=(path, K), timeout=TIMEOUT)
    resumed = launch(ranks.resume_run, 2, backend="threads", args=(path, K, TOTAL), timeout=TIMEOUT)
    # Saved at 4 ranks, resumed at 2: the same global batches, other summation orders.
    want, got = _mean_losses(full)[K:], _mean_losses(resumed)
    assert len(got) == TOTAL - K
    for a, b in zip(got, want):
        assert abs(a - b) <= 1e-5 * abs(b), (got, want)
    for name, value in full[0]["params"].items():
        torch.testing.assert_close(resumed[0]["params"][name], value, rtol=1e-4, atol=1e-6)
