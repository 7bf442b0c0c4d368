"""The shared-memory all-gather runs only between ranks that really share a shared-memory
directory (Note [which ranks share memory] in fsdp_comm/_shm_gather.py).

"Not shared" is simulated by pointing ranks at different directories through
``FSDP_COMM_SHM_DIR``, set inside each rank before its first all-gather; the probe must then
turn the path off while the all-gather still gives every rank's data.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from fsdp_comm import Backend, launch
from fsdp_comm._shm_gather import HostLayout, _layout, _report

from ..log_lines import LogLines

_SHM_ALWAYS = {"all_gather_shm_min_bytes": 0}  # every all-gather may take the shared path
_NUMEL = 1000


def _gather_twice(be: Backend) -> bool:
    """Two all-gathers of rank-stamped data; True when both give every rank's rows in order."""
    ok = True
    for call in range(2):
        inp = torch.arange(_NUMEL, dtype=torch.float32) + 1000.0 * be.rank + call
        out = torch.empty(_NUMEL * be.world_size)
        be.all_gather_into_tensor(out, inp)
        want = torch.cat(
            [
                torch.arange(_NUMEL, dtype=torch.float32) + 1000.0 * r + call
                for r in range(be.world_size)
            ]
        )
        ok = ok and torch.equal(out, want)
    return ok


def _in_dirs(be: Any, dirs: list[str], body: Any) -> dict[str, Any]:
    """Run ``body(be)`` with this rank's shared-memory directory ``dirs[rank]``, collecting what
    fsdp.comm logs at INFO."""
    os.environ["FSDP_COMM_SHM_DIR"] = dirs[be.rank]
    lines = LogLines()
    log = logging.getLogger("fsdp.comm")
    log.addHandler(lines)
    log.setLevel(logging.INFO)
    try:
        result: dict[str, Any] = body(be)
    finally:
        log.removeHandler(lines)
    return {**result, "log": lines.lines}


def _world(be: Any) -> dict[str, Any]:
    return {
        "ok": _gather_twice(be),
        "layout": be.shared_memory_layout,
        "calls": be.shared_memory_all_gathers,
    }


def _world_then_hosts(be: Any) -> dict[str, Any]:
    world = _world(be)
    first, second = be.new_group((0, 1)), be.new_group((2, 3))
    mine = first if first is not None else second
    ok = _gather_twice(mine)
    return {
        **world,
        "host_ok": ok,
        "host_layout": mine.shared_memory_layout,
        "host_calls": mine.shared_memory_all_gathers,
    }


def gather_in_dirs(be: Any, dirs: list[str]) -> dict[str, Any]:
    """Rank function: this rank's shared-memory directory is ``dirs[rank]``."""
    return _in_dirs(be, dirs, _world)


def gather_in_host_groups(be: Any, dirs: list[str]) -> dict[str, Any]:
    """Rank function, 4 ranks on "2 hosts": the world, then each host's own group."""
    return _in_dirs(be, dirs, _world_then_hosts)


def _run(fn: Any, dirs: list[Path]) -> list[dict[str, Any]]:
    for d in dirs:
        d.mkdir(exist_ok=True)
    return launch(
        fn,
        len(dirs),
        backend="torch",
        args=([str(d) for d in dirs],),
        backend_options=_SHM_ALWAYS,
        timeout=120,
    )


def _leftovers(dirs: list[Path]) -> list[str]:
    return sorted(p.name for d in set(dirs) for p in d.iterdir())


# ---- across processes over gloo ---------------------------------------------------------------
@pytest.mark.slow
def test_ranks_sharing_a_directory_gather_through_it(tmp_path: Path) -> None:
    dirs = [tmp_path / "host", tmp_path / "host"]
    results = _run(gather_in_dirs, dirs)
    for r in results:
        assert r["ok"]
        assert r["layout"] == HostLayout(hosts=((0, 1),), group=(0, 1))
        assert r["calls"] == 2
    assert _leftovers(dirs) == []  # probe files and segments are gone


