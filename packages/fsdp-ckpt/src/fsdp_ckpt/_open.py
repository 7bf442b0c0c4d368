"""`open_guarded`: find a committed checkpoint and make sure its index is safe to act on.

`open_checkpoint` resolves the pointer and parses the index (every field checked, see
`_index`); this adds what needs the file system: the pointer and index files must be regular
files (a FIFO named ``CURRENT`` would block every reader), and every file the index lists must
be a regular file inside the version directory with the size the index records, before any
reader opens one or allocates memory from the index's shapes.
"""

from __future__ import annotations

import os
import re

from ._directory import INDEX_FILE, POINTER_FILE, OpenCheckpoint, open_checkpoint
from ._errors import CheckpointCorruptError
from ._paths import check_member, check_regular
from ._storage import LocalStorage, Storage

__all__ = ["open_guarded"]

_VERSION_DIR = re.compile(r"v\d{6,}")


def _check_structure(storage: Storage, path: str) -> None:
    """The pointer and the index files that `open_checkpoint` may read are regular files."""
    if not isinstance(storage, LocalStorage):
        return
    candidates = [os.path.join(path, POINTER_FILE), os.path.join(path, INDEX_FILE)]
    candidates += [
        os.path.join(path, name, INDEX_FILE)
        for name in storage.listdir(path)
        if _VERSION_DIR.fullmatch(name)
    ]
    for candidate in candidates:
        # A superseded version may be deleted meanwhile by a save's cleanup: absent is fine.
        check_regular(storage, candidate, missing_ok=True)


def _check_files(storage: Storage, opened: OpenCheckpoint) -> None:
    for name, digest in opened.index.files.items():
        path = check_member(storage, opened.directory, name)
        size = storage.size(path)
        if size != digest.size:
            what = "truncated" if size < digest.size else "longer than recorded"
            raise CheckpointCorruptError(
                f"{what}: {size} bytes, the index records {digest.size}", path=path
            )


def open_guarded(storage: Storage, path: str, *, check_files: bool = True) -> OpenCheckpoint:
    """`open_checkpoint`, refusing special files; with ``check_files`` (on the local file
    system) every listed file is also checked to be a regular file inside the version
    directory, of the recorded size. Raises `CheckpointError` naming the file."""
    _check_structure(storage, path)
    opened = open_checkpoint(storage, path)
    if check_files and isinstance(storage, LocalStorage):
        _check_files(storage, opened)
    return opened
