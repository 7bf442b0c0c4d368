"""Fault injection at every storage call of a save: no loadable checkpoint is lost, and the
error names the cause.

A save of two ranks (threads) runs once with a counting storage to learn how many storage
calls each rank makes (files' writes and closes included); then, for every rank and every call
number, the same save runs with that one call raising ``OSError(EIO)``. Each time: the save
fails on every rank with the injected fault named in the error `launch` raises (or, for a
fault after the commit point, may succeed); `verify` passes; the checkpoint loads whole at the
previous step or, past the commit point, at the new one; and a following save commits and
leaves only ``CURRENT``, the kept versions and nothing else.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path
from typing import Any

import fsdp_ckpt as ck
import pytest
import torch
from fsdp_comm import launch

from . import ranks

TIMEOUT = 60
METHODS = (
    "open_write",
    "open_read",
    "size",
    "exists",
    "listdir",
    "makedirs",
    "rename",
    "remove",
    "read_all",
    "sync_dir",
    "create_exclusive",
    "make_dir",
)


class _File:
    """A file opened for writing whose writes and close count as storage calls."""

    def __init__(self, inner: Any, tick: Any) -> None:
        self._inner, self._tick = inner, tick

    def write(self, data: Any, /) -> int | None:
        self._tick("write")
        return self._inner.write(data)

    def close(self) -> None:
        self._tick("close")
        self._inner.close()

    def __enter__(self) -> _File:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class FaultyStorage(ck.LocalStorage):
    """Local storage that counts its calls and fails call number ``fail_at`` (None: none)."""

    def __init__(self, fail_at: int | None = None) -> None:
        super().__init__()
        self.calls, self.fail_at, self.failed = 0, fail_at, ""

    def tick(self, name: str) -> None:
        self.calls += 1
        if self.calls == self.fail_at:
            self.failed = name
            raise OSError(errno.EIO, f"injected fault at storage call {self.calls} ({name})")


def _counted(name: str) -> Any:
    def method(self: FaultyStorage, *args: Any, **kwargs: Any) -> Any:
        self.tick(name)
        out = getattr(ck.LocalStorage, name)(self, *args, **kwargs)
        return _File(out, self.tick) if name == "open_write" else out

    return method


for _name in METHODS:
    setattr(FaultyStorage, _name, _counted(_name))


def _trained(be: Any, steps: int) -> tuple[Any, Any]:
    model = ranks.shard(ranks.build(0), be)
    opt = ranks.optimizer(model)
    ranks.train(model, opt, be.rank, be.world_size, range(steps))
    return model, opt


def faults_in_one_group(
    be: Any, root: str, fault_rank: int, calls: list[int | None]
) -> list[dict[str, Any]]:
    """For each call number: copy the step-1 checkpoint (rank 0), then save step 2 with rank
    ``fault_rank``'s storage failing at that call. One group for all of them: a failed save
    must leave the ranks able to go on (the vote, not a hang or an abort)."""
    model, opt = _trained(be, 1)
    base = os.path.join(root, "base")
    ck.save(base, model, opt, extra={"step": 1}, keep_last=1)
    ck.wait_for_cleanup(base)
    ranks.train(model, opt, be.rank, be.world_size, range(1, 2))
    out = []
    for n in calls:
        path = os.path.join(root, f"call{n}")
        if be.rank == 0:
            shutil.copytree(base, path, ignore=shutil.ignore_patterns(".lock"))
        be.barrier()
        storage = FaultyStorage(n if be.rank == fault_rank else None)
        try:
            ck.save(path, model, opt, extra={"step": 2}, keep_last=1, storage=storage)
            error = ""
        except Exception as exc:  # noqa: BLE001 - the message is what is checked
            error = _what_the_user_sees(exc)
        ck.wait_for_cleanup(path)
        be.barrier()
        out.append({"calls": storage.calls, "error": error, "path": path})
    return out


def _what_the_user_sees(exc: BaseException) -> str:
    """The error's message, its notes and its chained causes: what a traceback prints."""
    parts: list[str] = []
    seen: BaseException | None = exc
    while seen is not None:
        parts += [f"{type(seen).__name__}: {seen}", *getattr(seen, "__notes__", [])]
        seen = seen.__cause__ or seen.__context__
    return "\n".join(parts)


@pytest.fixture(scope="module")
def states(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, torch.Tensor]]:
    """The model state of a clean run at steps 1 and 2 (what a loaded checkpoint must equal),
    saved once for both fault ranks."""
    tmp_path = tmp_path_factory.mktemp("clean")
    out = {}
    for step in (1, 2):
        path = str(tmp_path / f"clean-{step}")
        launch(_save_clean, 2, backend="threads", args=(path, step), timeout=TIMEOUT)
        model = ranks.build(1)
        assert ck.load(path, model) == {"step": step}
        out[step] = {k: v.clone() for k, v in model.state_dict().items()}
    return out


def _save_clean(be: Any, path: str, steps: int) -> None:
    model, opt = _trained(be, steps)
    ck.save(path, model, opt, extra={"step": steps}, keep_last=1)


def _check_whole(path: str, states: dict[int, dict[str, torch.Tensor]]) -> int:
    ck.verify(path)
    model = ranks.build(1)
    step = ck.load(path, model)["step"]
    for name, value in model.state_dict().items():
        assert torch.equal(value, states[step][name]), f"{path}: {name} differs at step {step}"
    return step


def _save_again(be: Any, paths: list[str]) -> None:
    model = ranks.shard(ranks.build(0), be)
    for path in paths:
        ck.save(path, model, extra={"step": 9}, keep_last=1)
        ck.wait_for_cleanup(path)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("fault_rank", [0, 1])
def test_a_fault_at_every_storage_call_loses_nothing(
    tmp_path: Path, fault_rank: int, states: dict[int, dict[str, torch.Tensor]]
) -> None:
    counted = launch(
        faults_in_one_group,
        2,
        backend="threads",
        args=(str(tmp_path / "count"), fault_rank, [None]),
        timeout=TIMEOUT,
    )
    calls = counted[fault_rank][0]["calls"]
    assert calls >= 10, counted  # the save really goes through this storage
    numbers = list(range(1, calls + 1))
    runs = launch(
        faults_in_one_group,
        2,
        backend="threads",
        args=(str(tmp_path / "faults"), fault_rank, numbers),
        timeout=600,
    )
    outcomes: dict[str, int] = {}
    for n, mine, other in zip(numbers, runs[fault_rank], runs[1 - fault_rank]):
        step = _check_whole(mine["path"], states)
        if mine["error"]:  # every rank fails, and every message names the injected fault
            for error in (mine["error"], other["error"]):
                assert f"injected fault at storage call {n}" in error, (n, error[:2000])
        assert mine["error"] or step == 2, (n, step)
        key = f"{'refused' if mine['error'] else 'committed'}, step {step}"
        outcomes[key] = outcomes.get(key, 0) + 1
    launch(_save_again, 2, backend="threads", args=([r["path"] for r in runs[0]],), timeout=600)
    for run in runs[0]:
        assert _check_whole_step(run["path"]) == 9
        left = sorted(set(os.listdir(run["path"])) - {".lock"})
        assert len(left) == 2 and left[0] == "CURRENT" and left[1].startswith("v"), left
    assert outcomes.get("refused, step 1", 0) > 0, outcomes


def _check_whole_step(path: str) -> int:
    ck.verify(path)
    return ck.load(path, ranks.build(1))["step"]
