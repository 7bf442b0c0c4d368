"""A save whose disk is full when it takes the lock leaves no temporary file (issue #30's soak).

`LocalStorage.create_exclusive` writes the lock's content to ``P/.lock.<hex>.tmp`` and then
hard-links it to ``P/.lock``; when the disk fills during that write, the save fails but the
``.tmp`` file stays, until the next save that commits lists it as a leftover. Found by
`scripts/soak-two-hosts` with a checkpoint disk filled to the last byte: after the failed
save, the directory held ``.lock.344dbbcf6f09.tmp`` until the next commit.
"""

from __future__ import annotations

import builtins
import errno
import os
from pathlib import Path
from typing import Any

import fsdp_ckpt as ck
import fsdp_ckpt._storage as storage_module
import pytest

from . import ranks


class _FullFile:
    """A new file on a full disk: every write raises ENOSPC, as the operating system's does."""

    def __init__(self, f: Any) -> None:
        self._f = f

    def write(self, data: Any) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def __enter__(self) -> _FullFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self._f.close()


def test_a_full_disk_at_the_lock_leaves_no_temporary_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "run"
    ck.save(str(path), ranks.build(0), extra={"step": 1})

    def full_open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        f = builtins.open(file, mode, *args, **kwargs)
        return _FullFile(f) if "x" in mode and str(file).endswith(".tmp") else f

    monkeypatch.setattr(storage_module, "open", full_open, raising=False)
    with pytest.raises(OSError) as info:
        ck.save(str(path), ranks.build(1), extra={"step": 2})
    assert info.value.errno == errno.ENOSPC
    monkeypatch.undo()
    assert sorted(os.listdir(path)) == ["CURRENT", "v000001"]
    assert ck.load(str(path), ranks.build(2)) == {"step": 1}