@pytest.mark.slow
def test_ranks_with_their_own_directories_do_not(tmp_path: Path) -> None:
    dirs = [tmp_path / "a", tmp_path / "b"]
    results = _run(gather_in_dirs, dirs)
    for r in results:
        assert r["ok"]
        assert r["layout"].hosts == ((0,), (1,)) and not r["layout"].shared
        assert r["calls"] == 0
    assert _leftovers(dirs) == []


@pytest.mark.slow
def test_a_rank_without_the_directory_turns_the_path_off(tmp_path: Path) -> None:
    (tmp_path / "host").mkdir()
    results = launch(
        gather_in_dirs,
        2,
        backend="torch",
        backend_options=_SHM_ALWAYS,
        args=([str(tmp_path / "host"), str(tmp_path / "missing")],),
        timeout=120,
    )
    assert [r["ok"] for r in results] == [True, True]
    assert [r["calls"] for r in results] == [0, 0]
    assert results[0]["layout"].hosts == ((0,), (1,))


@pytest.mark.slow
def test_two_hosts_of_two_ranks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The world of 4 spans two directories: off, reported; each host's group: on."""
    monkeypatch.setenv("FSDP_COMM_DEBUG", "1")
    dirs = [tmp_path / "a", tmp_path / "a", tmp_path / "b", tmp_path / "b"]
    results = _run(gather_in_host_groups, dirs)
    for rank, r in enumerate(results):
        assert r["ok"] and r["host_ok"]
        assert r["layout"].hosts == ((0, 1), (2, 3))
        assert r["calls"] == 0
        # FSDP_COMM_DEBUG's descriptor all-gather before each one takes the path too
        assert r["host_layout"].shared and r["host_calls"] == 4
        assert r["host_layout"].group == ((0, 1) if rank < 2 else (2, 3))
    report = "shm hosts: [[0,1],[2,3]] -> shared-memory all-gather off for group (0,1,2,3)"
    assert results[0]["log"][0] == report  # the group's first rank reports, once
    assert results[1]["log"] == []
    assert results[0]["log"][1:] == [
        "shm hosts: [[0,1]] -> shared-memory all-gather on for group (0,1)"
    ]
    assert results[2]["log"] == [
        "shm hosts: [[2,3]] -> shared-memory all-gather on for group (2,3)"
    ]
    assert _leftovers(dirs) == []


# ---- the layout and its report, in this process -----------------------------------------------
def test_layout_groups_ranks_by_what_they_saw() -> None:
    seen = [[1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 1, 1], [0, 0, 1, 1]]
    layout = _layout(seen, (4, 5, 6, 7))
    assert layout.hosts == ((4, 5), (6, 7)) and not layout.shared
    assert _layout([[1, 1], [1, 1]], (0, 1)).shared
    # a rank that could not even write its own file is a host of its own
    assert _layout([[1, 0], [0, 0]], (0, 1)).hosts == ((0,), (1,))
    # a rank seen one way only: never shared
    assert not _layout([[1, 1], [0, 1]], (0, 1)).shared


def test_the_debug_report_reaches_stderr_when_info_is_off(
    capsys: pytest.CaptureFixture[str],
) -> None:
    log = logging.getLogger("fsdp.comm")
    old = log.level
    log.setLevel(logging.WARNING)
    try:
        _report(HostLayout(hosts=((0,), (1,)), group=(0, 1)), debug=True)
        _report(HostLayout(hosts=((0, 1),), group=(0, 1)), debug=False)  # DEBUG only
    finally:
        log.setLevel(old)
    err = capsys.readouterr().err
    assert err == (
        "FSDP_COMM_DEBUG [rank 0]: shm hosts: [[0],[1]] -> shared-memory all-gather "
        "off for group (0,1)\n"
    )
