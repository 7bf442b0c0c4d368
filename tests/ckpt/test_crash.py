"""kill -9 of a rank at any point of a save leaves the previous checkpoint whole and loadable
(or, once the pointer was replaced, the new one whole); the next save clears the leftovers.

Ranks run as processes (``backend="torch"``) and SIGKILL themselves from a storage hook at
the chosen point.
"""

from __future__ import annotations

import os
from pathlib import Path

import fsdp_ckpt as ck
import pytest
import torch
from fsdp_comm import launch

from . import ranks

TIMEOUT = 60


def _plain_after(steps: int, world: int) -> dict[str, torch.Tensor]:
    model = ranks.build(0)
    ranks.plain_train(model, ranks.optimizer(model), world, range(steps))
    return {n: p.detach() for n, p in model.named_parameters()}


def _check_trained(path: str, step: int, world: int) -> None:
    ck.verify(path)
    model = ranks.build(1)
    opt = ranks.optimizer(model)
    assert ck.load(path, model, opt) == {"step": step}
    for name, value in _plain_after(step, world).items():
        torch.testing.assert_close(model.get_parameter(name), value, rtol=1e-4, atol=1e-6)
    assert all(s["step"].item() == step for s in opt.state.values())


def _check_shifted(path: str, step: int) -> None:
    ck.verify(path)
    model = ranks.build(1)
    assert ck.load(path, model) == {"step": step}
    for name, value in ranks.build(0).named_parameters():
        want = value.detach().clone()
        for _ in range(step):
            want += 1.0  # the same additions the saving rank made
        assert torch.equal(model.get_parameter(name), want), name


def _launch_and_die(path: str, world: int, point: str, die_rank: int) -> None:
    with pytest.raises(Exception) as info:
        launch(
            ranks.save_twice_and_die,
            world,
            backend="torch",
            args=(path, point, die_rank),
            timeout=TIMEOUT,
            threads_per_rank=1,
        )
    assert "rank" in str(info.value)


def test_kill_of_a_rank_mid_write_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    path = str(tmp_path / "run")
    _launch_and_die(path, 2, "data", die_rank=1)
    # Rank 0 removes the partial save's staging directory when its vote fails on the closed
    # connection before `launch` ends it; if it was ended first, the next commit removes it.
    _check_trained(path, step=1, world=2)
    ck.save(path, ranks.build(2), extra={"step": 9})
    assert not [n for n in os.listdir(path) if n.startswith(".")]  # before the cleanup thread
    ck.wait_for_cleanup(path)
    assert sorted(os.listdir(path)) == ["CURRENT", "v000002"]


# (where the rank dies, the step loaded afterwards, the version the next save commits)
POINTS = [
    ("data", 1, "v000002"),
    ("index", 1, "v000002"),
    ("version-rename", 1, "v000002"),
    ("pointer", 1, "v000003"),
    ("after-pointer", 2, "v000003"),
]


@pytest.mark.parametrize("point,step,next_version", POINTS)
def test_kill_at_each_point_of_the_commit(
    tmp_path: Path, point: str, step: int, next_version: str
) -> None:
    path = str(tmp_path / "run")
    _launch_and_die(path, 1, point, die_rank=0)
    _check_shifted(path, step=step)
    # The next save clears what the crash left and commits normally. A staging directory
    # is reused (stale files dropped); a version renamed but never pointed to is skipped.
    ck.save(path, ranks.build(2), extra={"step": 9})
    ck.wait_for_cleanup(path)
    assert sorted(os.listdir(path)) == ["CURRENT", next_version]
    assert ck.load(path, ranks.build(1)) == {"step": 9}
