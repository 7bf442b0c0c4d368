"""Which files a checkpoint may name, and which it may open.

An index (or a DCP checkpoint's metadata) names its files, and whoever wrote it decides those
names. So every name must be a plain file name inside the checkpoint's own directory: no
directories, no ``..``, no absolute paths. On the local file system the file must also be a
regular file (a FIFO would block the reader forever, ``/dev/zero`` never ends) and, when it is
a symbolic link, one that stays inside the directory. Both are checked with ``lstat``/``stat``
before anything is opened.
"""

from __future__ import annotations

import os
import re
import stat

from ._errors import CheckpointCorruptError
from ._storage import LocalStorage, Storage

__all__ = ["check_file_name", "check_regular", "check_member", "show"]

# What fsdp-ckpt and DCP write ("shard-00003.safetensors", "__0_0.distcp"), and nothing that a
# file system could read as a path: no separators, no "." or "..", no NUL, not empty.
_NAME = re.compile(r"[A-Za-z0-9_.+-]{1,255}")


def show(value: object, limit: int = 60) -> str:
    """A short ``repr`` for error messages (a crafted value may be megabytes long)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def check_file_name(name: object, *, field: str, source: str) -> str:
    """``name`` if it is a plain file name; else CheckpointCorruptError naming ``field``."""
    if not isinstance(name, str) or not _NAME.fullmatch(name) or name in (".", ".."):
        raise CheckpointCorruptError(
            f"{field}: {show(name)} is not a plain file name in the checkpoint directory "
            "(letters, digits, '_', '.', '+', '-'; no '/', '..' or absolute paths)",
            path=source,
        )
    return name


def _kind(mode: int) -> str:
    for test, what in (
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISLNK, "a symbolic link"),
    ):
        if test(mode):
            return what
    return "not a regular file"


def _stat(path: str, *, follow: bool, missing_ok: bool = False) -> os.stat_result | None:
    try:
        return os.stat(path) if follow else os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        if missing_ok:
            return None
        raise CheckpointCorruptError("missing (the checkpoint index lists it)", path=path) from None
    except OSError as exc:  # ELOOP, EACCES, ...
        raise CheckpointCorruptError(f"cannot be examined ({exc.strerror})", path=path) from None


def _inside(directory: str, path: str) -> bool:
    root = os.path.realpath(directory)
    target = os.path.realpath(path)
    return os.path.commonpath([root, target]) == root and target != root


def check_regular(storage: Storage, path: str, *, missing_ok: bool = False) -> None:
    """Refuse to open ``path`` on the local file system unless it is a regular file and, when
    it is a symbolic link, one to a file in the same directory (resolved). Other storages
    hold only objects, so there is nothing to check there. ``missing_ok``: a path that is
    not there (or vanishes meanwhile) passes; opening it will say so."""
    if not isinstance(storage, LocalStorage):
        return
    link = _stat(path, follow=False, missing_ok=missing_ok)
    if link is not None and stat.S_ISLNK(link.st_mode):
        directory = os.path.dirname(path) or "."
        if not _inside(directory, path):
            raise CheckpointCorruptError(
                f"is a symbolic link to {os.path.realpath(path)}, "
                f"outside the checkpoint directory {directory}",
                path=path,
            )
    target = _stat(path, follow=True, missing_ok=missing_ok)
    if target is None:
        return
    mode = target.st_mode
    if not stat.S_ISREG(mode):
        raise CheckpointCorruptError(
            f"is {_kind(mode)}, not a regular file; refusing to open it", path=path
        )


def check_member(storage: Storage, directory: str, name: str) -> str:
    """The path of file ``name`` (a plain name) of ``directory``, once `check_regular` passed."""
    path = storage.join(directory, name)
    check_regular(storage, path)
    return path
